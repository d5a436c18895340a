"""Reading KV blocks back from the disk tier: one file after another (``DiskStore.load``) against
several at once (``DiskStore.load_many``, what the vLLM connector's worker does for a step's disk
blocks), with the page cache dropped before each pass, alternating, side by side in one run.

The files are what the connector writes for SmolLM2-135M in bf16 at vLLM block size 32
(30 layers x 32 tokens x 3 KV heads x 64, K and V: 737 KB each); ``--blocks`` of them per pass,
read in batches of ``--per-step`` (the blocks one restarted request loads in one step).
Needs root (``/proc/sys/vm/drop_caches``); without it the reads come from the page cache and the
script says so.

    .venv/bin/python benchmarks/disk_reads.py [--blocks 256] [--per-step 13] [--repeats 3]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ragcache_backend.cache.disk import DiskStore, path_key  # noqa: E402
from ragcache_backend.cache.policy import NodeStats  # noqa: E402

LAYOUT = (30, 3, 64)  # SmolLM2-135M: layers, KV heads, head size
BLOCK = 32


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--per-step", type=int, default=13)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder for the files (default: a temporary one under $TMPDIR)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ragcache-disk-reads-"))
    if args.dir is None:
        atexit.register(shutil.rmtree, root, True)  # a folder of our own: removed when the run ends
    store = DiskStore(root, "bench", LAYOUT, torch.bfloat16, 1 << 40)
    g = torch.Generator().manual_seed(0)
    keys = []
    for i in range(args.blocks):
        k = torch.randn(LAYOUT[0], BLOCK, LAYOUT[1], LAYOUT[2], generator=g).to(torch.bfloat16)
        pkey = path_key("", f"b{i}")
        if not store.put(pkey, "", f"b{i}", k, k.clone(), NodeStats(1, 0.0, BLOCK, 0)):  # the writer is behind
            assert store.flush(120) and store.put(pkey, "", f"b{i}", k, k.clone(), NodeStats(1, 0.0, BLOCK, 0))
        keys.append(pkey)
    assert store.flush(120)
    entries = [store.lookup(p) for p in keys]
    size = sum(e.nbytes for e in entries)
    steps = [entries[i:i + args.per_step] for i in range(0, len(entries), args.per_step)]
    times: dict[str, list[float]] = {"one at a time": [], "several at once": []}
    dropped = True
    for _ in range(args.repeats):
        for name in times:
            dropped &= drop_caches()
            t0 = time.perf_counter()
            for step in steps:
                got = [store.load(e) for e in step] if name == "one at a time" else store.load_many(step)
                assert all(x is not None for x in got)
            times[name].append(time.perf_counter() - t0)
    store.close()
    print(f"{args.blocks} files of {size / args.blocks / 1e3:.0f} KB in steps of {args.per_step}, "
          f"{DiskStore.READ_THREADS} reader threads; page cache {'dropped' if dropped else 'NOT dropped (not root)'} "
          f"before each pass; {os.cpu_count()} CPUs")
    med = {n: statistics.median(t) for n, t in times.items()}
    for n, t in times.items():
        print(f"  {n:16s} median {med[n] * 1e3:7.1f} ms ({size / med[n] / 1e9:.2f} GB/s, "
              f"{med[n] / len(steps) * 1e3:.2f} ms a step); runs {', '.join(f'{x * 1e3:.0f}' for x in t)} ms")
    print(f"  several at once / one at a time: {med['several at once'] / med['one at a time']:.2f}x")


if __name__ == "__main__":
    main()
