"""Where a decode step's time goes: the whole-step native call, the LM head, and the rest (Python,
step set-up, sampling), beside the memory a step must read and the weights-read floor.

    .venv/bin/python benchmarks/decode_breakdown.py [--dtype float32] [--batch 1] [--context 1024]
                                                    [--steps 32] [--rounds 5] [--json OUT]

Each round runs ``--steps`` greedy decode steps of ``--batch`` sequences over ``--context`` random
prompt tokens on the engine's runner (``forward_vs_vllm.py``'s kernel-level ``Ours.decode``: no
request, scheduler or server), timing every step's ``native.decode_step`` call (all decoder layers,
one parallel region: ``rc32_decode_step`` in float32) and its LM head (``PagedLlama.logits``) with
wall clocks around them; each is the mean over the round's steps, and "rest" (step set-up, the
embedding, argmax, Python) is the mean step minus both. Right after each round it reads 1 GiB with
``torch.sum`` (best of 3: ``forward_vs_vllm.memory_bandwidth``), so the step's floor (the model's
unique weight bytes over that bandwidth, ``forward_vs_vllm.py``'s definition) is that round's.
Bytes a step reads: the decoder layers' weights plus every sequence's K and V over all layers (the
whole-step call), and the LM head's weight; GB/s are those bytes over the measured times.

Last, the step's own overhead: the same decode with the whole-step call and the LM head replaced by
no-ops (a measurement of what is left, never an engine path), min of 3 runs of 200 steps. What that
cannot show is the Python after a real step, whose caches the kernels' 500 MB of reads have emptied.

Run nothing else meanwhile (2 cores): the step is bound by memory reads, which other work shares.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from forward_vs_vllm import MODEL_DIR, Ours, machine, memory_bandwidth, weight_bytes  # noqa: E402
from ragcache_backend import EngineConfig, RAGCacheEngine  # noqa: E402
from ragcache_backend.model.kernels import native  # noqa: E402

MiB = 1 << 20


class Clock:
    """Wall seconds of every call of ``owner.name``, kept per call while installed."""

    def __init__(self, owner: object, name: str) -> None:
        self.calls: list[float] = []
        self.inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - t)

        setattr(owner, name, timed)

    def replace(self, fn) -> None:
        """Call ``fn`` instead of the original (still timed)."""
        self.inner = fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of each sequence before the first step")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if min(args.batch, args.context, args.steps, args.rounds) < 1:
        ap.error("--batch, --context, --steps and --rounds must be >= 1")
    torch.set_num_threads(args.threads)
    engine = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype=args.dtype, threads=args.threads,
                                         device_budget_bytes=2048 * MiB, host_budget_bytes=0))
    runner, ours, rng = engine.runner, Ours(engine), random.Random(0)
    model = runner.layers
    if not model.whole_step_decode:
        sys.exit(f"this engine does not run whole-step native decode ({runner.kernel_tag}): nothing to break down")
    step_call, head_call = Clock(native, "decode_step"), Clock(model, "logits")
    unique = weight_bytes(engine.loaded.model)
    head = model.lm_head.weight
    head_bytes = head.numel() * head.element_size()
    layer_bytes = weight_bytes(engine.loaded.model.model.layers)  # the decoder layers' weights (and norms)
    mid_context = args.context + args.steps // 2
    kv_bytes = args.batch * mid_context * runner.kv_bytes_per_token
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731

    def decode(steps: int) -> float:
        return ours.decode({"prompts": [ids(args.context) for _ in range(args.batch)], "steps": steps})

    decode(4)  # warm-up
    mach = machine()
    print(f"{mach['cpu']} ({mach['isa']}), {args.threads} threads, {args.dtype}, {runner.kernel_tag}; batch {args.batch}, "
          f"{args.context} tokens of context, {args.steps} steps a round; {mach['date']}")
    print(f"bytes a step reads: decoder layers {layer_bytes / 1e6:.0f} MB + KV {kv_bytes / 1e6:.0f} MB (whole-step call), "
          f"LM head {head_bytes / 1e6:.0f} MB; floor = {unique / 1e6:.0f} MB of unique weights / read bandwidth")
    rows = []
    for rnd in range(args.rounds):
        step_call.calls.clear()
        head_call.calls.clear()
        step = decode(args.steps)
        bw = memory_bandwidth(args.threads, repeats=3)["best_gb_s"]
        # the last `steps` calls are the decode steps' (the prompt's pass before them has an LM head call too)
        whole, lm = (statistics.fmean(c.calls[-args.steps:]) for c in (step_call, head_call))
        floor = unique / (bw * 1e9)
        rows.append({"step_s": step, "whole_step_s": whole, "lm_head_s": lm, "rest_s": step - whole - lm,
                     "read_gb_s": bw, "floor_s": floor})
        print(f"round {rnd + 1}: step {1e3 * step:.1f} ms = whole-step call {1e3 * whole:.1f} "
              f"({(layer_bytes + kv_bytes) / whole / 1e9:.1f} GB/s) + LM head {1e3 * lm:.1f} ({head_bytes / lm / 1e9:.1f} GB/s) "
              f"+ rest {1e3 * (step - whole - lm):.1f}; read {bw:.1f} GB/s, floor {1e3 * floor:.1f} ms, "
              f"step / floor {step / floor:.2f}", flush=True)
    step_call.replace(lambda *a, **k: None)
    head_call.replace(lambda h: torch.zeros(h.shape[0], head.shape[0]))
    overhead = min(decode(200) for _ in range(3))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    over = statistics.median(r["step_s"] / r["floor_s"] for r in rows)
    print(f"median of {args.rounds}: step {1e3 * med['step_s']:.1f} ms, whole-step call {1e3 * med['whole_step_s']:.1f}, "
          f"LM head {1e3 * med['lm_head_s']:.1f}, rest {1e3 * med['rest_s']:.1f}; step / floor of its round {over:.2f}")
    print(f"the step's own overhead (kernel calls and LM head as no-ops, min of 3 x 200 steps): {1e3 * overhead:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "machine": mach,
                                         "bytes": {"layers": layer_bytes, "kv": kv_bytes, "lm_head": head_bytes,
                                                   "unique_weights": unique},
                                         "rounds": rows, "median": med, "step_over_floor": over,
                                         "overhead_s": overhead}, indent=2))


if __name__ == "__main__":
    main()
