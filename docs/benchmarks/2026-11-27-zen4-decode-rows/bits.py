import torch, sys
from pathlib import Path
torch.set_num_threads(2)
from ragcache_backend.model.kernels import native
A = native._library()
names = ("paged_attention_bf16.c", "fused_bf16.c", "decode_bf16.c", "kernels_f32.c")
v = sys.argv[1]
native.SOURCES = tuple(Path(f"/tmp/kvar/{v}") / n for n in names)
native.HEADERS = tuple(Path(f"/tmp/kvar/{v}") / n for n in ("simd_exp.h", "bf16_common.h"))
B = native._build()
g = torch.Generator().manual_seed(0)
ok = True
for n, k in ((1536, 576), (576, 1536), (4 * 37, 96)):
    w = torch.randn(n, k, generator=g).to(torch.bfloat16); b = torch.randn(n, generator=g).to(torch.bfloat16)
    for m in range(1, 17):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        native._lib = A; ya = native.linear_rows(x, w, b)
        native._lib = B; yb = native.linear_rows(x, w, b)
        ok &= torch.equal(ya.view(torch.int16), yb.view(torch.int16))
print("same bits:", ok)
