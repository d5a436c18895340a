"""Probe (2026-11-29, issue 23): why the few-row linear at one row reads SmolLM2's 120 layer weights
(425 MB, fp32) slower than ``torch.sum`` reads one buffer of the same size. Not a benchmark of the
package: ``probe.c`` holds variants of ``kernels_f32.c``'s one-row tile (``linear_tile``'s seq path,
copied), all called over the same 30 x 4 random weights in one parallel region, interleaved for
24 rounds (first dropped), median (min) ms and GB/s printed.

    .venv/bin/python docs/benchmarks/2026-11-29-zen3-fp32/linear_segments/probe.py
"""
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3] / "benchmarks"))
from forward_vs_vllm import machine, memory_bandwidth  # noqa: E402

torch.set_num_threads(2)
so = Path(tempfile.mkdtemp()) / "probe.so"
subprocess.run(["cc", "-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu11", "-o", str(so), str(HERE / "probe.c")], check=True)
lib = ctypes.CDLL(str(so))
lib.sum_flat.restype = ctypes.c_float
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
g = torch.Generator().manual_seed(0)
Ws = [torch.randn(n, k, generator=g) for _ in range(30) for n, k in SHAPES]
flat = torch.randn(sum(w.numel() for w in Ws), generator=g)
xs = {k: torch.randn(k, generator=g) for k in (576, 1536)}
ys = [torch.empty(w.shape[0]) for w in Ws]
n = len(Ws)
P, I = ctypes.c_void_p * n, ctypes.c_int64 * n
aW, aN, aK = P(*[w.data_ptr() for w in Ws]), I(*[w.shape[0] for w in Ws]), I(*[w.shape[1] for w in Ws])
aX, aY = P(*[xs[w.shape[1]].data_ptr() for w in Ws]), P(*[y.data_ptr() for y in ys])
nbytes = sum(w.numel() * 4 for w in Ws)


def share(N, t, T):
    tiles = (N + 3) // 4
    q, r = divmod(tiles, T)
    s = t * q + min(t, r)
    return s * 4, min((s + q + (1 if t < r else 0)) * 4, N)


pieces, bufs = [None] * (2 * n), []  # each thread's rows of every weight, one after another in its own buffer
for t in range(2):
    buf = torch.empty(sum((share(w.shape[0], t, 2)[1] - share(w.shape[0], t, 2)[0]) * w.shape[1] for w in Ws) + 64)
    bufs.append(buf)
    off = 0
    for i, w in enumerate(Ws):
        a, b = share(w.shape[0], t, 2)
        m = (b - a) * w.shape[1]
        buf[off:off + m] = w[a:b].reshape(-1)
        pieces[i * 2 + t] = buf.data_ptr() + 4 * off
        off += m
aP = (ctypes.c_void_p * (2 * n))(*pieces)
c = ctypes.c_int64
V = {
    "as kernels_f32.c (one row)": lambda: lib.run_all(c(n), aW, aN, aK, aX, aY, 0, 2, 0),
    "torch.sum, one 425 MB buffer": lambda: flat.sum(),
    "C sum, one 425 MB buffer": lambda: lib.sum_flat(ctypes.c_void_p(flat.data_ptr()), c(flat.numel()), 2),
    "C sum, per weight (same split)": lambda: lib.run_all(c(n), aW, aN, aK, aX, aY, 1, 2, 0),
    "two accumulators per row": lambda: lib.run_v(c(n), aW, aN, aK, aX, aY, 6, 2),
    "prefetch 8 KiB ahead": lambda: lib.run_v(c(n), aW, aN, aK, aX, aY, 9, 2),
    "touch next weight's 64 KiB": lambda: lib.run_ahead(c(n), aW, aN, aK, aX, aY, 2, c(16384), 1),
    "per-thread contiguous weights": lambda: lib.run_pieces(c(n), aP, aN, aK, aX, aY, 2),
    "steal chunks of 8 tiles": lambda: lib.run_steal(c(n), aW, aN, aK, aX, aY, 2, c(8)),
    "steal chunks of 16 tiles": lambda: lib.run_steal(c(n), aW, aN, aK, aX, aY, 2, c(16)),
}
T, bws = {k: [] for k in V}, []
for rnd in range(24):
    bws.append(memory_bandwidth(2, repeats=1)["best_gb_s"])
    for k in (list(V) if rnd % 2 else list(V)[::-1]):
        t0 = time.perf_counter()
        V[k]()
        if rnd:
            T[k].append(time.perf_counter() - t0)
m = machine()
print(f"{m['cpu']} ({m['isa']}), 2 threads, {m['date']}; torch.sum over 1 GiB: median {statistics.median(bws[1:]):.1f} GB/s; "
      f"{nbytes / 1e6:.0f} MB of weights")
base = statistics.median(T["as kernels_f32.c (one row)"])
for k, v in T.items():
    med = statistics.median(v)
    print(f"{k:32s} {1e3 * med:6.1f} ms ({1e3 * min(v):5.1f})  {nbytes / med / 1e9:5.1f} GB/s  {med / base:5.2f}x")
