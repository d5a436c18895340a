"""A mixed step's layer GEMMs (2,040 prompt rows, then 8 generated tokens' rows), SmolLM2's four shapes:
the prompt tiles' outputs put together with the generated rows' in one copy (now) against two (the
tiles joined first, as before). Same bits; alternating, medians of 15 (scratch script of 2026-11-28):

    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx/mixed_step_copy.py
"""
import time

import torch

from ragcache_backend.model.kernels import native
from ragcache_backend.model.kernels.linear import StepRowClasses, pack_linear, step_rows

torch.manual_seed(0)
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
lins = {k: pack_linear((torch.randn(n, kk) * 0.05).bfloat16()) for k, (n, kk) in shapes.items()}
xs = {k: torch.randn(2048, kk).bfloat16() for k, (n, kk) in shapes.items()}
classes = StepRowClasses.of([2040] + [1] * 8, [False] + [True] * 8)


def now(k):
    with step_rows(classes):
        return lins[k](xs[k])


def before(k):  # the prompt rows' tiles joined (a prompt-only step's call), then again with the generated rows
    lin, x = lins[k], xs[k]
    with step_rows(StepRowClasses.of([2040], [False])):
        prompt = lin(x[:2040])
    return torch.cat((prompt, native.linear_rows(x[2040:], lin.weight, lin.bias)))


for k in shapes:
    assert torch.equal(now(k), before(k))
times = {"now": [], "before": []}
for _ in range(15):
    for name, fn in (("now", now), ("before", before)):
        t = time.perf_counter()
        for k in shapes:
            fn(k)
        times[name].append(time.perf_counter() - t)
med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
print(f"one layer's four GEMMs, mixed step of 2,048 rows: now {med['now']:.2f} ms, before {med['before']:.2f} ms, "
      f"ratio {med['now'] / med['before']:.3f}; x30 layers: {30 * (med['before'] - med['now']):.1f} ms saved per step")
