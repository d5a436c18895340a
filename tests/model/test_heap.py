"""The C heap keeping a step's freed activations (model/heap.py): fresh pages no longer faulted in
for every large allocation, and the environment switch that leaves glibc's defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ragcache_backend.model import heap

# Allocates and frees a 40 MB tensor (above glibc's largest dynamic mmap threshold, 32 MiB) sixteen
# times, writing every page, and prints the minor page faults of every round after the first. Kept,
# the heap grows for the first 6-8 rounds (PyTorch's 64-byte aligned allocations leave the freed
# block a little short until freed neighbours merge), then serves the same pages every round.
_PROBE = """
import json, resource, sys, torch
from ragcache_backend.model.heap import keep_activation_pages
kept = keep_activation_pages()
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(10 << 20, dtype=torch.float32)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults[1:]}))
"""


def _probe(keep: str) -> dict:
    env = {**os.environ, "RAGCACHE_KEEP_HEAP": keep}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_freed_activation_pages_are_reused_not_faulted_again():
    default, kept = _probe("0"), _probe("1")
    if not kept["kept"]:
        pytest.skip("not glibc: mallopt unavailable, nothing changes")
    assert default["kept"] is False
    pages = (40 << 20) // 4096
    assert min(default["faults"]) > pages // 2  # glibc's defaults: a fresh mapping every time
    assert max(kept["faults"][-5:]) < pages // 20  # kept: the same heap pages again


def test_is_idempotent_and_never_raises():
    first = heap.keep_activation_pages()
    assert isinstance(first, bool)
    assert heap.keep_activation_pages() is first
