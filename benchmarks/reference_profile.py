"""Measure the prefill profiles that ``ragcache demo`` ships for the default model
(``ragcache_backend/engine/reference_profile.json`` for float32, ``reference_profile_bf16.json``
for bfloat16 on the native AVX512-BF16 kernels).

The engine's own procedure (:func:`ragcache_backend.engine.setup.load_or_measure_profile`: the
default 3 x 3 grid of cached x new tokens, the minimum of 3 runs per point, made non-decreasing),
on SmolLM2-135M-Instruct in ``--dtype`` (float32 or bfloat16) with ``--threads`` torch threads. ``--rounds N`` measures N
times and keeps each point's minimum (the least disturbed by other processes on a shared
machine). The file records no model fingerprint (a fingerprint names one installation's files);
``ragcache demo`` uses it for the default model in that dtype on the CPU.

Usage: ``.venv/bin/python benchmarks/reference_profile.py [--dtype bfloat16] [--threads 2] [--rounds 2] [--out FILE]``
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ragcache_backend.cache.profile import PrefillProfile  # noqa: E402
from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.demo.demo import REFERENCE_PROFILE, REFERENCE_PROFILE_BF16  # noqa: E402
from ragcache_backend.engine.setup import build_parts  # noqa: E402
from ragcache_backend.model.loader import load_model  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", type=Path, default=None, help="default: the shipped file of --dtype")
    args = parser.parse_args()
    args.out = args.out or (REFERENCE_PROFILE if args.dtype == "float32" else REFERENCE_PROFILE_BF16)
    loaded = load_model(None, dtype=args.dtype)
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            started, load = time.perf_counter(), os.getloadavg()[0]
            parts = build_parts(EngineConfig(dtype=args.dtype, threads=args.threads, profile_path=Path(tmp) / "profile.json"),
                                loaded=loaded)
            rounds.append(parts.profile)
            print(f"round {i + 1}: {time.perf_counter() - started:.1f} s, load average {load:.1f} at the start, "
                  f"kernels {parts.runner.kernel_tag}: {parts.profile.times}")
    first = rounds[0]
    times = tuple(tuple(min(p.times[i][j] for p in rounds) for j in range(len(first.betas)))
                  for i in range(len(first.alphas)))  # a minimum of non-decreasing grids stays non-decreasing
    profile = PrefillProfile(first.alphas, first.betas, times, None, first.dtype, first.threads)
    profile.save(args.out)
    print(f"wrote {args.out} ({cpu_name()}, {args.threads} threads): {profile.times}")


if __name__ == "__main__":
    main()
