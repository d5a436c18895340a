"""The float32 prompt-rows bound at 16 vs 64: a pass of 30 / 60 new tokens over 1,024 cached, two engines
in one process, alternating (2026-11-29 19:51 UTC; run from the repository root)."""
import sys, time, statistics, torch
sys.path.insert(0, "benchmarks")
import forward_vs_vllm as f
from ragcache_backend import EngineConfig, RAGCacheEngine
from ragcache_backend.model.kernels import native
engines = {}
for bound in (16, 64):
    native.LINEAR_PROMPT_ROWS_F32 = bound
    engines[bound] = f.Ours(RAGCacheEngine(EngineConfig(model=str(f.MODEL_DIR), dtype="float32", threads=2)))
native.LINEAR_PROMPT_ROWS_F32 = 64
g = torch.Generator().manual_seed(0)
prefix = torch.randint(100, 40000, (1024,), generator=g).tolist()
for new_n in (30, 60):
    new = torch.randint(100, 40000, (new_n,), generator=g).tolist()
    cmd = {"prefix": prefix, "new": new}
    for e in engines.values(): e.extend(cmd)
    t = {16: [], 64: []}
    for r in range(9):
        for b in ((16, 64) if r % 2 == 0 else (64, 16)):
            t[b].append(engines[b].extend(cmd))
    m = {b: statistics.median(v) * 1000 for b, v in t.items()}
    print(f"{new_n} over 1024 cached: bound 16 {m[16]:.1f} ms, bound 64 {m[64]:.1f} ms, ratio {m[64]/m[16]:.2f}", flush=True)
