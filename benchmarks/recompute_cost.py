"""What a recomputed token costs against a plain prefill token (issue 24, item 4), on one machine.

    .venv/bin/python benchmarks/recompute_cost.py [--dtype float32|bfloat16] [--context 1000] [--shares 0.15 0.3 0.5]
        [--repeats 7] [--json OUT]

The default model (``load_model(None, dtype=--dtype)``, float32 by default; bfloat16 takes the native
bf16 kernels where the CPU has AVX512-BF16, and their AMX prompt attention where it has AMX), a
``ModelRunner`` (PagedLlama), ``--threads`` (2). One ``--context``-token context of seeded random token ids is prefilled once: a 10% lead, five
equal "chunk" ranges, a 5% tail. For every share ``p`` of the chunk tokens, ``N = p * chunk tokens``:

* **(a) prefill**: the last ``N`` tokens of the context computed as an ordinary prefill over the
  ``context - N`` tokens before them (the causal kernels);
* **(b) recompute**: ``N`` tokens at explicit positions inside the same context (share ``p`` of each
  chunk's positions, scattered, seeded): a chunk-cache recomputation (``ForwardInput.positions``),
  on the native kernel (this change) and with ``PagedLlama.native_positions = False`` (the masked
  torch attention it replaced; "torch" below).

Each forward rewrites the same K/V it read (same tokens, same positions), so the context never
changes. The three are interleaved (order rotating per round) after one untimed warm-up round;
printed: per-token medians (min) and the per-token ratios (b)/(a). Target: (b)/(a) <= 1.2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner  # noqa: E402

BLOCK = 16


def chunk_ranges(context: int) -> list[tuple[int, int]]:
    """Five equal chunk ranges after a 10% lead, before a 5% tail."""
    lead, tail = context // 10, context // 20
    size = (context - lead - tail) // 5
    return [(lead + i * size, lead + (i + 1) * size) for i in range(5)]


def scattered(ranges: list[tuple[int, int]], share: float, seed: int) -> list[int]:
    """Share ``share`` of each range's positions, picked at random (seeded), ascending."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for a, b in ranges:
        keep = max(1, round(share * (b - a)))
        out.extend((a + torch.randperm(b - a, generator=g)[:keep]).tolist())
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.15, 0.3, 0.5])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch-path (before) measurement")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from forward_vs_vllm import machine

    info = machine()
    runner = ModelRunner(load_model(None, dtype=args.dtype), num_device_blocks=-(-args.context // BLOCK) + 1, block_size=BLOCK)
    print(f"{info['cpu']} ({info['isa']}), {args.threads} threads, {info['date']}, load average {os.getloadavg()[0]:.2f}; "
          f"{args.dtype}, path {runner.kernel_tag}, explicit positions on the kernel: {runner.layers.native_positions}", flush=True)
    s = args.context
    blocks = tuple(range(-(-s // BLOCK)))
    toks = torch.randint(10, runner.vocab_size - 10, (s,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward([ForwardInput(tuple(toks), (), (KVRun(blocks, 0, s),))])
    whole = (KVRun(blocks, 0, s),)
    ranges = chunk_ranges(s)

    def prefill(n: int) -> ForwardInput:
        return ForwardInput(tuple(toks[s - n:]), (KVRun(blocks, 0, s - n),), (KVRun(blocks, s - n, n),))

    def recompute(pos: list[int]) -> ForwardInput:
        return ForwardInput(tuple(toks[p] for p in pos), whole, (), positions=tuple(pos))

    modes = ["prefill", "recompute"] + ([] if args.no_torch or not runner.layers.native_positions else ["recompute-torch"])
    cases = []
    for i, share in enumerate(args.shares):
        pos = scattered(ranges, share, seed=i + 1)
        cases.append((share, pos, {m: [] for m in modes}))

    native_ok = runner.layers.native_positions

    def timed(mode: str, pos: list[int]) -> float:
        item = prefill(len(pos)) if mode == "prefill" else recompute(pos)
        runner.layers.native_positions = mode == "recompute" and native_ok
        t0 = time.perf_counter()
        runner.forward([item])
        return time.perf_counter() - t0

    for rnd in range(-1, args.repeats):  # round -1: warm-up
        for share, pos, times in cases:
            order = modes[rnd % len(modes):] + modes[: rnd % len(modes)]
            for mode in order:
                t = timed(mode, pos)
                if rnd >= 0:
                    times[mode].append(t / len(pos))
        print(f"round {rnd}: " + ", ".join(f"{share:.0%} " + "/".join(f"{times[m][-1] * 1e3:.2f}" if rnd >= 0 else "-"
                                                                      for m in modes) for share, _, times in cases)
              + " ms/token", flush=True)
    runner.layers.native_positions = native_ok

    result = {"machine": info, "model": runner.loaded.name, "dtype": args.dtype, "kernel_tag": runner.kernel_tag, "context": s,
              "threads": args.threads, "repeats": args.repeats, "cases": []}
    result["load_end"] = os.getloadavg()[0]
    print(f"\ncontext {s} tokens, chunks {ranges}; per-token ms, median (min) of {args.repeats}; "
          f"load average at the end {result['load_end']:.2f}")
    print(f"{'share':>6} {'N':>5} " + " ".join(f"{m:>20}" for m in modes) + "  (b)/(a)"
          + ("  torch/(a)" if len(modes) > 2 else ""))
    for share, pos, times in cases:
        med = {m: statistics.median(times[m]) for m in modes}
        row = {"share": share, "tokens": len(pos), **{f"{m}_ms_per_token": med[m] * 1e3 for m in modes},
               **{f"{m}_min_ms_per_token": min(times[m]) * 1e3 for m in modes},
               "ratio": med["recompute"] / med["prefill"]}
        if "recompute-torch" in modes:
            row["ratio_torch"] = med["recompute-torch"] / med["prefill"]
        result["cases"].append(row)
        print(f"{share:>6.0%} {len(pos):>5} " + " ".join(f"{med[m] * 1e3:>11.3f} ({min(times[m]) * 1e3:6.3f})" for m in modes)
              + f"  {row['ratio']:7.3f}" + (f"  {row['ratio_torch']:9.3f}" if "ratio_torch" in row else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
