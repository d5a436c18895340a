"""Probe (2026-11-29): SmolLM2-135M's four layer GEMMs (QKV, O, gate/up, down; fp32, 2 threads) over
M prompt rows: oneDNN with the weight packed once (the engine's prompt path: ``pack_linear``, then
``Linear.gemm``) against ``F.linear`` (MKL), alternating, 7 rounds after one warm-up; median ms and
GFLOPS.

    .venv/bin/python docs/benchmarks/2026-11-29-zen3-fp32/decode_breakdown/gemm_probe.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

from ragcache_backend.model.kernels.linear import pack_linear

torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
for M in (512, 2048):
    Ws = [torch.randn(n, k, generator=g) * k ** -0.5 for n, k in SHAPES]
    packed = [pack_linear(w) for w in Ws]
    assert all(p.packed is not None for p in packed), "oneDNN weight packing unavailable in this torch"
    X = {k: torch.randn(M, k, generator=g) for k in (576, 1536)}
    T = {"oneDNN, packed weight": [], "F.linear (MKL)": []}
    for r in range(8):
        for name in (T if r % 2 else list(T)[::-1]):
            t = time.perf_counter()
            for w, p in zip(Ws, packed):
                x = X[w.shape[1]]
                p.gemm(x) if name.startswith("oneDNN") else F.linear(x, w)
            if r:
                T[name].append(time.perf_counter() - t)
    flops = sum(2 * M * n * k for n, k in SHAPES)
    print(f"M = {M}: " + "; ".join(f"{k} {1e3 * statistics.median(v):.1f} ms ({flops / statistics.median(v) / 1e9:.0f} GFLOPS)"
                                   for k, v in T.items()))
