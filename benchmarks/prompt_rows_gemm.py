"""Where a float32 prompt chunk's layer GEMMs should leave the few-row kernel for oneDNN: the native
few-row kernel (``native.linear_rows``, one call per weight) against oneDNN's prepacked GEMM
(``Linear.gemm``, the path prompt rows beyond the bound take), interleaved in one process, at row
counts around the bound (a cache hit's question over cached documents is 10-100 new rows).

    .venv/bin/python benchmarks/prompt_rows_gemm.py [--rows 16,24,32,48,64,96,128] [--repeats 7] [--json OUT]

The default model's four layer GEMMs (SmolLM2-135M: QKV ``[960, 576]`` with its bias, O ``[576, 576]``,
gate/up ``[3072, 576]``, down ``[576, 1536]``) for each of its 30 layers, every layer its own random
weights (425 MB in all, and oneDNN's packed copy as much again), so that weights come from memory as
in a real forward pass. Each round runs both paths over all 120 GEMMs, in alternating order; medians
(min) of the rounds, GFLOPS, and the time ratio native / oneDNN (< 1: the few-row kernel is faster).
Also checks that a row's bits from the few-row kernel do not depend on the call's row count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from forward_vs_vllm import machine  # noqa: E402
from linear_rows import LAYERS, SHAPES, layer_weights  # noqa: E402

from ragcache_backend.model.kernels import native  # noqa: E402
from ragcache_backend.model.kernels.linear import pack_linear  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,24,32,48,64,96,128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    layers = [(w, b, pack_linear(w, b)) for w, b in layer_weights(g)]
    if not all(lin.packed is not None for _, _, lin in layers) or not native.linear_rows_available(layers[0][0]):
        raise SystemExit("needs oneDNN packing and the float32 native kernels on this CPU")
    xs = {k: torch.randn(max(rows), k, generator=g) for k in {k for _, k, _ in SHAPES}}
    flops_row = sum(2 * n * k for n, k, _ in SHAPES) * LAYERS
    same = all(torch.equal(native.linear_rows(xs[576][:m], layers[0][0], layers[0][1])[: min(rows)],
                           native.linear_rows(xs[576][: min(rows)], layers[0][0], layers[0][1])) for m in rows)

    def one(path: str, m: int) -> float:
        t = time.perf_counter()
        for w, b, lin in layers:
            x = xs[w.shape[1]][:m]
            if path == "native":
                native.linear_rows(x, w, b)
            else:
                lin.gemm(x)
        return time.perf_counter() - t

    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
              "command": " ".join(sys.argv), "threads": args.threads, "same_bits_any_rows": same, "rows": []}
    print(f"{report['date']}  {report['machine']['cpu']} ({report['machine']['isa']}), {args.threads} threads; "
          f"row bits independent of the call's rows: {same}")
    print(f"{'rows':>5} {'native ms':>14} {'oneDNN ms':>14} {'native GFLOPS':>14} {'oneDNN GFLOPS':>14} {'native/oneDNN':>14}")
    for m in rows:
        one("native", m), one("onednn", m)  # warm-up
        times = {"native": [], "onednn": []}
        for r in range(args.repeats):
            for path in ("native", "onednn") if r % 2 == 0 else ("onednn", "native"):
                times[path].append(one(path, m))
        med = {p: statistics.median(v) for p, v in times.items()}
        row = {"rows": m, **{f"{p}_ms": med[p] * 1e3 for p in med}, **{f"{p}_min_ms": min(v) * 1e3 for p, v in times.items()},
               **{f"{p}_gflops": flops_row * m / med[p] / 1e9 for p in med}, "ratio": med["native"] / med["onednn"]}
        report["rows"].append(row)
        print(f"{m:5d} {row['native_ms']:8.1f} ({row['native_min_ms']:.1f}) {row['onednn_ms']:7.1f} ({row['onednn_min_ms']:.1f}) "
              f"{row['native_gflops']:14.1f} {row['onednn_gflops']:14.1f} {row['ratio']:14.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
