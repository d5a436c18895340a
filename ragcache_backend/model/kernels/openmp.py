"""Keeping the engine thread's OpenMP regions fast when other threads also run torch.

libgomp (the OpenMP runtime torch's CPU build ships, which our native kernels share) gives every
thread that starts a parallel region its own pool of worker threads. While the threads it manages
outnumber the CPUs, its workers stop spinning between regions (100 spins instead of about 3 ms:
libgomp's ``gomp_throttled_spin_count_var``), so every region then waits for a worker to wake. The
engine runs its forward steps on its own thread; once the thread that built it (loading the model)
or that embeds queries for retrieval keeps a pool too, a 2-core machine is in that state, and a
bf16 decode step run per operation (~270 regions: oneDNN GEMMs and the row-wise kernels of every
layer) took 2.0x as long, a float32 whole-step one (one region, ``rc32_decode_step``) 1.2x
(``benchmarks/omp_thread_penalty.py``, 2-core AMD EPYC Zen 5, 2026-11-27). One region is no cure:
its barriers (~9 a layer) wait the same way, and the bf16 whole-step decode (``rc_decode_step``,
5.2 ms) took 2.25x as long there.

:func:`release_thread_pool` frees the calling thread's pool (OpenMP 5.0's ``omp_pause_resource_all``):
the engine calls it on the thread that built it, and the retrieval embedder after embedding on the
caller's thread (in every libgomp of the process: faiss-cpu ships its own, and a lookup by name found
that one first in the demo, where it did nothing for torch's), so only the engine thread keeps workers between requests. The next parallel region
on that thread makes its pool again (tens of microseconds). Torch work a user runs on another
thread between requests brings the slowdown back until it is released too.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

log = logging.getLogger(__name__)
_OMP_PAUSE_SOFT = 1
_pauses: dict[str, object] = {}  # libgomp path -> its omp_pause_resource_all
_scan_lock = threading.Lock()
_scanned: tuple[int, list[str]] = (-1, [])  # (len(sys.modules) at the last scan, the libgomps it found)


def _loaded_libgomps() -> list[str]:
    """The libgomp runtimes mapped into this process: torch's (wheels may name it
    ``libgomp-<hash>.so.1``) and others' (faiss-cpu ships its own). Opening a path again returns that
    same runtime, never a second one. Empty without ``/proc`` or where none is loaded.

    ``/proc/self/maps`` is read again only once a module was imported since the last read (a new
    runtime comes with an extension module): reading it takes ~0.5 ms, and every submit asks."""
    global _scanned
    with _scan_lock:
        if _scanned[0] == len(sys.modules):
            return _scanned[1]
        try:
            with open("/proc/self/maps") as maps:
                found = sorted({line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]})
        except OSError:
            found = []
        _scanned = (len(sys.modules), found)
        return found


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads in every libgomp runtime of the process (see
    the module docstring). Call it outside any parallel region (never from inside a torch op).
    Returns whether one did (False: no libgomp, or none accepted)."""
    import torch  # noqa: F401  (its libgomp is among those to reach)

    done = False
    for path in _loaded_libgomps():
        if path not in _pauses:
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all
                fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
            except (OSError, AttributeError) as exc:
                log.debug("%s: no omp_pause_resource_all (%s)", path, exc)
                fn = None
            _pauses[path] = fn
        fn = _pauses[path]
        done = (fn is not None and fn(_OMP_PAUSE_SOFT) == 0) or done
    return done
