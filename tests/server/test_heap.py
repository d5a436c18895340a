"""The server's heap trimmer (server/heap.py): runs, stops, waits for the engine to be idle, and
refuses a bad interval."""

from __future__ import annotations

import time

import pytest

from ragcache_backend.server.heap import HeapTrimmer


def test_rejects_a_non_positive_interval():
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="interval_s"):
            HeapTrimmer(bad)


def test_trims_in_the_background_until_stopped():
    trimmer = HeapTrimmer(interval_s=0.01)
    if not trimmer.available:
        pytest.skip("not glibc: the trimmer does nothing here")
    with trimmer:
        deadline = time.monotonic() + 5
        while trimmer.trims < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert trimmer.trims >= 3
    done = trimmer.trims
    time.sleep(0.05)
    assert trimmer.trims == done  # stopped: no more trims
    assert isinstance(trimmer.trim(), bool)


def test_trims_only_after_two_idle_checks():
    state = {"busy": True}
    trimmer = HeapTrimmer(interval_s=1.0, busy=lambda: state["busy"])
    if not trimmer.available:
        pytest.skip("not glibc: the trimmer does nothing here")
    assert [trimmer.check() for _ in range(3)] == [False, False, False]  # a burst: the heap keeps its pages
    assert trimmer.trims == 0
    state["busy"] = False
    assert trimmer.check() is False  # idle once: the engine may be between two requests
    assert trimmer.check() is True
    assert trimmer.check() is True
    state["busy"] = True
    assert trimmer.check() is False
    assert trimmer.trims == 2


def test_a_failing_busy_check_counts_as_busy():
    def broken() -> bool:
        raise RuntimeError("engine closed")

    trimmer = HeapTrimmer(interval_s=1.0, busy=broken)
    assert [trimmer.check() for _ in range(3)] == [False, False, False]
    assert trimmer.trims == 0
