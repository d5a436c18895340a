"""Cold prefill A/B in one process, the variants alternating per pass (scratch script of 2026-11-28;
run from the repository root):

    # the package's kernels against another revision's csrc/ (the attention calls timed apart too)
    git archive b25bce0 ragcache_backend/model/kernels/csrc | tar -x -C /tmp/old
    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx-decode/ab_prefill.py --csrc /tmp/old/ragcache_backend/model/kernels/csrc 2000
    # SiLU(gate) * up in our AMX GEMM's epilogue (Linear.silu_gated) against silu_mul over the GEMM
    .venv/bin/python docs/benchmarks/2026-11-28-xeon-amx-decode/ab_prefill.py --silu 1000

One engine (SmolLM2-135M bf16, 2 threads), ``forward_vs_vllm.Ours.cold`` passes of random token ids;
a warm-up round, then ``--rounds`` rounds; medians.
"""
import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from forward_vs_vllm import MODEL_DIR, MiB, Ours  # noqa: E402

from ragcache_backend import EngineConfig, RAGCacheEngine  # noqa: E402
from ragcache_backend.model.kernels import library, native  # noqa: E402
from ragcache_backend.model.kernels.linear import Linear  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("tokens", type=int)
ap.add_argument("--csrc", type=Path, help="another revision's csrc/ folder (variant 'old')")
ap.add_argument("--silu", action="store_true", help="fused SiLU epilogue (new) against silu_mul over the GEMM (old)")
ap.add_argument("--rounds", type=int, default=8)
args = ap.parse_args()
engine = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype="bfloat16", threads=2, device_budget_bytes=1024 * MiB,
                                     host_budget_bytes=0))
ours, rng = Ours(engine), random.Random(0)
fused = Linear.silu_gated
if args.csrc:
    old_lib = library.build_library(args.csrc)
    variants = {"new": contextlib.nullcontext, "old": lambda: library.using_library(old_lib)}
else:
    @contextlib.contextmanager
    def unfused():
        Linear.silu_gated = lambda self, x: native.silu_mul(self(x))
        try:
            yield
        finally:
            Linear.silu_gated = fused
    variants = {"new": contextlib.nullcontext, "old": unfused}
spent = [0.0]
attend = native.paged_attention


def timed(*a, **k):
    t = time.perf_counter()
    try:
        return attend(*a, **k)
    finally:
        spent[0] += time.perf_counter() - t


native.paged_attention = timed
res = {k: [] for k in variants}
att = {k: [] for k in variants}
for r in range(args.rounds + 1):
    ids = [rng.randrange(100, 40000) for _ in range(args.tokens)]
    for k in (list(variants) if r % 2 else list(variants)[::-1]):
        spent[0] = 0.0
        with variants[k]():
            t = ours.cold({"ids": ids})
        if r:
            res[k].append(t)
            att[k].append(spent[0])
for k in variants:
    print(f"{args.tokens} tokens, {k}: pass {1e3 * statistics.median(res[k]):.1f} ms (min {1e3 * min(res[k]):.1f}), "
          f"attention calls {1e3 * statistics.median(att[k]):.1f} ms")
print(f"pass new / old: {statistics.median(res['new']) / statistics.median(res['old']):.3f}")
engine.close()
