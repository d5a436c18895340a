"""The bf16 chunk trace (``benchmarks/chunk_serve_vllm.py``'s: chunk_eval's, seed 0, 60 warm-up
requests then 24) on the chunk engine alone, per request: TTFT, the time its admission and commit
charged (``sched_s``: the guard's second pass included), the time its reused chunks' KV took to copy
into place (``kv_copy_s``), and one plain forward pass of as many tokens as it computed (scratch
script of 2026-11-28; run from the repository root):

    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx-decode/chunk_trace_kv_copies.py auto
"""
import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")

import torch  # noqa: E402
from chunk_eval import trace  # noqa: E402

from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.runner import ForwardInput, KVRun  # noqa: E402
from ragcache_backend.model.sampling import SamplingParams  # noqa: E402

MiB = 1 << 20
torch.set_num_threads(2)
args = argparse.Namespace(requests=24, warmup=60, k_min=5, k_max=8, mmlu=200, zipf=1.0, question_first=True, library=True, seed=0)
_store, _wl, items = trace(args)
cfg = EngineConfig(reuse=sys.argv[1] if len(sys.argv) > 1 else "auto", chunk_alpha=1.0, dtype="bfloat16", threads=2,
                   device_budget_bytes=2048 * MiB, host_budget_bytes=4096 * MiB, max_batch_size=16, max_batch_tokens=32768,
                   chunk_guard=0.012)
eng = RAGCacheEngine(cfg, loaded=load_model(None, dtype="bfloat16"))
rule, one = cfg.recompute_rule(), SamplingParams(max_tokens=1)
segs = [eng.segments_for(q, docs, one, question_first=True)[0] for q, _src, docs in items]
for ss in segs[: args.warmup]:
    eng.submit_segments(ss, one, recompute=rule).result()
for n in range(args.requests):
    handle = eng.submit_segments(segs[args.warmup + n], one, recompute=rule)
    r, m = handle.result(), handle.metrics
    eng.wait_idle()
    blocks = eng.cache.allocate(-(-r.computed_tokens // eng.runner.block_size))
    ids = [1000 + (i % 5000) for i in range(r.computed_tokens)]
    t = time.perf_counter()
    eng.runner.forward([ForwardInput(tuple(ids), (), (KVRun(tuple(blocks), 0, len(ids)),))])
    raw = time.perf_counter() - t
    eng.cache.free(tuple(blocks))
    print(f"{n + 1} {r.prompt_tokens} tok hits {r.chunk_hits} computed {r.computed_tokens}: ttft {r.ttft_s:.3f} "
          f"sched {m.sched_s:.3f} kv copies {m.kv_copy_s:.3f} plain pass {raw:.3f}", flush=True)
eng.close()
