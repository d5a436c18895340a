"""SmolLM2-135M's four layer GEMMs (bf16, random weights of its shapes) over 1,000 prompt rows on an AMX
CPU, x30 layers, medians of 9 (scratch script of 2026-11-28; run from the repository root):

    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx/tile_cost.py

* ``Linear now``: the public call as a prompt step makes it (128-row calls, only the last one padded);
* ``pad all of x``: as before 57d7dc7, all of x copied to pad it, then the 128-row calls joined;
* ``calls of M rows``: ``Linear.gemm`` over M-row slices, nothing joined (M = 1,000: one call), the
  GEMM time alone at each call size (rows differ by M above 384 here: see probe_m.py).
"""
import time

import torch

from ragcache_backend.model.kernels.linear import ROW_TILE, StepRowClasses, pack_linear, step_rows

torch.manual_seed(0)
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = 1000


def median_ms(f, n=9):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def now(lin, x):
    with step_rows(StepRowClasses.of([x.shape[0]], [False])):
        return lin(x)


def pad_all(lin, x):
    rows = x.shape[0]
    xp = torch.cat((x, x.new_zeros(-rows % ROW_TILE, x.shape[1]))).contiguous()
    return torch.cat([lin.gemm(xp[i : i + ROW_TILE]) for i in range(0, xp.shape[0], ROW_TILE)])[:rows]


lins = {k: pack_linear((torch.randn(n, kk) * 0.05).bfloat16()) for k, (n, kk) in shapes.items()}
xs = {k: torch.randn(ROWS, kk).bfloat16() for k, (n, kk) in shapes.items()}
tot: dict[str, float] = {}
for k in shapes:
    lin, x = lins[k], xs[k]
    assert torch.equal(now(lin, x), pad_all(lin, x))
    variants = {"Linear now": lambda: now(lin, x), "pad all of x": lambda: pad_all(lin, x)}
    for m in (128, 256, 384, 512, ROWS):
        variants[f"calls of {m} rows"] = lambda m=m: [lin.gemm(x[i : i + m]) for i in range(0, ROWS, m)]
    for name, f in variants.items():
        tot[name] = tot.get(name, 0.0) + median_ms(f)
print({k: f"{30 * v:.0f} ms / 30 layers" for k, v in tot.items()})
