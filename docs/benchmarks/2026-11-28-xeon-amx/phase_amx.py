"""Where a cold 1,000-token bf16 forward pass goes, prompt attention on AMX tiles against AVX512-BF16,
alternating in one process (scratch script of 2026-11-28; run from the repository root):

    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx/phase_amx.py

Times the native calls and the layer GEMMs by wrapping them (the rest is Python and small torch ops).
"""
import collections
import os
import random
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, "benchmarks")

from ragcache_backend import EngineConfig, RAGCacheEngine  # noqa: E402
from ragcache_backend.model.kernels import linear as L  # noqa: E402
from ragcache_backend.model.kernels import native  # noqa: E402

import forward_vs_vllm as F  # noqa: E402

acc: collections.Counter = collections.Counter()


def timed(mod, name):
    f = getattr(mod, name)

    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        acc[name] += time.perf_counter() - t
        return r
    setattr(mod, name, g)


for n in ("paged_attention", "rope_write", "add_rms_norm", "silu_mul"):
    timed(native, n)
call = L.Linear.__call__


def linear_call(self, x):
    t = time.perf_counter()
    r = call(self, x)
    acc["layer GEMMs" if self.per_step else "LM head"] += time.perf_counter() - t
    return r


L.Linear.__call__ = linear_call
engine = RAGCacheEngine(EngineConfig(model=str(F.MODEL_DIR), dtype="bfloat16", threads=2,
                                     device_budget_bytes=1024 * F.MiB, host_budget_bytes=0))
ours, rng = F.Ours(engine), random.Random(0)
ours.cold({"ids": [rng.randrange(100, 40000) for _ in range(1000)]})  # warm-up
for amx in (True, False) * 4:
    native.bf16_amx(amx)
    acc.clear()
    dt = ours.cold({"ids": [rng.randrange(100, 40000) for _ in range(1000)]})
    parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in acc.items())
    print(f"{'AMX    ' if amx else 'AVX-512'} cold 1,000 tokens {1e3 * dt:.0f} ms: {parts}, rest {1e3 * (dt - sum(acc.values())):.1f} ms")
native.bf16_amx(True)
