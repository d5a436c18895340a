"""Do cached and uncached answers agree in bf16? (issue: "bf16 exactness")

For each of N real requests (Python FAQ questions, top-k FAQ sections from a Faiss index over the
FAQ, the default model in bfloat16, greedy, ``--max-tokens`` tokens) the answer is generated three
ways, one request at a time:

* **off**: the cache off (the whole prompt computed cold);
* **miss**: the cache on, first sight of the prompt (the system prompt is reused, the documents
  and question are computed on top of it, then inserted);
* **hit**: the cache on, the same prompt again (all but its last token reused).

It reports how many answers are token-identical to ``off`` (whole answers and first tokens) and,
where they differ, at which token. The fp32 exactness (logits within 1e-4) is a test
(``tests/model/test_real_model.py``); this script is the bf16 figure.

    .venv/bin/python benchmarks/bf16_agreement.py --requests 150 --max-tokens 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """Index of the first differing token (length difference counts), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from ragcache_backend import EngineConfig, RAGCacheEngine, SamplingParams
    from ragcache_backend.demo.datasets import faq_questions, python_docs_dir
    from ragcache_backend.retrieval.docstore import build_index

    docs_dir = python_docs_dir()
    questions = faq_questions(docs_dir)
    questions = (questions * (1 + args.requests // max(1, len(questions))))[: args.requests]
    store = build_index(docs_dir / "faq", Path(tempfile.mkdtemp(prefix="faq-index-")), progress=False)
    engine = RAGCacheEngine(EngineConfig(dtype=args.dtype, threads=args.threads), store=store)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    rows = []
    t0 = time.time()
    for i, q in enumerate(questions):
        docs = [h.document for h in store.search(q, args.k)]
        off = engine.generate(q, docs, sampling, use_cache=False)
        miss = engine.generate(q, docs, sampling)
        hit = engine.generate(q, docs, sampling)
        rows.append({
            "question": q, "prompt_tokens": off.prompt_tokens,
            "miss_cached": miss.cached_tokens, "hit_cached": hit.cached_tokens,
            "miss_diff_at": first_difference(miss.token_ids, off.token_ids),
            "hit_diff_at": first_difference(hit.token_ids, off.token_ids),
        })
        if (i + 1) % 25 == 0:
            print(f"{i + 1}/{len(questions)} requests, {time.time() - t0:.0f} s", flush=True)
    n = len(rows)
    summary = {
        "requests": n, "max_tokens": args.max_tokens, "k": args.k, "dtype": args.dtype, "threads": args.threads,
        "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rows) / n,
        "hit_identical": sum(r["hit_diff_at"] is None for r in rows),
        "hit_first_token_equal": sum(r["hit_diff_at"] != 0 for r in rows),
        "miss_identical": sum(r["miss_diff_at"] is None for r in rows),
        "miss_first_token_equal": sum(r["miss_diff_at"] != 0 for r in rows),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(summary, indent=1))
    print(f"hit  vs off: {summary['hit_identical']}/{n} answers identical ({100 * summary['hit_identical'] / n:.1f}%), "
          f"first token equal {summary['hit_first_token_equal']}/{n}")
    print(f"miss vs off: {summary['miss_identical']}/{n} answers identical ({100 * summary['miss_identical'] / n:.1f}%), "
          f"first token equal {summary['miss_first_token_equal']}/{n}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
