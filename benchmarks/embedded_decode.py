"""The embedded engine as an application uses it: built on the main thread, questions asked there
(the query embedded there, the answer generated on the engine's step-loop thread); time per
generated token and TTFT. A check of the step loop's speed from the API users call, for A/B runs
of two versions (``ab_commits.py``): kernel-level timings (``forward_vs_vllm.py``) run the forward
on the main thread and miss what the threads around it do to it (``omp_thread_penalty.py``).

    .venv/bin/python benchmarks/embedded_decode.py [--dtype auto] [--questions 6] [--max-tokens 96] [--json out.json]

``--user-torch``: after retrieval (``store.search``, our embedder) and before ``engine.generate``
the main thread runs a torch op of its own, as an application's own model would (LangChain's
``HuggingFaceEmbeddings`` embedding a query before our chat model answers): that thread then owns
an OpenMP pool while the engine generates. Without it the timed call is ``engine.ask``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from forward_vs_vllm import machine  # noqa: E402
from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.demo.datasets import demo_corpus_dir, faq_questions, python_docs_dir  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.sampling import SamplingParams  # noqa: E402
from ragcache_backend.retrieval.docstore import build_index  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--user-torch", action="store_true", help="the main thread runs torch before each question")
    args = ap.parse_args()
    store = build_index(demo_corpus_dir())  # the FAQ, as `ragcache demo`
    engine = RAGCacheEngine(EngineConfig(dtype=args.dtype, threads=args.threads), store=store)
    questions = faq_questions(python_docs_dir())[: args.questions]
    sampling = SamplingParams(max_tokens=args.max_tokens)
    user_x = torch.randn(64, 384)

    def user_work() -> None:  # a MiniLM-sized matmul on the calling thread: its OpenMP pool is made
        (user_x @ user_x.T).sum().item()

    for q in questions:  # warm-up: the documents' KV cached, every kernel built
        engine.ask(q, k=3, sampling=sampling)
    per_token, ttft = [], []
    for q in questions:
        if args.user_torch:
            docs = [h.document for h in store.search(q, 3)]
            user_work()
            start = time.perf_counter()
            result = engine.generate(q, docs, sampling)
        else:
            start = time.perf_counter()
            result = engine.ask(q, k=3, sampling=sampling)
        wall = time.perf_counter() - start
        if len(result.token_ids) > 1:
            per_token.append((wall - result.ttft_s) / (len(result.token_ids) - 1))
        ttft.append(result.ttft_s)
    summary = {"ms_per_token": statistics.median(per_token) * 1e3, "ttft_ms": statistics.median(ttft) * 1e3,
               "dtype": str(engine.dtype), "machine": machine(), "questions": len(questions), "user_torch": args.user_torch}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary}, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
