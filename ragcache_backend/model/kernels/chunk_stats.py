"""The chunk-cache mode's per-layer measurements on the native kernels (``csrc/chunk_stats.c`` and
``csrc/kernels_f32.c``), via ctypes: attention statistics per context segment (Cache-Craft eq. 3-4,
and the quality guard's last-row masses) and the guard's K/V deviation of recomputed rows.

Both read the arena in place. Their torch forms
(:func:`~ragcache_backend.model.kernels.attention.segment_attention_mass`, and the deviation in
:mod:`ragcache_backend.model.chunk_rows`) stay as the reference and for other devices. Callers ask
``*_available`` first; where it is False (no library, another device or dtype, a CPU without the
instructions) they take the torch form.
"""

from __future__ import annotations

import torch

from ragcache_backend.model.kernels import library
from ragcache_backend.model.kernels.library import NativeKernelError

__all__ = ["kv_deviation", "kv_deviation_available", "segment_mass", "segment_mass_available"]


def _has(dtype: torch.dtype, name: str) -> bool:
    lib = library.load()
    return lib is not None and dtype in library.instruction_sets() and hasattr(lib, name)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise NativeKernelError(what)


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def segment_mass_available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`segment_mass` can run: queries and arena of one dtype on the CPU, and either
    bf16 with the bf16 kernels here (AVX512-BF16; an even head size up to 256) or float32 / bf16 with
    the float32 kernels here (AVX2; a head size that is a multiple of 16)."""
    if q.dtype != k_cache.dtype or not _on_cpu(q, k_cache) or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    d = q.shape[-1]
    if q.dtype == torch.bfloat16 and d % 2 == 0 and d <= 256 and _has(torch.bfloat16, "rc_segment_mass"):
        return True
    return d % 16 == 0 and _has(torch.float32, "rc32_segment_mass")


def segment_mass(q: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 segment_offsets: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax mass each query row gives each context segment (Cache-Craft eq. 3-4), with the keys
    read from the arena in place: what :func:`~ragcache_backend.model.kernels.attention.segment_attention_mass`
    computes (same definition, float32 rounding of another summation order), ~7x faster on a
    2-core AVX2 CPU for a 2,000-token prompt (8.9 against 60.8 ms; no gather, no ``[T, S]`` mask and
    no one-hot product). A bf16 arena's keys are multiplied as bf16 (each product exact in float32,
    sums in float32: the reference's definition, which converts to float32): read unpacked for up
    to 4 rows (the guard's one row per layer, VDPBF16PS), packed in panels of 16 keys for more rows,
    multiplied on AMX tiles of 16 query rows for 64-dim heads where AMX runs (``bf16_amx``; 0.37x the
    VDPBF16PS route's time for 1,800 rows over 2,100 keys), else on VDPBF16PS tiles of 8 rows; where
    only the float32 kernels run, a bf16 arena's context keys are gathered into float32 first.

    Args:
        q: ``[T, H, D]`` float32 or bf16 queries (RoPE applied), one query head per KV head (query
            head ``h`` reads KV head ``h``); rows and heads may be strided, each head's ``D`` values
            contiguous.
        k_cache: one layer of the arena, ``[slots, H, D]`` of q's dtype, contiguous.
        slots: ``[S]`` int64 arena slots of the context, in position order.
        positions: ``[T]`` int64 position of each row in the context (it attends to keys ``0 ..
            pos``), in ``[0, S)``.
        segment_offsets: ``[nseg + 1]`` int64 segment boundaries, ``0`` first, ``S`` last, strictly
            ascending (segment ``s`` is keys ``offsets[s] .. offsets[s + 1] - 1``).
        scale: softmax scale.

    Returns:
        ``[T, H, nseg]`` float32; each ``[t, h]`` row sums to 1.

    Raises:
        NativeKernelError: the kernel is unavailable, or shapes, dtypes, positions or offsets do
            not fit it (checked in C as well: never a crash).
    """
    t, h, d = q.shape
    nseg = segment_offsets.numel() - 1
    _check(segment_mass_available(q, k_cache) and q.stride(2) == 1 and k_cache.is_contiguous()
           and k_cache.dim() == 3 and k_cache.shape[1:] == (h, d) and slots.dtype == torch.int64 and slots.dim() == 1
           and positions.shape == (t,) and positions.dtype == torch.int64 and segment_offsets.dtype == torch.int64
           and nseg >= 1 and t >= 1 and slots.numel() >= 1,
           f"segment_mass: bad arguments q={tuple(q.shape)}/{q.dtype}/{q.stride()} kv={tuple(k_cache.shape)}/"
           f"{k_cache.dtype} slots={tuple(slots.shape)}/{slots.dtype} positions={tuple(positions.shape)}/{positions.dtype} "
           f"offsets={tuple(segment_offsets.shape)}/{segment_offsets.dtype}")
    slots, positions, offsets = (x.cpu().contiguous() for x in (slots, positions, segment_offsets))
    _check(int(slots.min()) >= 0 and int(slots.max()) < k_cache.shape[0], "segment_mass: slots outside the arena")
    lib = library.load()
    fn = lib.rc32_segment_mass
    if q.dtype == torch.bfloat16:
        if d % 2 == 0 and d <= 256 and _has(torch.bfloat16, "rc_segment_mass"):
            fn = lib.rc_segment_mass
        else:  # the float32 kernel over the context's keys, gathered and converted
            q, k_cache, slots = q.float(), k_cache.index_select(0, slots).float(), torch.arange(slots.numel())
    out = torch.empty((t, h, nseg), dtype=torch.float32)
    rc = fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), slots.data_ptr(), slots.numel(), positions.data_ptr(),
            t, h, d, offsets.data_ptr(), nseg, scale, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise NativeKernelError(f"segment_mass failed with code {rc} (1: positions or segment offsets out of range, 2: memory)")
    return out


