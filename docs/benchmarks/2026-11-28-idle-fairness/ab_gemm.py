"""The four layer GEMMs of SmolLM2-135M over 30 layers' distinct random weights (1,000 or 2,000 rows),
the package's kernels against another csrc/ folder, alternating per round (scratch script of
2026-11-28; run from the repository root):

    git archive f8ac905 ragcache_backend/model/kernels/csrc | tar -x -C /tmp/old
    .venv/bin/python docs/benchmarks/2026-11-28-idle-fairness/ab_gemm.py /tmp/old/ragcache_backend/model/kernels/csrc 1000

Printed that day (new: work items column-major, cd478a7; old: row-major, f8ac905; ms over 30 layers):
1000 rows  new [25.5, 16.0, 81.6, 36.9] sum 159.9   old [27.2, 16.4, 87.1, 37.6] sum 168.3
2000 rows  new [38.6, 22.3, 136.3, 56.8] sum 254.0  old [44.8, 27.4, 146.0, 63.0] sum 281.2
1000 rows  new [22.1, 13.5, 74.7, 31.1] sum 141.4   old [24.4, 15.2, 82.5, 32.9] sum 155.0
"""
import time, torch, sys, statistics
from pathlib import Path
sys.path.insert(0, ".")
from ragcache_backend.model.kernels import amx_gemm, library
torch.set_num_threads(2)
old_lib = library.build_library(Path(sys.argv[1]))
M = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
xs = {K: torch.randn(M, K).bfloat16() for K in (576, 1536)}
layers = [[amx_gemm.amx_pack(torch.randn(N, K).bfloat16() * 0.05) for (K, N) in shapes] for _ in range(30)]
flush = torch.empty(64 << 20, dtype=torch.uint8)
def one():
    tt = [0.0] * 4
    for L in layers:
        for j, (K, N) in enumerate(shapes):
            t = time.perf_counter()
            (amx_gemm.amx_linear_silu if j == 2 else amx_gemm.amx_linear)(xs[K], L[j])
            tt[j] += time.perf_counter() - t
    return tt
res = {"new": [], "old": []}
for r in range(9):
    for k in (["new", "old"] if r % 2 else ["old", "new"]):
        flush.fill_(r)
        if k == "old":
            with library.using_library(old_lib): tt = one()
        else: tt = one()
        if r: res[k].append(tt)
for k in res:
    med = [statistics.median(t[j] for t in res[k]) * 1e3 for j in range(4)]
    print(k, "qkv/o/gate_up+silu/down ms over 30 layers:", [round(x, 1) for x in med], "sum", round(sum(med), 1))
