"""A chunk request's TTFT by phase (chunk_serve_vllm.py's trace, the chunk engine alone, bf16, an idle
second before each request), with the whole arena committed at construction (argument "1": the
shared pool's host part too) or the host part left to be committed as it fills (no argument).
Scratch script of 2026-11-28, run from the repository root, one run each, one after the other:
    commit: engine built in 9.7 s, mean TTFT 0.478 s over the 24 measured requests
    lazy:   engine built in 2.2 s, mean TTFT 0.557 s
(the 7.5 s: this VM's first touch of fresh guest memory, ~0.8 GB/s; first_touch.py). What ships is
neither: host_commit="background" commits the host part from a thread at nice 19 after start.
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
import ragcache_backend.engine.setup as _su
_orig = _su.ModelRunner
class _MR(_orig):
    def __init__(self, *a, **k):
        k["committed_blocks"] = None
        super().__init__(*a, **k)
if len(sys.argv) > 1: _su.ModelRunner = _MR
t0 = time.perf_counter()
eng = RAGCacheEngine(cfg, loaded=loaded)
print("engine built", time.perf_counter() - t0, flush=True)
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
