"""Building and loading the native kernels' library (``csrc/``) with the system C compiler.

The C sources are compiled on first use into ``$RAGCACHE_HOME/kernels/`` (named by a hash of the
sources, headers and flags, written atomically) and loaded into the process after torch, so that
their OpenMP regions run on torch's own libgomp thread pool. :func:`load` gives the package's own
library (or None, and :func:`why_not` says why: no compiler, a failed build, a CPU with neither
instruction set, ``RAGCACHE_NATIVE_KERNELS=0``; one warning); :func:`build_library` and
:func:`using_library` compile another version of the files and run the kernels from it in a block
(``benchmarks/kernel_ab.py``). The calls into the library are :mod:`native`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ragcache_backend.config import ragcache_home

log = logging.getLogger(__name__)

#: the kernels' C files, compiled together into one library on first use
SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_attention_bf16.c", "fused_bf16.c", "decode_bf16.c", "linear_amx.c", "kernels_f32.c",
                             "rerotate.c", "chunk_stats.c"))
#: sources an older revision's ``csrc/`` lacks (added since kernel A/B runs began): a library built from
#: such a folder (:func:`build_library`) is without their kernels, and the callers check for them
NEWER_SOURCES = frozenset({"linear_amx.c", "rerotate.c", "chunk_stats.c"})
#: headers the sources include (part of the library's build hash)
HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("simd_exp.h", "bf16_common.h"))
#: C compiler flags the kernels are built with (benchmarks/prompt_attention.py builds other revisions' kernels alike)
BUILD_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu11")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""  # why the library is missing (empty when it loaded)
_KERNEL_DTYPES: dict[torch.dtype, str] = {}  # dtypes this CPU runs natively -> the instruction set used


class NativeKernelError(RuntimeError):
    """The native kernel rejected its arguments or could not allocate its scratch, or
    :func:`build_library` could not build a library from another folder."""


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(folder: Path | None = None) -> tuple[ctypes.CDLL | None, str]:
    """The library compiled from :data:`SOURCES` (or the files of those names in ``folder``, where
    those of :data:`NEWER_SOURCES` may be missing), or None and why not (not logged here:
    :func:`load` warns for the package's own library, :func:`build_library` raises).

    Raises:
        OSError: ``folder`` lacks a source other than :data:`NEWER_SOURCES`, or a header.
    """
    sources, headers = SOURCES, HEADERS
    if folder is not None:
        sources = tuple(folder / p.name for p in SOURCES if p.name not in NEWER_SOURCES or (folder / p.name).exists())
        headers = tuple(folder / p.name for p in HEADERS)
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    src = b"".join(path.read_bytes() for path in (*sources, *headers))
    tag = hashlib.sha256(src + " ".join((cc, *BUILD_FLAGS)).encode()).hexdigest()[:16]
    out_dir = ragcache_home() / "kernels"
    lib_path = out_dir / f"ragcache_kernels-{tag}.so"
    if not lib_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            subprocess.run([cc, *BUILD_FLAGS, "-o", tmp, *map(str, sources)], check=True, capture_output=True, text=True, timeout=180)
            os.replace(tmp, lib_path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            Path(tmp).unlink(missing_ok=True)
            return None, f"the build with {cc} failed: {detail.strip()[:300]}"
    lib = ctypes.CDLL(str(lib_path))
    i64, ptr, f32, nt = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    for prefix in ("rc", "rc32"):
        getattr(lib, f"{prefix}_supported").restype = ctypes.c_int
        attn = getattr(lib, f"{prefix}_paged_attention")
        attn.restype = ctypes.c_int
        # explicit row positions (or NULL) after ``decode``: the float32 kernel, and the bf16 one
        # since rc_takes_positions (not in an older revision's csrc/, which kernel_ab.py builds)
        qpos = (ptr,) if prefix == "rc32" or hasattr(lib, "rc_takes_positions") else ()
        attn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, *qpos, i64, i64, i64, i64, f32, ptr, nt]
        rope = getattr(lib, f"{prefix}_rope_write")
        rope.restype = None
        rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, nt]
        norm = getattr(lib, f"{prefix}_add_rms_norm")
        norm.restype = None
        norm.argtypes = [ptr, ptr, ptr, f32, i64, i64, ptr, nt]
        silu = getattr(lib, f"{prefix}_silu_mul")
        silu.restype = None
        silu.argtypes = [ptr, i64, i64, ptr, nt]
    lib.rc32_linear_rows.restype = None
    lib.rc32_linear_rows.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, nt]
    lib.rc_linear_rows.restype = ctypes.c_int
    lib.rc_linear_rows.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, nt]
    if hasattr(lib, "rc_amx_pack"):  # not in an older revision's csrc/ (kernel_ab.py builds those)
        lib.rc_amx_pack.restype = None
        lib.rc_amx_pack.argtypes = [ptr, i64, i64, ptr]
    # our AMX GEMM's entry points (x, x_row, packed W, bias, M, N or I, K, y, threads), each missing
    # from the revisions before it
    for name in ("rc_amx_linear", "rc_amx_linear_rows", "rc_amx_linear_silu"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, nt]
    if hasattr(lib, "rc_rerotate_copy"):  # since 2026-11-28 (kernel_ab.py builds older revisions)
        lib.rc_rerotate_copy.restype = ctypes.c_int
        lib.rc_rerotate_copy.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, nt, nt, nt]
    # the chunk mode's measurements (chunk_stats.c since 2026-11-28: not in an older revision's csrc/)
    for name in ("rc32_segment_mass", "rc_segment_mass"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, i64, ptr, i64, f32, ptr, nt]
    for name in ("rc32_kv_deviation", "rc_kv_deviation"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, nt]
    for name in ("rc32_wide", "rc_amx"):  # rc_amx: not in an older revision's csrc/ (kernel_ab.py builds those)
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [nt]
    for step in (lib.rc32_decode_step, lib.rc_decode_step):
        step.restype = ctypes.c_int
        # the bf16 step's layers' AMX weights (or NULL) last, since rc_decode_takes_tiles (not in an
        # older revision's csrc/, which kernel_ab.py builds)
        tiles = (ptr,) if step is lib.rc_decode_step and hasattr(lib, "rc_decode_takes_tiles") else ()
        step.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, f32, nt, *tiles]
    if lib.rc_supported():
        _KERNEL_DTYPES[torch.bfloat16] = "AVX512-BF16"
    if lib.rc32_supported():
        _KERNEL_DTYPES[torch.float32] = "AVX2+FMA"
    if not _KERNEL_DTYPES:
        return None, "this CPU has neither AVX2+FMA (float32 kernels) nor AVX512-BF16 (bf16 kernels)"
    return lib, ""


def load() -> ctypes.CDLL | None:
    """The package's kernel library, built and loaded on the first call (thread-safe), or None
    (:func:`why_not` says why; logged once as a warning)."""
    global _lib, _tried, _why_not
    if not _tried:
        with _lock:
            if not _tried:
                if os.environ.get("RAGCACHE_NATIVE_KERNELS", "1") != "0":
                    _lib, _why_not = _build()
                    if _lib is None:  # one warning (the caller of build_library gets the error instead)
                        log.warning("native kernels: %s; using the torch path", _why_not)
                    elif os.environ.get("RAGCACHE_AMX", "1") == "0":  # bf16 prompt attention on AVX512-BF16 (native.bf16_amx)
                        _lib.rc_amx(0)
                else:
                    _why_not = "RAGCACHE_NATIVE_KERNELS=0"
                _tried = True
    return _lib


def build_library(folder: Path) -> ctypes.CDLL:
    """Compile the kernel library from the C files of :data:`SOURCES`' and :data:`HEADERS`' names in
    ``folder`` (an edited copy of ``csrc/``, or another revision's, which may lack
    :data:`NEWER_SOURCES`: their kernels are then missing from it), cached like the package's own;
    with :func:`using_library`, two kernel versions compare in one process
    (``benchmarks/kernel_ab.py``).

    Raises:
        NativeKernelError: no C compiler, the build failed, or the CPU runs neither dtype's kernels.
        OSError: a file other than :data:`NEWER_SOURCES` is missing from ``folder``.
    """
    lib, why = _build(Path(folder))
    if lib is None:
        raise NativeKernelError(f"native kernels from {folder}: {why}")
    return lib


@contextlib.contextmanager
def using_library(lib: ctypes.CDLL) -> Iterator[None]:
    """Within the block, every kernel of :mod:`native` runs from ``lib`` (from :func:`build_library`)
    instead of the package's library; a benchmark's tool, not for concurrent use with other threads
    running kernels."""
    global _lib
    load()  # the package's library settles first: the block's end restores it
    with _lock:
        before, _lib = _lib, lib
    try:
        yield
    finally:
        with _lock:
            _lib = before


def why_not() -> str:
    """Why :func:`load` gave None (empty when the library loaded or was not tried yet)."""
    return _why_not


def instruction_sets() -> dict[torch.dtype, str]:
    """The dtypes this CPU runs natively -> the instruction set their kernels use (after :func:`load`)."""
    return _KERNEL_DTYPES
