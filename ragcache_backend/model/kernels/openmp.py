"""Keeping the engine thread's OpenMP regions fast when other threads also run torch.

libgomp (the OpenMP runtime torch's CPU build ships, which our native kernels share) gives every
thread that starts a parallel region its own pool of worker threads. While the threads it manages
outnumber the CPUs, its workers stop spinning between regions (100 spins instead of about 3 ms:
libgomp's ``gomp_throttled_spin_count_var``), so every region then waits for a worker to wake. The
engine runs its forward steps on its own thread; once the thread that built it (loading the model)
or that embeds queries for retrieval keeps a pool too, a 2-core machine is in that state, and a
bf16 decode step (~270 regions: oneDNN GEMMs and the row-wise kernels of every layer) took 2.0x as
long, a float32 one (one region, ``rc32_decode_step``) 1.2x (``benchmarks/omp_thread_penalty.py``,
2-core AMD EPYC Zen 5, 2026-11-27).

:func:`release_thread_pool` frees the calling thread's pool (OpenMP 5.0's ``omp_pause_resource_all``):
the engine calls it on the thread that built it, and the retrieval embedder after embedding on the
caller's thread, so only the engine thread keeps workers between requests. The next parallel region
on that thread makes its pool again (tens of microseconds). Torch work a user runs on another
thread between requests brings the slowdown back until it is released too.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)
_OMP_PAUSE_SOFT = 1
_pause = None
_looked = False


def _loaded_libgomp() -> str:
    """The path of the libgomp already mapped into this process (torch's; wheels may name it
    ``libgomp-<hash>.so.1``): opening it again returns that same runtime, never a second one.
    Raises StopIteration when none is mapped (another OpenMP runtime), OSError without ``/proc``."""
    with open("/proc/self/maps") as maps:
        return next(line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1])


def _pause_fn():
    """libgomp's ``omp_pause_resource_all`` as already loaded by torch, or None (another OpenMP
    runtime, or none)."""
    global _pause, _looked
    if not _looked:
        _looked = True
        import torch  # noqa: F401  (its libgomp is the one to reach)

        try:
            fn = ctypes.CDLL(_loaded_libgomp()).omp_pause_resource_all
        except (OSError, AttributeError, StopIteration) as exc:
            log.debug("no libgomp omp_pause_resource_all (%s): OpenMP pools are left as they are", exc)
            return None
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
        _pause = fn
    return _pause


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (see the module docstring). Call it outside
    any parallel region (never from inside a torch op). Returns whether the runtime did so (False:
    not libgomp, or it refused)."""
    fn = _pause_fn()
    return fn is not None and fn(_OMP_PAUSE_SOFT) == 0