def kv_deviation_available(k_cache: torch.Tensor) -> bool:
    """Whether :func:`kv_deviation` can run on this arena: float32 (the float32 kernels here) or bf16
    (the bf16 kernels here), on the CPU."""
    name = {torch.float32: "rc32_kv_deviation", torch.bfloat16: "rc_kv_deviation"}.get(k_cache.dtype)
    return name is not None and k_cache.device.type == "cpu" and _has(k_cache.dtype, name)


def kv_deviation(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, old_k: torch.Tensor,
                 old_v: torch.Tensor) -> torch.Tensor:
    """The quality guard's K/V deviation of rows just written: ``|new - old| / |old|`` per row, K
    and V of every KV head taken as one vector (0 where ``|old|`` is 0, the denominator at least
    1e-6), sums in float32: what the torch form in :mod:`ragcache_backend.model.chunk_rows` computes
    (float32 rounding of another summation order), in one pass without conversions or copies.

    Args:
        k_cache, v_cache: one layer of the arena, ``[slots, Hkv, D]`` float32 or bf16, contiguous,
            holding the new K/V.
        slots: ``[T]`` int64 slots the rows were written to.
        old_k, old_v: ``[T, Hkv, D]`` the slots' contents before the write, the arena's dtype
            (``k_cache.index_select(0, slots)`` taken before it).

    Returns:
        ``[T]`` float32.

    Raises:
        NativeKernelError: the kernel is unavailable here, or shapes, dtypes or slots do not fit.
    """
    t = slots.numel()
    row_shape = tuple(k_cache.shape[1:])
    _check(kv_deviation_available(k_cache) and k_cache.is_contiguous() and v_cache.is_contiguous()
           and v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype and slots.dtype == torch.int64
           and k_cache.dim() == 3 and slots.dim() == 1 and all(x.shape == (t, *row_shape) and x.dtype == k_cache.dtype for x in (old_k, old_v)),
           f"kv_deviation: bad arguments kv={tuple(k_cache.shape)}/{k_cache.dtype} slots={tuple(slots.shape)}/{slots.dtype} "
           f"old={tuple(old_k.shape)}/{old_k.dtype}")
    slots, old_k, old_v = slots.cpu().contiguous(), old_k.contiguous(), old_v.contiguous()
    _check(t == 0 or (int(slots.min()) >= 0 and int(slots.max()) < k_cache.shape[0]), "kv_deviation: slots outside the arena")
    out = torch.empty(t, dtype=torch.float32)
    lib = library.load()
    fn = lib.rc_kv_deviation if k_cache.dtype == torch.bfloat16 else lib.rc32_kv_deviation
    row = k_cache.shape[1] * k_cache.shape[2]
    rc = fn(k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), t, row, old_k.data_ptr(), old_v.data_ptr(),
            out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise NativeKernelError(f"kv_deviation failed with code {rc} (arguments out of range)")
    return out
