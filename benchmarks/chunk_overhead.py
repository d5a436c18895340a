"""What the chunk modes cost and save per request, against the knowledge tree alone, in one run.

    .venv/bin/python benchmarks/chunk_overhead.py [--prompts 12] [--alpha 2] [--dtype float32|bfloat16] [--json OUT]

Prompts: paragraphs of the Python FAQ ("programming"), five per prompt, with a FAQ question first
(LangChain's stock question-first layout), ``--dtype`` (float32), ``max_tokens=1`` (TTFT is the prefill).

* **Miss**: the cache is emptied before each request, which then runs with ``reuse="exact"``, with
  ``reuse="auto"`` and with ``reuse="auto"`` whose attention statistics come from the torch reference
  (``segment_attention_mass``; ``chunk_stats.segment_mass_available`` patched to False meanwhile: what
  every chunk-mode request paid before the float32 statistics kernel), the order rotating per
  prompt: nothing can be reused, so the difference is what the chunk mode adds (attention
  statistics recorded for future reuse, planning).
* **Hit**: one question is asked over the five paragraphs (``auto``: they become chunk variants),
  then another question over the same paragraphs shuffled, with ``reuse="auto"`` (``store=False``,
  the cache state untouched) and then ``reuse="exact"`` (the tree alone reuses only the template).

Printed: mean TTFT per mode, the auto/exact ratios, and the hit case's computed and recomputed
tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from benchmark_report import write_report  # noqa: E402

from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.demo.datasets import faq_questions, python_docs_dir  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.kernels import chunk_stats  # noqa: E402
from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.sampling import SamplingParams  # noqa: E402

MiB = 1 << 20
TORCH_STATS = "auto, torch statistics"


@contextmanager
def torch_statistics():
    """The chunk statistics on the torch reference while inside (the path before the kernel)."""
    real = chunk_stats.segment_mass_available
    chunk_stats.segment_mass_available = lambda q, k: False
    try:
        yield
    finally:
        chunk_stats.segment_mass_available = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--alpha", type=float, default=None, help="chunk_alpha (default: the engine's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from forward_vs_vllm import machine

    text = (python_docs_dir() / "faq" / "programming.rst.txt").read_text()
    paras = [p for p in text.split("\n\n") if len(p) > 400]
    questions = faq_questions()
    rng = random.Random(args.seed)
    cfg = EngineConfig(dtype=args.dtype, threads=args.threads, device_budget_bytes=512 * MiB, host_budget_bytes=1024 * MiB)
    if args.alpha is not None:
        cfg = cfg.model_copy(update={"chunk_alpha": args.alpha})
    engine = RAGCacheEngine(cfg, loaded=load_model(None, dtype=args.dtype))
    one = SamplingParams(max_tokens=1)

    miss: dict[str, list[float]] = {"exact": [], "auto": [], TORCH_STATS: []}
    modes = list(miss)
    for i in range(args.prompts + 1):  # the first round warms the kernels up and is left out
        segs, _ = engine.segments_for(questions[i], rng.sample(paras, 5), one, question_first=True)
        for name in modes[i % 3:] + modes[: i % 3]:
            engine.reset_cache()
            with torch_statistics() if name == TORCH_STATS else nullcontext():
                r = engine.submit_segments(segs, one, reuse="exact" if name == "exact" else "auto").result()
            if i:
                miss[name].append(r.ttft_s)
        print(f"miss {i}: {r.prompt_tokens} tokens, " + ", ".join(f"{k} {v[-1] if i else 0:.3f} s" for k, v in miss.items()),
              flush=True)

    hit: dict[str, list[float]] = {"exact": [], "auto": []}
    computed: dict[str, list[int]] = {"exact": [], "auto": []}
    recomputed, chunk_hits = [], []
    for i in range(args.prompts):
        docs = rng.sample(paras, 5)
        engine.reset_cache()
        first, _ = engine.segments_for(questions[40 + 2 * i], docs, one, question_first=True)
        engine.submit_segments(first, one, reuse="auto").result()
        shuffled = docs[:]
        rng.shuffle(shuffled)
        segs, _ = engine.segments_for(questions[41 + 2 * i], shuffled, one, question_first=True)
        # auto first without storing, then exact (which stores, and would hand auto an exact prefix)
        for mode in ("auto", "exact"):
            r = engine.submit_segments(segs, one, reuse=mode, store=mode == "exact").result()
            hit[mode].append(r.ttft_s)
            computed[mode].append(r.computed_tokens)
            if mode == "auto":
                recomputed.append(r.recomputed_tokens)
                chunk_hits.append(r.chunk_hits)
        print(f"hit {i}: {r.prompt_tokens} tokens, exact {hit['exact'][-1]:.3f} s ({computed['exact'][-1]} computed), "
              f"auto {hit['auto'][-1]:.3f} s ({computed['auto'][-1]} computed, {recomputed[-1]} recomputed, "
              f"{chunk_hits[-1]} chunk hits)", flush=True)

    mean = statistics.mean
    report = {
        "machine": machine(), "dtype": args.dtype, "chunk_alpha": cfg.chunk_alpha, "prompts": args.prompts,
        "miss": {"ttft_exact_s": mean(miss["exact"]), "ttft_auto_s": mean(miss["auto"]),
                 "auto_over_exact": mean(miss["auto"]) / mean(miss["exact"]),
                 "ttft_auto_torch_statistics_s": mean(miss[TORCH_STATS]),
                 "auto_torch_statistics_over_exact": mean(miss[TORCH_STATS]) / mean(miss["exact"])},
        "hit": {"ttft_exact_s": mean(hit["exact"]), "ttft_auto_s": mean(hit["auto"]),
                "auto_over_exact": mean(hit["auto"]) / mean(hit["exact"]),
                "computed_exact": mean(computed["exact"]), "computed_auto": mean(computed["auto"]),
                "recomputed_auto": mean(recomputed), "chunk_hits": mean(chunk_hits)},
    }
    write_report(report, args.json)


if __name__ == "__main__":
    main()
