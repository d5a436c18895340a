"""The calling thread's OpenMP workers are freed on request (so the engine thread's regions stay fast)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# In a fresh interpreter: the suite's process has other threads coming and going (engines, writers)
# that would blur a count of its threads. Torch's workers must go even where another libgomp is
# loaded first (releasing only the first one found left torch's pool in place in the demo).
CHECK = """
import faiss  # first: faiss-cpu's own libgomp is mapped before torch's (as in the demo's process)
import os, threading, time, torch
from ragcache_backend.model.kernels import openmp
torch.set_num_threads(2)
count = lambda: len(os.listdir("/proc/self/task"))
seen = {}
def work():
    seen["before"] = count()
    torch.ones(512, 512) @ torch.ones(512, 512)  # this thread's first parallel region: its pool
    seen["with_pool"] = count()
    seen["released"] = openmp.release_thread_pool()
    deadline = time.monotonic() + 10
    while count() > seen["before"] and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["after"] = count()
    torch.ones(512, 512) @ torch.ones(512, 512)  # a later region still runs (the pool is made again)
worker = threading.Thread(target=work)
worker.start()
worker.join()
print(seen["released"], seen["before"], seen["with_pool"], seen["after"])
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_release_thread_pool_frees_the_calling_threads_workers():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    released, before, with_pool, after = out.stdout.split()
    if released != "True":
        pytest.skip("torch's OpenMP runtime is not libgomp")
    assert int(with_pool) > int(before)  # the region made workers
    assert int(after) == int(before)  # and they are gone
