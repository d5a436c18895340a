"""A forward step's activation memory kept by the C heap for the next step (glibc's thresholds).

A forward step on the CPU allocates its activations through ``malloc`` (PyTorch's CPU allocator
and the native kernels' scratch) and frees them when it ends: a 1,000-token step of SmolLM2-135M
holds 12 MB gate/up rows, 4 MB attention rows and so on per layer. glibc serves a request above
its mmap threshold (128 KiB at start, then raised to the largest freed mmap'd block, at most 32
MiB) with a fresh ``mmap``, and returns the free top of a heap to the OS once it exceeds the trim
threshold (twice the mmap threshold): either way the next step's activations land on pages that
the OS faults in and zeroes again. Measured on a 2-core AMD EPYC (Zen 3, AVX2), float32, one
process, a cold 1,000-token prefill after a warm-up one (2026-11-29): 32,000-56,000 minor page
faults per prefill (130-230 MB of fresh pages) with glibc's defaults, none with the thresholds
raised, and the prefill 0.89-0.90x the time (1,954 and 1,869 ms against 2,175 and 2,091,
alternating processes). ``ragcache serve`` under a cold 200-client burst, ours alone, two rounds
alternating with the code before (``benchmarks/ab_commits.py --base bf311e4 --rounds 2 --
serve_load.py --servers ragcache --bursts 1``): the burst's wall time 0.957x (178.7 and 179.0 s
against 185.0 and 188.9), output tokens/s 1.045x, TTFT p50 0.99x, the same cached tokens. Where
the previous step had the same size, glibc's own adaptive threshold already keeps the pages:
``forward_vs_vllm.py``'s cold pass (after an untimed one of the same length) 1.016x, decode steps
0.92-1.01x (the same A/B method, noise).

:func:`keep_activation_pages` raises both thresholds once per process (the largest allocations,
above :data:`MMAP_THRESHOLD`, still get their own mapping). The cost is resident memory: after a
step the heap keeps what the steps' activations used, as a caching allocator does (PyTorch's on
CUDA), and some more: PyTorch's 64-byte aligned blocks leave a freed block a little short of the
next request until freed neighbours merge, so a loop allocating and freeing one 40 MB tensor grows
the heap 6-8 times before it reuses it (``tests/model/test_heap.py``). Measured: one engine
process after cold prefills of 1,000-2,000 tokens +60-70 MiB of RSS; ``ragcache serve`` at the end
of a 200-client cold burst +300-450 MiB, and the same RSS as before 5 s after it, since the server
gives the free pages back once the engine has been idle for a moment
(:class:`~ragcache_backend.server.heap.HeapTrimmer`). An embedded engine keeps them until the
process calls ``malloc_trim``. ``RAGCACHE_KEEP_HEAP=0`` in the environment
leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import threading

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_activation_pages", "libc"]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 256 << 20
"""Bytes from which a ``malloc`` gets its own mapping (``M_MMAP_THRESHOLD``) once kept."""
TRIM_THRESHOLD = 1 << 30
"""Bytes of free heap top beyond which glibc returns it to the OS (``M_TRIM_THRESHOLD``) once kept."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_lock = threading.Lock()
_kept: bool | None = None


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library, loaded once with ``errno`` kept for ``ctypes.get_errno`` (None where
    it cannot be loaded). Shared by the heap settings here, the server's heap trimmer and the
    arena's ``madvise`` calls."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def keep_activation_pages() -> bool:
    """Raise glibc's mmap and trim thresholds to :data:`MMAP_THRESHOLD` and :data:`TRIM_THRESHOLD`
    for this process (the first call does it; later calls return its result). Returns whether they
    are raised: False off Linux, with another C library, with ``RAGCACHE_KEEP_HEAP=0`` in the
    environment or where ``mallopt`` refuses (only speed changes). Never raises."""
    global _kept
    with _lock:
        if _kept is None:
            _kept = _raise_thresholds()
        return _kept


def _raise_thresholds() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("RAGCACHE_KEEP_HEAP", "1") == "0":
        return False
    lib = libc()
    try:
        mallopt = lib.mallopt
        lib.gnu_get_libc_version  # noqa: B018 - glibc only (musl has mallopt as a no-op stub)
    except AttributeError:  # no C library (None) or not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        log.info("C heap keeps freed activations between forward steps (mmap threshold %d MiB, trim threshold %d MiB; "
                 "RAGCACHE_KEEP_HEAP=0 to leave glibc's defaults)", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    else:
        log.debug("mallopt refused the thresholds: glibc's defaults stay")
    return ok
