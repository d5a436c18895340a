"""A chunk request's TTFT by phase, the chunk engine alone on chunk_serve_vllm.py's trace (bf16, the same
warm-up; an idle second before each request, as the benchmark's settle), scratch script of
2026-11-28, run from the repository root. Printed that day (seconds; fwd_delta: the engine's
forward time during the request), a few of the 24:
60: ttft 0.843 wall 0.858 queue 0.026 sched 0.022 kv_copy 0.063 computed 1669 hits 1 guard 0 fwd_delta 0.811
62: ttft 0.986 wall 1.009 queue 0.025 sched 0.019 kv_copy 0.000 computed 2196 hits 0 guard 0 fwd_delta 0.954
75: ttft 0.783 wall 0.798 queue 0.028 sched 0.022 kv_copy 0.000 computed 1779 hits 0 guard 0 fwd_delta 0.748
76: ttft 0.783 wall 0.800 queue 0.030 sched 0.241 kv_copy 0.100 computed 450 hits 4 guard 118 fwd_delta 0.529
79: ttft 0.798 wall 0.818 queue 0.031 sched 0.129 kv_copy 0.163 computed 422 hits 4 guard 33 fwd_delta 0.657
83: ttft 0.898 wall 0.913 queue 0.042 sched 0.030 kv_copy 0.176 computed 1254 hits 8 guard 0 fwd_delta 0.851
(requests 76 and 79: the guard's second pass is inside sched, as the notes of the section before say.)
"""
import sys, time, types
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from chunk_eval import trace
from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.model.loader import load_model
from ragcache_backend.model.sampling import SamplingParams
torch.set_num_threads(2)
MiB = 1 << 20
args = types.SimpleNamespace(k_min=5, k_max=8, mmlu=200, zipf=1.0, question_first=True, library=True, seed=0, warmup=60, requests=24)
_s, _w, items = trace(args)
loaded = load_model(None, dtype="bfloat16")
cfg = EngineConfig(reuse="auto", chunk_alpha=1.0, dtype="bfloat16", threads=2, device_budget_bytes=2048 * MiB,
                   host_budget_bytes=4096 * MiB, max_batch_size=16, max_batch_tokens=32768)
eng = RAGCacheEngine(cfg, loaded=loaded)
rule = cfg.recompute_rule(); one = SamplingParams(max_tokens=1)
segs = [eng.segments_for(q, docs, one, question_first=True)[0] for q, _src, docs in items]
for ss in segs[:60]:
    eng.submit_segments(ss, one, recompute=rule).result()
print("warm-up done", flush=True)
for i in range(60, 84):
    time.sleep(1.0)
    st0 = eng.stats.forward_s
    t = time.perf_counter()
    h = eng.submit_segments(segs[i], one, recompute=rule)
    res = h.result()
    wall = time.perf_counter() - t
    m = h.metrics
    print(f"{i}: ttft {res.ttft_s:.3f} wall {wall:.3f} queue {m.queue_s:.3f} sched {m.sched_s:.3f} kv_copy {m.kv_copy_s:.3f} "
          f"computed {res.computed_tokens} hits {res.chunk_hits} guard {res.guard_tokens} fwd_delta {eng.stats.forward_s - st0:.3f}", flush=True)
eng.close()
