"""Our AMX GEMM's outputs (amx_linear, amx_linear_silu), the package's kernels against another csrc/
folder, over 6 weight shapes x 11 row counts, with and without a bias: identical bits? (scratch
script of 2026-11-28, run from the repository root; printed "bad 0" for the pipelined epilogue,
d13d5e9, against d13d5e9~1)."""
import sys, torch
sys.path.insert(0, ".")
from pathlib import Path
from ragcache_backend.model.kernels import amx_gemm, library
torch.set_num_threads(2)
lib = library.build_library(Path(sys.argv[1]))
g = torch.Generator().manual_seed(0)
bad = 0
for (N, K) in [(960, 576), (576, 576), (3072, 576), (576, 1536), (64, 64), (96, 128)]:
    for bias in (False, True):
        w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
        b = torch.randn(N, generator=g).bfloat16() if bias else None
        pw = amx_gemm.amx_pack(w, b)
        for M in (1, 3, 17, 31, 32, 33, 100, 128, 129, 257, 1000):
            x = torch.randn(M, K, generator=g).bfloat16()
            for fn in (amx_gemm.amx_linear, amx_gemm.amx_linear_silu):
                if fn is amx_gemm.amx_linear_silu and N % 32: continue
                a = fn(x, pw)
                with library.using_library(lib):
                    c = fn(x, pw)
                if not torch.equal(a.view(torch.int16), c.view(torch.int16)):
                    bad += 1; print("DIFF", N, K, bias, M, fn.__name__)
print("bad", bad)
