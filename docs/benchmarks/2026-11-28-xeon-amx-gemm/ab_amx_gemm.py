"""A cold bf16 forward pass with the layer GEMMs' prompt rows on our AMX GEMM against oneDNN in
128-row calls, alternating in one process (scratch script of 2026-11-28; run from the repository root):

    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx-gemm/ab_amx_gemm.py 1000   # or 2000

Two engines over the same weights: one packed while AMX runs (``native.bf16_amx()``: its layer GEMMs
take ``native.amx_linear``), one packed with it switched off (oneDNN's 128-row calls); AMX is then
switched back on, so both run the same AMX prompt attention (chosen per call). Public calls only.
"""
import os
import random
import statistics
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, "benchmarks")

from ragcache_backend import EngineConfig, RAGCacheEngine  # noqa: E402
from ragcache_backend.model.kernels import native  # noqa: E402

import forward_vs_vllm as F  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1000


def engine() -> RAGCacheEngine:
    return RAGCacheEngine(EngineConfig(model=str(F.MODEL_DIR), dtype="bfloat16", threads=2,
                                       device_budget_bytes=1024 * F.MiB, host_budget_bytes=0))


assert native.bf16_amx(), "needs a CPU with AMX"
ours = {"AMX GEMM": F.Ours(engine())}
native.bf16_amx(False)
ours["oneDNN 128-row calls"] = F.Ours(engine())
native.bf16_amx(True)
rng = random.Random(0)
times: dict[str, list[float]] = {k: [] for k in ours}
for o in ours.values():
    o.cold({"ids": [rng.randrange(100, 40000) for _ in range(N)]})  # warm-up
for rnd in range(6):
    for name in list(ours)[rnd % 2:] + list(ours)[: rnd % 2]:
        times[name].append(ours[name].cold({"ids": [rng.randrange(100, 40000) for _ in range(N)]}))
med = {k: statistics.median(v) for k, v in times.items()}
print(f"cold {N} tokens, medians (min) of 6, alternating: " + ", ".join(f"{k} {1e3 * med[k]:.0f} ms ({1e3 * min(times[k]):.0f})"
                                                                        for k in ours)
      + f"; ratio {med['AMX GEMM'] / med['oneDNN 128-row calls']:.2f}")
