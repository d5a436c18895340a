"""The trace of ``benchmarks/chunk_serve_vllm.py`` (chunk_eval's, seed 0: 60 warm-up requests, then 24)
served by the chunk engine alone, printing per request what the guard did (scratch script of
2026-11-28; run from the repository root):

    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx-gemm/chunk_trace_only.py bfloat16 0.012   # dtype, chunk_guard (or none)
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")

import torch  # noqa: E402
from chunk_eval import trace  # noqa: E402

from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.sampling import SamplingParams  # noqa: E402

MiB = 1 << 20
torch.set_num_threads(2)
args = argparse.Namespace(requests=24, warmup=60, k_min=5, k_max=8, mmlu=200, zipf=1.0, question_first=True, library=True, seed=0)
_store, _wl, items = trace(args)
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
guard = None if len(sys.argv) > 2 and sys.argv[2] == "none" else float(sys.argv[2]) if len(sys.argv) > 2 else 0.012
cfg = EngineConfig(reuse="auto", chunk_alpha=1.0, dtype=dtype, threads=2, device_budget_bytes=2048 * MiB,
                   host_budget_bytes=4096 * MiB, max_batch_size=16, max_batch_tokens=32768, chunk_guard=guard)
eng = RAGCacheEngine(cfg, loaded=load_model(None, dtype=dtype))
rule, one = cfg.recompute_rule(), SamplingParams(max_tokens=1)
segs = [eng.segments_for(q, docs, one, question_first=True)[0] for q, _src, docs in items]
for ss in segs[: args.warmup]:
    eng.submit_segments(ss, one, recompute=rule).result()
rows = []
for n in range(args.requests):
    r = eng.submit_segments(segs[args.warmup + n], one, recompute=rule).result()
    rows.append(r)
    print(f"{n + 1} {r.prompt_tokens} tok: {r.ttft_s:.3f} s, hits {r.chunk_hits}, computed {r.computed_tokens}, "
          f"recomputed {r.recomputed_tokens}, again by the guard {r.guard_tokens}", flush=True)
held = rows[8:]
print(f"held-out mean TTFT {statistics.mean(r.ttft_s for r in held):.3f} s; with chunk hits "
      f"{statistics.mean(r.ttft_s for r in held if r.chunk_hits):.3f} s")
eng.close()
