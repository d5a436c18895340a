import torch, time
from ragcache_backend.model.kernels.linear import pack_linear
torch.manual_seed(0)
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
for name, (n, k) in shapes.items():
    w = (torch.randn(n, k) * 0.05).bfloat16()
    lin = pack_linear(w)
    x = torch.randn(2048, k).bfloat16()
    ref = torch.cat([lin.gemm(x[i:i+128]) for i in range(0, 2048, 128)])
    res = {}
    for m in (33, 64, 96, 100, 127, 129, 160, 192, 256, 384, 512, 1000, 1024, 2048):
        outs = torch.cat([lin.gemm(x[i:i+m].contiguous()) for i in range(0, 2048, m)])
        res[m] = (outs != ref).any(dim=1).float().mean().item()
    # shifted: row positions within the tile moved
    sh = torch.cat([lin.gemm(x[i:i+128]) for i in range(37, 2048-128, 128)])
    print(name, {m: round(v, 3) for m, v in res.items()}, "shift128:", (sh != ref[37:37+sh.shape[0]]).any(dim=1).float().mean().item())
