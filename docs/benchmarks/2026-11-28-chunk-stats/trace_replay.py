"""chunk_serve_vllm.py's trace (same seed, warm-up and engine settings) on the chunk engine alone, one
second idle before each measured request as that script's vLLM settle gives it (scratch script of
2026-11-28; run from the repository root):

    .venv/bin/python docs/benchmarks/2026-11-28-chunk-stats/trace_replay.py [IDLE_SECONDS]
"""
import os, sys, time, argparse
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from chunk_eval import trace
from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.model.loader import load_model
from ragcache_backend.model.sampling import SamplingParams
MiB = 1 << 20
torch.set_num_threads(2)
args = argparse.Namespace(requests=24, warmup=60, calibrate=8, k_min=5, k_max=8, mmlu=200, zipf=1.0, question_first=True,
                          library=True, seed=0, alpha=1.0, guard=None, threads=2, dtype="bfloat16", device_mib=2048, host_mib=4096)
_s, _w, items = trace(args)
cfg = EngineConfig(reuse="auto", chunk_alpha=1.0, dtype="bfloat16", threads=2, device_budget_bytes=2048 * MiB,
                   host_budget_bytes=4096 * MiB, max_batch_size=16, max_batch_tokens=32768, host_commit="background")
chunk = RAGCacheEngine(cfg, loaded=load_model(None, dtype="bfloat16"))
rule = cfg.recompute_rule()
one = SamplingParams(max_tokens=1)
segs = [chunk.segments_for(q, docs, one, question_first=True)[0] for q, _src, docs in items]
for ss in segs[:60]:
    chunk.submit_segments(ss, one, recompute=rule).result()
idle = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
for n in range(24):
    time.sleep(idle)
    t = time.perf_counter()
    r = chunk.submit_segments(segs[60 + n], one, recompute=rule).result()
    wall = time.perf_counter() - t
    print(f"{n+1}: {r.prompt_tokens} tok ttft {r.ttft_s:.3f} wall {wall:.3f} hits {r.chunk_hits} computed {r.computed_tokens} "
          f"recomputed {r.recomputed_tokens} guard {r.guard_tokens} cached {r.cached_tokens} chunk_cached {r.chunk_cached_tokens} "
          f"dev {r.device_hits} host {r.host_hits} disk {r.disk_hits}", flush=True)
chunk.close()
