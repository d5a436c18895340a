"""Two or more versions of the native kernels side by side, in one process.

Each ``FOLDER`` holds edited copies of ``ragcache_backend/model/kernels/csrc/`` (or another
revision's files); they are compiled with :func:`native.build_library` and compared against the
package's own kernels ("main"):

1. **bits**: ``native.linear_rows`` of each version against main's, for 1-16 input rows over three
   weight shapes, in the measured dtype: "same bits" or which shape and row count differ;
2. **decode step**: the engine's decode step at batch 1, 2, 4, 8, 16 (1,024 tokens of context each,
   ``--steps`` steps; ``forward_vs_vllm.Ours.decode``), the versions alternating per measurement
   (:func:`native.using_library`), ``--rounds`` timed rounds after a warm-up one; medians and the
   ratio to main;
3. with ``--linear``, one linear layer alone at 1, 2, 4, 8 and 16 input rows over weights larger
   than the caches: GB/s of weights read (``--linear-only``: bits and linear layers, no decode step).

    .venv/bin/python benchmarks/kernel_ab.py /tmp/variant --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forward_vs_vllm as fvv  # noqa: E402

from ragcache_backend import EngineConfig, RAGCacheEngine  # noqa: E402
from ragcache_backend.model.kernels import native  # noqa: E402

BATCHES = (1, 2, 4, 8, 16)
SHAPES = ((1536, 576), (576, 1536), (148, 96))  # [N, K]: gate/up and down of SmolLM2-135M, and a small odd one
LINEAR_SHAPES = ((49152, 576), (1536, 576), (576, 576), (576, 1536))
LINEAR_ROWS = (1, 2, 4, 8, 16)


def running(lib):
    """The kernels run from ``lib`` in the block (None: the package's own)."""
    return native.using_library(lib) if lib is not None else contextlib.nullcontext()


def same_bits(lib, dtype: torch.dtype) -> str:
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        for m in range(1, 17):
            x = torch.randn(m, k, generator=g).to(dtype)
            want = native.linear_rows(x, w, b)
            with native.using_library(lib):
                got = native.linear_rows(x, w, b)
            if not torch.equal(want.view(torch.int16) if dtype == torch.bfloat16 else want,
                               got.view(torch.int16) if dtype == torch.bfloat16 else got):
                return f"DIFFERENT bits (weight {n}x{k}, {m} rows)"
    return "same bits"


def linear_gbps(libs: dict, dtype: torch.dtype, rounds: int) -> None:
    res: dict = {}
    for n, k in LINEAR_SHAPES:
        ws = [torch.randn(n, k).to(dtype) for _ in range(max(1, int(200e6 // (n * k * dtype.itemsize))))]
        for m in LINEAR_ROWS:
            x = torch.randn(m, k).to(dtype)
            for _ in range(rounds):
                for name, lib in libs.items():
                    with running(lib):
                        native.linear_rows(x, ws[0])
                        t = time.perf_counter()
                        for w in ws:
                            native.linear_rows(x, w)
                        res.setdefault((name, n, k, m), []).append(n * k * dtype.itemsize * len(ws) / (time.perf_counter() - t) / 1e9)
            print(f"linear N={n} K={k} M={m}: " + ", ".join(
                f"{name} {statistics.median(res[(name, n, k, m)]):.1f} GB/s" for name in libs), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="folders with the kernel C files to compare against main's")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds (after one warm-up round)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--linear", action="store_true", help="also one linear layer alone, GB/s")
    ap.add_argument("--linear-only", action="store_true", help="bits and linear layers only (no decode step)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    libs = {"main": None, **{str(f): native.build_library(f) for f in args.folders}}
    for name, lib in libs.items():
        if lib is not None:
            print(f"{name}: {same_bits(lib, dtype)} as main (linear_rows, {args.dtype}, 1-16 rows)", flush=True)
    if args.linear or args.linear_only:
        linear_gbps(libs, dtype, args.rounds)
    if args.linear_only:
        return
    engine = RAGCacheEngine(EngineConfig(model=str(fvv.MODEL_DIR), dtype=args.dtype, threads=args.threads,
                                         device_budget_bytes=2048 * 2**20, host_budget_bytes=0))
    ours, rng = fvv.Ours(engine), random.Random(0)
    res: dict = {}
    for rnd in range(args.rounds + 1):
        order = list(libs) if rnd % 2 else list(reversed(libs))
        for b in BATCHES:
            prompts = [[rng.randrange(100, 40000) for _ in range(1024)] for _ in range(b)]
            for name in order:
                with running(libs[name]):
                    t = ours.decode({"prompts": prompts, "steps": args.steps})
                if rnd:
                    res.setdefault((name, b), []).append(t)
    for b in BATCHES:
        base = statistics.median(res[("main", b)])
        print(f"decode step, batch {b}: " + ", ".join(
            f"{name} {1e3 * statistics.median(res[(name, b)]):.1f} ms ({statistics.median(res[(name, b)]) / base:.2f}x)"
            for name in libs))


if __name__ == "__main__":
    main()
