"""Measure the prefill profile that ``ragcache demo`` ships for the default model
(``ragcache_backend/engine/reference_profile.json``).

The engine's own procedure (:func:`ragcache_backend.engine.setup.load_or_measure_profile`: the
default 3 x 3 grid of cached x new tokens, the minimum of 3 runs per point, made non-decreasing),
on SmolLM2-135M-Instruct in float32 with ``--threads`` torch threads. ``--rounds N`` measures N
times and keeps each point's minimum (the least disturbed by other processes on a shared
machine). The file records no model fingerprint (a fingerprint names one installation's files);
``ragcache demo`` uses it for the default model in float32 on the CPU.

Usage: ``.venv/bin/python benchmarks/reference_profile.py [--threads 2] [--rounds 2] [--out FILE]``
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
from ragcache_backend.demo.demo import REFERENCE_PROFILE  # noqa: E402
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
    parser.add_argument("--out", type=Path, default=REFERENCE_PROFILE)
    args = parser.parse_args()
    loaded = load_model(None, dtype="float32")
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            started, load = time.perf_counter(), os.getloadavg()[0]
            parts = build_parts(EngineConfig(threads=args.threads, profile_path=Path(tmp) / "profile.json"),
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
