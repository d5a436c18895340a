"""Native CPU kernels for bf16 on AVX512-BF16 (attention over paged KV, fused layer steps), via ctypes.

The C sources (``csrc/paged_attention_bf16.c``, ``csrc/fused_bf16.c``) are compiled on first use with the system C
compiler into ``$RAGCACHE_HOME/kernels/`` (named by a hash of the source and flags, written
atomically), then loaded into the process after torch, so that its OpenMP regions run on torch's
own libgomp thread pool. Where it cannot be used (no compiler, no AVX512-BF16, not bf16, not CPU,
``RAGCACHE_NATIVE_KERNELS=0``) :func:`available` is False and callers take the torch reference
path (:mod:`ragcache_backend.model.kernels.attention`), which stays for tests and other devices.

Why: on CPUs without AMX, PyTorch's flash kernel reaches ~100 GFLOP/s in bf16 (its bf16 GEMMs run
through MKL), while VDPBF16PS reaches several times that; and the flash kernel picks its query
blocking by query length, so a cached prompt and an uncached one round differently. This kernel
fixes its key blocks at absolute positions and computes each row alone (see the C file), so
prompt logits and KV are bit-identical with and without the cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ragcache_backend.config import ragcache_home

log = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("paged_attention_bf16.c", "fused_bf16.c"))
_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu11")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


class NativeKernelError(RuntimeError):
    """The native kernel rejected its arguments or could not allocate its scratch."""


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        log.info("native attention kernel: no C compiler found; using the torch path")
        return None
    src = b"".join(path.read_bytes() for path in _SOURCES)
    tag = hashlib.sha256(src + " ".join((cc, *_FLAGS)).encode()).hexdigest()[:16]
    out_dir = ragcache_home() / "kernels"
    lib_path = out_dir / f"paged_attention_bf16-{tag}.so"
    if not lib_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            subprocess.run([cc, *_FLAGS, "-o", tmp, *map(str, _SOURCES)], check=True, capture_output=True, text=True, timeout=120)
            os.replace(tmp, lib_path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            log.warning("native attention kernel: build failed, using the torch path: %s", detail.strip()[:500])
            Path(tmp).unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(lib_path))
    lib.rc_supported.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rc_paged_attention.restype = ctypes.c_int
    lib.rc_paged_attention.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, ptr,
                                       ctypes.c_int]
    lib.rc_rope_write.restype = None
    lib.rc_rope_write.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.rc_add_rms_norm.restype = None
    lib.rc_add_rms_norm.argtypes = [ptr, ptr, ptr, ctypes.c_float, i64, i64, ptr, ctypes.c_int]
    lib.rc_silu_mul.restype = None
    lib.rc_silu_mul.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    if not lib.rc_supported():
        log.info("native attention kernel: this CPU lacks AVX512-BF16; using the torch path")
        return None
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                if os.environ.get("RAGCACHE_NATIVE_KERNELS", "1") != "0":
                    _lib = _build()
                _tried = True
    return _lib


def available(dtype: torch.dtype, device: torch.device | str, head_dim: int, group: int = 1) -> bool:
    """Whether :func:`paged_attention` can run for this dtype, device, head size and GQA group
    (query heads per KV head): bf16 on a CPU with AVX512-BF16, head size a multiple of 64 up to
    256, group at most 8, kernel built."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and head_dim % 64 == 0
            and head_dim <= 256 and 1 <= group <= 8 and _library() is not None)


@dataclass(slots=True, frozen=True)
class AttentionBatch:
    """The sequences of one forward step as the native attention kernel reads them (built once per
    step, used by every layer).

    Attributes:
        slots: ``[sum S_b]`` int64 arena slots of every sequence's context, concatenated.
        ctx_off: ``[B + 1]`` int64 offsets of each context in ``slots``.
        q_off: ``[B + 1]`` int64 offsets of each sequence's new rows in the step (``T_b`` rows at the
            end of its context).
        decode: ``[B]`` uint8, 1 where the one new token is a generated token (decode kernel).
    """

    slots: torch.Tensor
    ctx_off: torch.Tensor
    q_off: torch.Tensor
    decode: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.q_off[-1])


