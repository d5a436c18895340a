"""The gate/up GEMM split into 2 or 4 GEMMs by output columns (each in 128-row tiles, joined by column)
against one, in cold 1,000-token passes, alternating (scratch script of 2026-11-28; from the repository root:
``.venv/bin/python docs/benchmarks/2026-11-28-xeon-amx/split.py``). Times every layer GEMM by shape."""
import os, time, sys, collections
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from ragcache_backend.model.kernels import native, linear as L
acc = collections.Counter()
orig_call = L.Linear.__call__
def lc(self, x):
    t = time.perf_counter(); r = orig_call(self, x); acc[tuple(self.weight.shape)] += time.perf_counter() - t; return r
L.Linear.__call__ = lc
sys.path.insert(0, "benchmarks")
import forward_vs_vllm as F
from ragcache_backend import EngineConfig, RAGCacheEngine
engine = RAGCacheEngine(EngineConfig(model=str(F.MODEL_DIR), dtype="bfloat16", threads=2, device_budget_bytes=1024*F.MiB, host_budget_bytes=0))
ours = F.Ours(engine)
import gc
gus = [o for o in gc.get_objects() if isinstance(o, L.Linear) and tuple(o.weight.shape) == (3072, 576)]
print(len(gus))
class Split:
    def __init__(self, lin, parts):
        n = lin.weight.shape[0] // parts
        self.parts = [L.pack_linear(lin.weight[i*n:(i+1)*n].contiguous()) for i in range(parts)]
    def run(self, x):
        return torch.cat([orig_call(p, x) for p in self.parts], dim=1)  # inside the step's step_rows: 128-row tiles
splits = {id(g): (Split(g, 2), Split(g, 4)) for g in gus}
mode = 0
def lc2(self, x):
    if mode and id(self) in splits and x.shape[0] > 64:
        t = time.perf_counter(); r = splits[id(self)][mode - 1].run(x); acc[tuple(self.weight.shape)] += time.perf_counter() - t; return r
    return lc(self, x)
L.Linear.__call__ = lc2
import random
rng = random.Random(0)
for m in (0, 1, 2, 0, 1, 2, 0, 1, 2):
    mode = m
    ids = [rng.randrange(100, 40000) for _ in range(1000)]
    acc.clear()
    dt = ours.cold({"ids": ids})
    print(m, f"cold {dt*1e3:.0f} ms", {k: round(v*1e3, 1) for k, v in acc.items()})
