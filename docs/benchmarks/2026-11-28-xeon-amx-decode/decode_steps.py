"""Our decode step alone at batch 1, 4, 8, 16 over 16 and 1,024 tokens of context (scratch script of
2026-11-28; run from the repository root; 16 steps a measurement, best and median of 3):

    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx-decode/decode_steps.py
"""
import random
import statistics
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from forward_vs_vllm import MODEL_DIR, MiB, Ours  # noqa: E402

from ragcache_backend import EngineConfig, RAGCacheEngine  # noqa: E402

engine = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype="bfloat16", threads=2, device_budget_bytes=1024 * MiB,
                                     host_budget_bytes=0))
print(engine.runner.kernel_tag)
ours, rng = Ours(engine), random.Random(0)
for ctx in (16, 1024):
    for b in (1, 4, 8, 16):
        ts = [ours.decode({"prompts": [[rng.randrange(100, 40000) for _ in range(ctx)] for _ in range(b)], "steps": 16})
              for _ in range(3)]
        print(f"ctx {ctx} b {b}: {1e3 * min(ts):.1f} ms (median {1e3 * statistics.median(ts):.1f})", flush=True)
engine.close()
