"""Decode steps (1,024 tokens of context, 16 steps) with the LM head on our AMX GEMM against the few-row
kernel it replaced, the two alternating in one process (scratch script of 2026-11-28; run from the
repository root):

    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx-decode/ab_lm_head.py
"""
import random
import statistics
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from forward_vs_vllm import Ours, MODEL_DIR, MiB
from ragcache_backend import RAGCacheEngine, EngineConfig
eng = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype="bfloat16", threads=2, device_budget_bytes=1024*MiB, host_budget_bytes=0))
o = Ours(eng); rng = random.Random(0)
head = eng.runner.layers.lm_head
packed = head.amx
assert packed is not None
for b in (1, 4, 8, 16):
    res = {"amx": [], "rows": []}
    for r in range(7):
        prompts = [[rng.randrange(100, 40000) for _ in range(1024)] for _ in range(b)]
        for k in (("amx", "rows") if r % 2 else ("rows", "amx")):
            head.amx = packed if k == "amx" else None
            t = o.decode({"prompts": prompts, "steps": 16})
            if r: res[k].append(t)
    head.amx = packed
    print(f"b{b}: amx head {1e3*statistics.median(res['amx']):.2f} ms, few-row kernel head {1e3*statistics.median(res['rows']):.2f} ms, ratio {statistics.median(res['amx'])/statistics.median(res['rows']):.3f}", flush=True)
