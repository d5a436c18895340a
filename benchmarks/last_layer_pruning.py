"""The last layer run for the logit rows only (``PagedLlama.last_layer_pruning``), against running
it for every row: forward passes of the default model, the two interleaved in one process.

    .venv/bin/python benchmarks/last_layer_pruning.py [--repeats 7] [--dtype float32|bfloat16] [--json OUT]

A prefill needs every prompt row's K/V in every layer, but past the last layer's K/V write only the
rows whose logits are taken (each sequence's last row) are read: the last layer's attention,
``o_proj`` and MLP for the other rows are wasted work, about 1/num_layers of a prefill (30 layers
in SmolLM2-135M: ~3%). Measured: cold prompts of several lengths, a burst-like mixed step (three
prompts and two decode rows, 2,048 rows) and 30 tokens over 1,024 cached; per case the median
(min) over ``--repeats`` rounds, each round timing both settings one after the other in turn.
The native fused path (the only one that can prune): float32 (pruning on by default), or bf16 where
the CPU has AVX512-BF16 (off by default: 2026-11-28 on a Xeon with AMX, ``--dtype bfloat16``, 7 rounds,
pruned / every row 1.01 / 1.01 / 0.97 for cold 250 / 1,000 / 2,000 tokens and 1.08 for 30 tokens over
1,024 cached: within this VM's noise, no gain).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from forward_vs_vllm import machine  # noqa: E402

from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, dtype=args.dtype)
    runner = ModelRunner(loaded, num_device_blocks=1200, block_size=16)
    if not runner.layers.native_fused:  # bf16 does not prune by default (no gain measured), it can be turned on
        sys.exit(f"the forward path here is {runner.kernel_tag}: pruning needs the native fused path")
    rng = random.Random(0)
    vocab = loaded.model.config.vocab_size
    blocks = iter(range(10**9))

    def run(n: int) -> KVRun:
        return KVRun(tuple(next(blocks) for _ in range(-(-n // 16))), 0, n)

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, vocab) for _ in range(n))

    # contexts kept in the arena: two to decode on (1,000 tokens) and 1,024 cached prompt tokens
    dec = [run(1008) for _ in range(2)]
    cached = run(1024)
    for r in (*dec, cached):
        runner.forward([ForwardInput(toks(r.length), (), (r,))])
    dec = [KVRun(r.blocks, 0, 1000) for r in dec]
    first_free = next(blocks)

    def cases() -> dict[str, list[ForwardInput]]:
        nonlocal blocks
        blocks = iter(range(first_free, 10**9))  # every round writes the same scratch blocks
        return {
            "cold 250": [ForwardInput(toks(250), (), (run(250),))],
            "cold 1000": [ForwardInput(toks(1000), (), (run(1000),))],
            "cold 2000": [ForwardInput(toks(2000), (), (run(2000),))],
            "mixed: 915 + 788 + 343 + 2 decodes": [ForwardInput(toks(n), (), (run(n),)) for n in (915, 788, 343)] + [
                ForwardInput((5,), (d,), (KVRun(d.blocks, 1000, 1),), decode=True) for d in dec],
            "30 over 1,024 cached": [ForwardInput(toks(30), (cached,), (KVRun(cached.blocks + (next(blocks), next(blocks)), 1024, 30),))],
        }

    times: dict[str, dict[str, list[float]]] = {}
    for rnd in range(args.repeats + 1):  # round 0 warms up
        for name, batch in cases().items():
            order = (True, False) if rnd % 2 else (False, True)
            for prune in order:
                runner.layers.last_layer_pruning = prune
                t = time.perf_counter()
                runner.forward(batch)
                dt = time.perf_counter() - t
                if rnd:
                    times.setdefault(name, {"pruned": [], "every row": []})["pruned" if prune else "every row"].append(dt)
    runner.layers.last_layer_pruning = True
    print(f"{machine()['cpu']} ({machine()['isa']}), {args.threads} threads, {runner.kernel_tag}, {args.dtype}; "
          f"median (min) of {args.repeats} interleaved rounds")
    print(f"{'case':38s} {'every row ms':>16s} {'pruned ms':>16s} {'pruned / every':>14s}")
    out = {}
    for name, t in times.items():
        a, b = statistics.median(t["every row"]), statistics.median(t["pruned"])
        out[name] = {"every_row_ms": a * 1e3, "pruned_ms": b * 1e3, "ratio": b / a,
                     "every_row_min_ms": min(t["every row"]) * 1e3, "pruned_min_ms": min(t["pruned"]) * 1e3}
        print(f"{name:38s} {a * 1e3:8.1f} ({min(t['every row']) * 1e3:6.1f}) {b * 1e3:8.1f} ({min(t['pruned']) * 1e3:6.1f}) "
              f"{b / a:14.3f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "repeats": args.repeats, "cases": out}, indent=1))


if __name__ == "__main__":
    main()
