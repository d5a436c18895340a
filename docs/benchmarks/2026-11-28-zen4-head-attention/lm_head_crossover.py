import time, torch, statistics
from ragcache_backend.model.kernels.linear import pack_linear
from ragcache_backend.model.kernels import native
torch.set_num_threads(2)
for dt in (torch.bfloat16, torch.float32):
    w = torch.randn(49152, 576).to(dt); lin = pack_linear(w, None, per_step=False)
    xs = {m: torch.randn(m, 576).to(dt) for m in range(1, 9)}
    res = {}
    for rep in range(9):
        for m in range(1, 9):
            xe = xs[m].expand(2, -1).contiguous() if m == 1 and dt == torch.bfloat16 else xs[m]
            for name, f in (("onednn", lambda: lin.gemm(xe)), ("rows", lambda: native.linear_rows(xs[m], w))):
                t = time.perf_counter(); f(); f(); res.setdefault((name, m), []).append((time.perf_counter() - t) / 2)
    print(dt, " ".join(f"M{m}: {1e3*statistics.median(res[('rows', m)]):.2f}/{1e3*statistics.median(res[('onednn', m)]):.2f}={statistics.median(res[('rows', m)])/statistics.median(res[('onednn', m)]):.2f}" for m in range(1, 9)))
