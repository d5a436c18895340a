"""``ragcache demo``: real questions from the Python FAQ answered over the Python docs, with and
without document-level KV reuse, side by side in one run.

How it measures (stated in the JSON and the README):

1. The corpus is indexed once (``ragcache index``; by default the Python FAQ, where the questions'
   answers are); retrieval is computed once per question and the same documents are given to
   both runs.
2. The sample is drawn so that documents recur: starting from a seeded random FAQ question, the
   question sharing the most retrieved documents with those already chosen is added next.
3. **Warm-up pass**: every question once with the cache on, up to its first token (its TTFT is
   reported as ``cold``; it puts the prompt's KV in the cache, as a first request would).
4. **Measured pass**, in steady state as when the same questions come back: for each question,
   one request with the cache on and, right after it, the same request with caching off (the
   no-cache baseline recomputes the whole prompt). Interleaving keeps machine noise fair to both.
5. Mean TTFT both ways and their ratio; the answers of the cached and uncached runs are compared
   token for token (greedy decoding).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragcache_backend.engine.setup import REFERENCE_PROFILE, REFERENCE_PROFILE_BF16, reference_profile
from ragcache_backend.errors import InvalidRequestError

__all__ = ["REFERENCE_PROFILE", "REFERENCE_PROFILE_BF16", "DemoRecord", "DemoReport", "reference_profile", "run_demo", "write_report"]


@dataclass(slots=True, frozen=True)
class DemoRecord:
    """One question's measurements (seconds, tokens)."""

    question: str
    documents: tuple[str, ...]
    cold_ttft_s: float
    ttft_cached_s: float
    ttft_uncached_s: float
    prompt_tokens: int
    cached_tokens: int
    device_hits: int
    host_hits: int
    answer_cached: str
    answer_uncached: str
    identical: bool


@dataclass(slots=True, frozen=True)
class DemoReport:
    """The whole demo run; ``ratio`` = mean uncached TTFT / mean cached TTFT."""

    records: tuple[DemoRecord, ...]
    mean_ttft_cached_s: float
    mean_ttft_uncached_s: float
    ratio: float
    answers_identical: bool
    document_recurrence: float
    model: str
    machine: str
    date: str
    config: dict
    phases_s: dict[str, float] = field(default_factory=dict)
    """Wall time of each phase in seconds (``retrieval``, ``warm-up``, ``measured``; the CLI adds
    ``index`` and ``model``)."""


def pick_recurring(questions: Sequence[str], retrieved: Sequence[Sequence[str]], n: int, seed: int) -> list[int]:
    """Indices of ``n`` questions chosen so that their retrieved document ids recur.

    Greedy: a seeded random first question, then repeatedly the question whose documents overlap
    most with the documents already chosen (ties broken by the seeded order).
    """
    if n < 1:
        raise InvalidRequestError(f"the demo needs at least one question, got {n}")
    order = list(range(len(questions)))
    random.Random(seed).shuffle(order)
    chosen = [order[0]]
    seen: Counter[str] = Counter(retrieved[order[0]])
    while len(chosen) < min(n, len(order)):
        best = max((i for i in order if i not in chosen), key=lambda i: sum(d in seen for d in retrieved[i]))
        chosen.append(best)
        seen.update(retrieved[best])
    return chosen


def recurrence(retrieved: Sequence[Sequence[str]]) -> float:
    """Share of retrieved document slots whose document already appeared earlier in the sample."""
    seen: set[str] = set()
    repeats = total = 0
    for docs in retrieved:
        for d in docs:
            total += 1
            repeats += d in seen
            seen.add(d)
    return repeats / total if total else 0.0


def run_demo(engine, store, questions: Sequence[str], *, k: int, num_questions: int, max_tokens: int,
             seed: int = 0, progress=None, vector_cache: Path | None = None) -> DemoReport:
    """Run the demo protocol above on ``questions`` with ``engine`` and ``store``.

    ``progress(i, total, label)`` is called before each request when given. ``vector_cache``: a
    folder keeping the questions' vectors between runs (see :meth:`DocumentStore.search_many`).
    """
    from ragcache_backend.model.sampling import SamplingParams

    clock = time.perf_counter()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = now - clock
        clock = now

    hits = store.search_many(questions, k, cache_dir=vector_cache)
    ids = [[h.document.doc_id for h in hs] for hs in hits]
    picked = pick_recurring(questions, ids, num_questions, seed)
    phase("retrieval")
    sampling = SamplingParams(max_tokens=max_tokens)
    first_token = SamplingParams(max_tokens=1)  # the warm-up needs the prompt's KV and its TTFT only
    total = 3 * len(picked)
    step = 0

    def tick(label: str) -> None:
        nonlocal step
        step += 1
        if progress:
            progress(step, total, label)

    cold = {}
    for i in picked:
        tick("warm-up")
        cold[i] = engine.generate(questions[i], [h.document for h in hits[i]], first_token, use_cache=True)
    phase("warm-up")
    records = []
    for i in picked:
        docs = [h.document for h in hits[i]]
        tick("cached")
        on = engine.generate(questions[i], docs, sampling, use_cache=True)
        tick("no cache")
        off = engine.generate(questions[i], docs, sampling, use_cache=False)
        records.append(DemoRecord(
            question=questions[i], documents=tuple(ids[i]), cold_ttft_s=cold[i].ttft_s,
            ttft_cached_s=on.ttft_s, ttft_uncached_s=off.ttft_s, prompt_tokens=on.prompt_tokens,
            cached_tokens=on.cached_tokens, device_hits=on.device_hits, host_hits=on.host_hits,
            answer_cached=on.answer, answer_uncached=off.answer, identical=on.token_ids == off.token_ids,
        ))
    phase("measured")
    mean_on = statistics.fmean(r.ttft_cached_s for r in records)
    mean_off = statistics.fmean(r.ttft_uncached_s for r in records)
    cfg = engine.config
    return DemoReport(
        records=tuple(records), mean_ttft_cached_s=mean_on, mean_ttft_uncached_s=mean_off,
        ratio=mean_off / mean_on, answers_identical=all(r.identical for r in records),
        document_recurrence=recurrence([ids[i] for i in picked]), model=engine.model_name,
        machine=f"{platform.machine()} {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        config={"k": k, "max_tokens": max_tokens, "seed": seed, "dtype": str(engine.dtype).removeprefix("torch."), "policy": cfg.policy,
                "threads": cfg.threads, "device_budget_bytes": cfg.device_budget_bytes,
                "host_budget_bytes": cfg.host_budget_bytes, "block_size": cfg.block_size,
                "corpus_chunks": len(store), "questions_in_pool": len(questions)},
        phases_s=phases,
    )


def write_report(report: DemoReport, path: Path) -> None:
    """Write the report as JSON (per-question records, means, ratio, protocol)."""
    payload = asdict(report)
    payload["protocol"] = (__doc__ or "").strip()
    Path(path).write_text(json.dumps(payload, indent=2, ensure_ascii=False))
