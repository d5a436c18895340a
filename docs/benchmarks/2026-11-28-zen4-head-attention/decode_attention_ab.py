import time, torch, statistics, sys
from pathlib import Path
from ragcache_backend.model.kernels import native
import contextlib
torch.set_num_threads(2)
libs = {"main": None, **{Path(f).name: native.build_library(Path(f)) for f in sys.argv[1:]}}
Hq, Hkv, D = 9, 3, 64
S, layers = int(__import__("os").environ.get("S", 1024)), 30
for B in tuple(int(x) for x in __import__("os").environ.get("BS", "1,4,16").split(",")):
    slots_total = S * B + 16
    kcs = [torch.randn(slots_total, Hkv, D).bfloat16() for _ in range(layers)]
    vcs = [torch.randn(slots_total, Hkv, D).bfloat16() for _ in range(layers)]
    batch = native.attention_batch([torch.arange(b * S, (b + 1) * S) for b in range(B)], [1] * B, [True] * B)
    q = torch.randn(B, Hq, D).bfloat16()
    res = {}
    for rep in range(8):
        for name, lib in (libs.items() if rep % 2 else list(libs.items())[::-1]):
            with (native.using_library(lib) if lib else contextlib.nullcontext()):
                t = time.perf_counter()
                for l in range(layers): native.paged_attention(q, kcs[l], vcs[l], batch, 0.125)
                res.setdefault(name, []).append((time.perf_counter() - t) / layers)
    mb = B * S * Hkv * D * 2 * 2 / 1e6
    print(f"B={B}: " + "  ".join(f"{n} {1e6*statistics.median(v):.1f} us/layer ({mb/1e3/statistics.median(v):.1f} GB/s)" for n, v in res.items()))
