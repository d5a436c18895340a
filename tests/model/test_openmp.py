"""The calling thread's OpenMP workers are freed on request (so the engine thread's regions stay fast)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from ragcache_backend.model.kernels import openmp


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_release_thread_pool_frees_the_calling_threads_workers():
    threads = torch.get_num_threads()  # other tests may have left 1 (EngineConfig(threads=1))
    torch.set_num_threads(2)
    try:
        _check_release()
    finally:
        torch.set_num_threads(threads)


def _check_release() -> None:
    seen = {}

    def work() -> None:
        before = _threads()
        torch.ones(512, 512) @ torch.ones(512, 512)  # this thread's first parallel region: its pool
        seen["with_pool"] = _threads()
        seen["released"] = openmp.release_thread_pool()
        deadline = time.monotonic() + 5
        while _threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["after"], seen["before"] = _threads(), before
        torch.ones(512, 512) @ torch.ones(512, 512)  # a later region still runs (the pool is made again)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    if not seen["released"]:
        pytest.skip("torch's OpenMP runtime is not libgomp")
    assert seen["with_pool"] > seen["before"]  # the region made workers
    assert seen["after"] == seen["before"]  # and they are gone