def attention_batch(contexts: list[torch.Tensor], num_new: list[int], decode: list[bool]) -> AttentionBatch:
    """Pack per-sequence contexts (``[S_b]`` int64 slots, new tokens last) into an :class:`AttentionBatch`.

    Raises:
        NativeKernelError: lengths disagree, a sequence has no new token, more new tokens than
            context, or a decode sequence with more than one new token.
    """
    if not (len(contexts) == len(num_new) == len(decode)) or not contexts:
        raise NativeKernelError("attention_batch: one context, count and flag per sequence, at least one")
    for ctx, t, dec in zip(contexts, num_new, decode):
        if t < 1 or ctx.numel() < t or (dec and t != 1) or ctx.dtype != torch.int64:
            raise NativeKernelError(f"attention_batch: bad sequence (context {ctx.numel()} {ctx.dtype}, new {t}, decode {dec})")
    ctx_off = torch.tensor([0, *(int(c.numel()) for c in contexts)], dtype=torch.int64).cumsum(0)
    q_off = torch.tensor([0, *num_new], dtype=torch.int64).cumsum(0)
    return AttentionBatch(torch.cat(contexts).cpu().contiguous(), ctx_off, q_off, torch.tensor(decode, dtype=torch.uint8))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every sequence's new rows over its context, read straight from the arena.

    Prompt rows take a tiled kernel over keys packed per call (fixed 64-key blocks from position
    0); generated tokens take an unpacked decode kernel. Either way each row is computed alone, so
    a prompt row is bit-identical whatever else runs in the call and however much of its prefix
    came from the cache.

    Args:
        q: ``[N, Hq, D]`` bf16 queries (RoPE applied), ``N = batch.num_rows``; rows may be strided
            (a view of the fused QKV output) but each head's ``D`` values contiguous.
        k_cache, v_cache: one layer of the arena, ``[slots, Hkv, D]`` bf16, contiguous; the new
            tokens' K/V already written. Slots in ``batch`` must lie inside it.
        batch: the step's sequences (:func:`attention_batch`).
        scale: softmax scale.
        out: optional contiguous ``[N, Hq, D]`` bf16 tensor to write into.

    Returns:
        ``out`` or a new ``[N, Hq, D]`` bf16 tensor.

    Raises:
        NativeKernelError: the kernel is not available, or shapes/dtypes do not fit it.
    """
    lib = _library()
    n, hq, d = q.shape
    if lib is None:
        raise NativeKernelError("native attention kernel is not available")
    if (q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16
            or q.stride(2) != 1 or q.stride(1) != d or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or k_cache.shape != v_cache.shape or k_cache.shape[2] != d or n != batch.num_rows
            or hq % k_cache.shape[1] != 0 or hq // k_cache.shape[1] > 8):
        raise NativeKernelError(f"paged_attention: bad arguments q={tuple(q.shape)}/{q.dtype}/{q.stride()}, "
                                f"kv={tuple(k_cache.shape)}/{k_cache.dtype}, rows={batch.num_rows}")
    if out is None:
        out = torch.empty((n, hq, d), dtype=torch.bfloat16)
    elif out.shape != q.shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise NativeKernelError(f"paged_attention: bad out {tuple(out.shape)}/{out.dtype}")
    rc = lib.rc_paged_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), batch.slots.data_ptr(),
                                batch.ctx_off.data_ptr(), batch.q_off.data_ptr(), batch.decode.data_ptr(),
                                len(batch.decode), hq, k_cache.shape[1], d, scale, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise NativeKernelError(f"paged_attention failed with code {rc} (1: arguments, 2: memory)")
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            num_cached: int, scale: float, *, decode: bool = False) -> torch.Tensor:
    """:func:`paged_attention` for one sequence: ``T`` new queries at positions
    ``num_cached .. num_cached+T-1`` over ``slots`` (``[num_cached + T]`` int64 arena slots).
    ``decode``: the one new token is a generated one (the decode kernel).

    Raises:
        NativeKernelError: as :func:`paged_attention`, or ``slots`` does not hold ``num_cached + T``.
    """
    if slots.numel() != num_cached + q.shape[0]:
        raise NativeKernelError(f"paged_prefill_attention: {slots.numel()} slots for {num_cached} cached + {q.shape[0]} new")
    return paged_attention(q, k_cache, v_cache, attention_batch([slots], [q.shape[0]], [decode]), scale)


def fused_available(dtype: torch.dtype, device: torch.device | str, *, hidden: int, intermediate: int, head_dim: int,
                    group: int = 1) -> bool:
    """Whether :func:`rope_write`, :func:`add_rms_norm` and :func:`silu_mul` can run for this
    model (bf16 on an AVX512-BF16 CPU, hidden and intermediate sizes multiples of 16, head size a
    multiple of 64, attention kernel available too)."""
    return available(dtype, device, head_dim, group) and hidden % 16 == 0 and intermediate % 16 == 0


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise NativeKernelError(what)


def rope_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """RoPE on the query and key heads of ``qkv`` in place, then the keys and values written to the arena.

    Args:
        qkv: ``[N, Hq + 2 Hkv, D]`` bf16, contiguous (the fused QKV GEMM's output).
        cos, sin: ``[N, D]`` float32 tables (:func:`~ragcache_backend.model.kernels.rope.rope_cos_sin`).
        k_cache, v_cache: one layer of the arena, ``[slots, Hkv, D]`` bf16, contiguous.
        slots: ``[N]`` int64 arena slot of each row.

    Raises:
        NativeKernelError: the kernel is unavailable or the arguments do not fit it.
    """
    lib = _library()
    n, heads, d = qkv.shape
    _check(lib is not None and qkv.dtype == torch.bfloat16 and qkv.is_contiguous() and heads == num_heads + 2 * num_kv_heads
           and cos.shape == (n, d) and sin.shape == (n, d) and cos.dtype == torch.float32 and sin.dtype == torch.float32
           and cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
           and k_cache.shape[1:] == (num_kv_heads, d) and v_cache.shape == k_cache.shape and slots.dtype == torch.int64
           and slots.numel() == n and slots.is_contiguous(), f"rope_write: bad arguments qkv={tuple(qkv.shape)} cos={tuple(cos.shape)}")
    lib.rc_rope_write(qkv.data_ptr(), n, num_heads, num_kv_heads, d, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                      v_cache.data_ptr(), slots.data_ptr(), torch.get_num_threads())


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (when given), then RMSNorm of ``h`` (HF LlamaRMSNorm's roundings).

    Args:
        h: ``[N, H]`` bf16 residual stream, contiguous; delta: ``[N, H]`` bf16 or None;
        weight: ``[H]`` bf16; eps: variance epsilon.

    Returns:
        ``[N, H]`` bf16 normalised rows.

    Raises:
        NativeKernelError: the kernel is unavailable or the arguments do not fit it.
    """
    lib = _library()
    n, hidden = h.shape
    _check(lib is not None and h.dtype == torch.bfloat16 and h.is_contiguous() and weight.shape == (hidden,)
           and weight.dtype == torch.bfloat16 and weight.is_contiguous()
           and (delta is None or (delta.shape == h.shape and delta.dtype == torch.bfloat16 and delta.is_contiguous())),
           f"add_rms_norm: bad arguments h={tuple(h.shape)}")
    out = torch.empty_like(h)
    lib.rc_add_rms_norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps, n, hidden,
                        out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[N, 2I]`` bf16 (``[gate | up]`` per row) -> ``[N, I]`` bf16.

    Raises:
        NativeKernelError: the kernel is unavailable or the arguments do not fit it.
    """
    lib = _library()
    n, two_i = gate_up.shape
    _check(lib is not None and gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and two_i % 32 == 0,
           f"silu_mul: bad arguments {tuple(gate_up.shape)}")
    out = torch.empty((n, two_i // 2), dtype=torch.bfloat16)
    lib.rc_silu_mul(gate_up.data_ptr(), n, two_i // 2, out.data_ptr(), torch.get_num_threads())
    return out
