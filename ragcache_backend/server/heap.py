"""Freed host memory given back to the OS while the server runs (glibc's ``malloc_trim``).

The host tier allocates and frees KV buffers of megabytes all the time (a swap-out, an eviction, a
file read back from disk). glibc serves a large request from ``mmap`` only until the first large
free; then it raises its threshold and later buffers come from the heap, where freed ones leave
holes: a server whose host tier churned kept growing (measured: +373 MiB of RSS beyond the tiers'
bytes after a second 200-client burst).

Lowering the threshold for the whole process (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``, what the
server did before) also turned every activation of a prefill (a 1,000-token prompt's MLP rows are
megabytes) into a fresh ``mmap`` whose pages fault in on first touch and go back on free: a cold
1,080-token bf16 prefill took 530 ms instead of 405 ms (measured on an AMD EPYC, 2026-11-24).
Trimming the heaps from a background thread keeps the allocator's speed and returns the holes'
pages (glibc's ``malloc_trim`` releases every whole free page of every arena, not only the top).

Since 2026-11-29 the engine also keeps a step's freed activations on the heap for the next step
(:mod:`ragcache_backend.model.heap`: a cold 1,000-token prefill 0.89-0.90x the time on a 2-core
Zen 3). A trim in the middle of a burst would give those pages back and the next step would fault
them in again, so the server trims only once the engine has had nothing in flight for two checks
in a row (``busy``): after a burst RSS comes back as before, during one the pages stay.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections.abc import Callable

from ragcache_backend.model.heap import libc

__all__ = ["HeapTrimmer"]

log = logging.getLogger(__name__)


class HeapTrimmer:
    """Calls glibc's ``malloc_trim(0)`` every ``interval_s`` seconds on a daemon thread, skipping
    the checks at which ``busy()`` is true and the first one after.

    Args:
        interval_s: seconds between two checks (> 0). A trim runs without the GIL (ctypes) and took
            about 1 ms in a 1.4 GiB process (measured 2026-11-24, AMD EPYC).
        busy: whether the engine is working now (requests in flight); None: never busy. An
            exception from it counts as busy.

    Raises:
        ValueError: ``interval_s`` is not a positive number.

    On a system without glibc (another libc, another OS) :attr:`available` is False and
    :meth:`start` does nothing.
    """

    def __init__(self, interval_s: float = 1.0, busy: Callable[[], bool] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self.busy = busy
        self.trims = 0
        self._idle_checks = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._trim = None
        if sys.platform.startswith("linux"):
            try:
                self._trim = libc().malloc_trim
                self._trim.argtypes, self._trim.restype = [ctypes.c_size_t], ctypes.c_int
            except AttributeError:  # no C library (None), or one without malloc_trim
                self._trim = None

    @property
    def available(self) -> bool:
        """Whether this process's allocator is glibc's (``malloc_trim`` found)."""
        return self._trim is not None

    def trim(self) -> bool:
        """Trim once now; True if glibc gave memory back."""
        if self._trim is None:
            return False
        self.trims += 1
        return bool(self._trim(0))

    def start(self) -> HeapTrimmer:
        """Start the background thread (once); returns self."""
        if self._trim is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ragcache-heap-trim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the background thread and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> HeapTrimmer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def check(self) -> bool:
        """One periodic check: trim if ``busy()`` was false now and at the check before; True if trimmed."""
        try:
            busy = self.busy is not None and bool(self.busy())
        except Exception:  # an engine being built or closed: not a moment to trim
            busy = True
        self._idle_checks = 0 if busy else self._idle_checks + 1
        if self._idle_checks < 2 or self._trim is None:
            return False
        self.trim()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # never let memory housekeeping take the server down
                log.exception("malloc_trim failed; heap trimming stops")
                return
