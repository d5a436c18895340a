import torch, time, sys
from pathlib import Path
torch.set_num_threads(2)
from ragcache_backend.model.kernels import native
libs = {"A": native._library()}
names = ("paged_attention_bf16.c", "fused_bf16.c", "decode_bf16.c", "kernels_f32.c")
for v in sys.argv[1:]:
    native.SOURCES = tuple(Path(f"/tmp/kvar/{v}") / n for n in names)
    native.HEADERS = tuple(Path(f"/tmp/kvar/{v}") / n for n in ("simd_exp.h", "bf16_common.h"))
    libs[v] = native._build()
shapes = ((49152, 576), (1536, 576), (576, 576), (576, 1536))
res = {}
for rnd in range(4):
    for v, lib in libs.items():
        native._lib = lib
        for n, k in shapes:
            ws = [torch.randn(n, k).to(torch.bfloat16) for _ in range(max(1, int(200e6 // (n*k*2))))] if rnd == 0 and v == "A" else W[(n, k)]
            if rnd == 0 and v == "A": W = globals().setdefault("W", {}); W[(n, k)] = ws
            for m in (1, 4):
                x = torch.randn(m, k).to(torch.bfloat16)
                native.linear_rows(x, ws[0])
                t = time.perf_counter(); cnt = 0
                for r in range(2):
                    for w in ws: native.linear_rows(x, w); cnt += 1
                d = (time.perf_counter() - t) / cnt
                res.setdefault((v, n, k, m), []).append(n * k * 2 / d / 1e9)
import statistics
for n, k in shapes:
    for m in (1, 4):
        print(f"N={n} K={k} M={m}: " + ", ".join(f"{v} {statistics.median(res[(v,n,k,m)]):.1f} GB/s" for v in libs))
# same bits check for M=4 between A and C
