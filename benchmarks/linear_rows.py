"""The float32 few-row linear kernel alone (``rc32_linear_rows``: a decode step's layer GEMMs), this
tree's against an earlier revision's, interleaved in one process: weight bytes read per second,
GFLOPS, and whether the outputs are the same bits.

    .venv/bin/python benchmarks/linear_rows.py --base 2a967aa [--repeats 7] [--json OUT]

Both versions' ``kernels_f32.c`` are compiled here with the flags the package builds them with (as
``prompt_attention.py`` does) and called through ctypes on the same inputs: the default model's
four layer GEMMs (SmolLM2-135M: QKV ``[960, 576]`` with its bias, O ``[576, 576]``, gate/up
``[3072, 576]``, down ``[576, 1536]``) for each of its 30 layers, every layer its own random
weights (425 MB in all), so that the weights come from memory as in a real decode step; ``M`` rows
of input per call (1, 2, 4, 8 and 16: batch sizes of a decode step). The memory read bandwidth
(``torch.sum`` over 1 GiB, the weights-read floor of ``forward_vs_vllm.py``) is measured in every
round beside them. Each round times both versions one after the other, in alternating order;
median (min) reported.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from forward_vs_vllm import machine, memory_bandwidth  # noqa: E402
from prompt_attention import build as build_attention  # noqa: E402

LAYERS = 30
SHAPES = ((960, 576, True), (576, 576, False), (3072, 576, False), (576, 1536, False))  # (N, K, bias) per layer
ROWS = (1, 2, 4, 8, 16)


def layer_weights(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight, bias or None)`` of every layer GEMM of SmolLM2-135M's shapes, each layer its own random
    float32 weights (425 MB in all), in the model's order."""
    return [(torch.randn(n, k, generator=gen) * k ** -0.5, torch.randn(n, generator=gen) if bias else None)
            for _ in range(LAYERS) for n, k, bias in SHAPES]


def build(rev: str | None, out: Path) -> ctypes.CDLL:
    """``kernels_f32.c`` of ``rev`` (None: the working tree) compiled into ``out``, ``rc32_linear_rows`` bound."""
    lib = build_attention(rev, out)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.rc32_linear_rows
    fn.restype = None
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    return lib


def run(lib: ctypes.CDLL, weights: list, x: dict, outs: list, m: int, threads: int) -> float:
    """Every layer's four GEMMs over ``m`` rows, in the model's order; seconds."""
    t = time.perf_counter()
    for (w, b), y in zip(weights, outs):
        n, k = w.shape
        lib.rc32_linear_rows(x[k][:m].data_ptr(), m, k, w.data_ptr(), 0 if b is None else b.data_ptr(), n,
                             y.data_ptr(), threads)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose kernels_f32.c is the baseline")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = layer_weights(gen)
    weight_bytes = sum(w.numel() * 4 for w, _ in weights)
    x = {k: torch.randn(max(ROWS), k, generator=gen) for k in {k for _, k, _ in SHAPES}}
    times = {m: {"base": [], "new": []} for m in ROWS}
    same = {m: True for m in ROWS}
    bandwidth = []
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build(args.base, Path(tmp) / "base.so"), "new": build(None, Path(tmp) / "new.so")}
        for rnd in range(args.repeats + 1):  # round 0 warms up
            bandwidth.append(memory_bandwidth(args.threads, repeats=1)["best_gb_s"])
            for m in ROWS:
                outs = {}
                for side in ("base", "new") if rnd % 2 else ("new", "base"):
                    outs[side] = [torch.empty(m, w.shape[0]) for w, _ in weights]
                    dt = run(libs[side], weights, x, outs[side], m, args.threads)
                    if rnd:
                        times[m][side].append(dt)
                same[m] = same[m] and all(torch.equal(a, b) for a, b in zip(outs["base"], outs["new"]))
    mach = machine()
    bw = statistics.median(bandwidth[1:])
    print(f"{mach['cpu']} ({mach['isa']}), {args.threads} threads, float32, SmolLM2-135M's layer GEMMs x {LAYERS} "
          f"({weight_bytes / 1e6:.0f} MB); base {args.base} vs this tree; median (min) of {args.repeats} interleaved "
          f"rounds; {mach['date']}")
    print(f"memory read bandwidth (torch.sum, 1 GiB): median {bw:.1f} GB/s, best {max(bandwidth[1:]):.1f}: "
          f"floor {weight_bytes / bw / 1e6:.1f} ms")
    print(f"{'rows':>4s} {'base ms':>16s} {'new ms':>16s} {'GB/s base/new':>14s} {'GFLOPS base/new':>16s} "
          f"{'new/base':>9s} {'same bits':>9s}")
    report = {}
    for m, t in times.items():
        b, n = statistics.median(t["base"]), statistics.median(t["new"])
        flops = 2 * m * weight_bytes / 4
        report[m] = {"base_ms": b * 1e3, "new_ms": n * 1e3, "base_min_ms": min(t["base"]) * 1e3,
                     "new_min_ms": min(t["new"]) * 1e3, "ratio": n / b, "gb_s_base": weight_bytes / b / 1e9,
                     "gb_s_new": weight_bytes / n / 1e9, "gflops_base": flops / b / 1e9, "gflops_new": flops / n / 1e9,
                     "same_bits": same[m]}
        print(f"{m:4d} {b * 1e3:7.1f} ({min(t['base']) * 1e3:6.1f}) {n * 1e3:7.1f} ({min(t['new']) * 1e3:6.1f}) "
              f"{weight_bytes / b / 1e9:6.1f}/{weight_bytes / n / 1e9:<7.1f} {flops / b / 1e9:7.1f}/{flops / n / 1e9:<8.1f} "
              f"{n / b:9.3f} {str(same[m]):>9s}")
    if args.json:
        args.json.write_text(json.dumps({"machine": mach, "base": args.base, "repeats": args.repeats,
                                         "threads": args.threads, "weight_bytes": weight_bytes,
                                         "bandwidth_gb_s": bandwidth[1:], "rows": report}, indent=1))


if __name__ == "__main__":
    main()
