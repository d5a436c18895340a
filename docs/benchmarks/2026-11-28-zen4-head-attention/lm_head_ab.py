import sys, time, random, statistics
sys.path.insert(0, "benchmarks")
import torch
from forward_vs_vllm import Ours, MODEL_DIR
from ragcache_backend import RAGCacheEngine, EngineConfig
from ragcache_backend.model.kernels import native
MiB = 1 << 20
dt = sys.argv[1]
eng = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype=dt, threads=2, device_budget_bytes=2048 * MiB, host_budget_bytes=0))
head = eng.runner.layers.lm_head
new = (head.rows_kernel, head.rows_max)
old = (dt == "float32", native.LINEAR_ROWS_MAX)  # before 8984152: bf16 oneDNN only
print("new", new, "old", old)
o = Ours(eng); rng = random.Random(0)
res = {}
for rnd in range(5):
    for b in (1, 2, 4, 8, 16):
        prompts = [[rng.randrange(100, 40000) for _ in range(1024)] for _ in range(b)]
        for name, (rk, rm) in ((("old", old), ("new", new)) if rnd % 2 else (("new", new), ("old", old))):
            head.rows_kernel, head.rows_max = rk, rm
            t = o.decode({"prompts": prompts, "steps": 16})
            if rnd: res.setdefault((name, b), []).append(t)
for b in (1, 2, 4, 8, 16):
    a, n = statistics.median(res[("old", b)]), statistics.median(res[("new", b)])
    print(f"{dt} decode b{b}: old {1e3*a:.1f} ms new {1e3*n:.1f} ms ({n/a:.2f}x)", flush=True)
eng.close()
