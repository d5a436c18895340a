import torch, time
from ragcache_backend.model.kernels.linear import pack_linear
torch.manual_seed(0)
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
def t(f, n=9):
    ts=[]
    for _ in range(n):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    return sorted(ts)[n//2]*1e3
lins = {k: pack_linear((torch.randn(n, kk) * 0.05).bfloat16()) for k, (n, kk) in shapes.items()}
xs = {k: torch.randn(1000, kk).bfloat16() for k, (n, kk) in shapes.items()}
xp = {k: torch.cat((x, x.new_zeros(24, x.shape[1]))) for k, x in xs.items()}
tot = {"tiled": 0, "calls only": 0, "384 calls": 0, "one call": 0}
for k in shapes:
    l = lins[k]
    tot["tiled"] += t(lambda: l._tiled(xs[k]))
    tot["calls only"] += t(lambda: [l.gemm(xp[k][i:i+128]) for i in range(0, 1024, 128)])
    tot["384 calls"] += t(lambda: [l.gemm(xs[k][i:i+384]) for i in range(0, 1000, 384)])
    tot["one call"] += t(lambda: l.gemm(xs[k]))
print({k: f"{v*30:.0f} ms/30 layers" for k, v in tot.items()})
def tiled2(l, x):
    rows = x.shape[0]; T = 128
    full = rows - rows % T
    outs = [l.gemm(x[i:i+T]) for i in range(0, full, T)]
    if full < rows:
        last = torch.cat((x[full:], x.new_zeros(T - (rows - full), x.shape[1])))
        outs.append(l.gemm(last)[: rows - full])
    return outs[0] if len(outs) == 1 else torch.cat(outs)
tot = {"tiled": 0, "tiled2": 0}
for k in shapes:
    l = lins[k]
    assert torch.equal(tiled2(l, xs[k]), l._tiled(xs[k]))
    tot["tiled"] += t(lambda: l._tiled(xs[k]))
    tot["tiled2"] += t(lambda: tiled2(l, xs[k]))
print({k: f"{v*30:.0f} ms/30 layers" for k, v in tot.items()})
