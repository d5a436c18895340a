import torch, time
from ragcache_backend.model.kernels.linear import pack_linear
torch.manual_seed(0)
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
def t(f, n=7):
    ts=[]
    for _ in range(n):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    return sorted(ts)[n//2]*1e3
tot = {}
for name, (n, k) in shapes.items():
    w = (torch.randn(n, k) * 0.05).bfloat16()
    lin = pack_linear(w)
    x = torch.randn(1024, k).bfloat16()
    for m in (128, 256, 384, 512, 1024):
        ms = t(lambda: [lin.gemm(x[i:i+m]) for i in range(0, 1024, m)])
        tot[m] = tot.get(m, 0) + ms
        print(name, m, f"{ms:.2f} ms  {2*1024*n*k/ms/1e6:.0f} GFLOP/s")
print({m: f"{v*30:.0f} ms for 30 layers" for m, v in tot.items()})
