"""Native CPU kernels (attention over paged KV, fused layer steps), via ctypes, for two dtypes:

* **bf16** on CPUs with AVX512-BF16 (``csrc/paged_attention_bf16.c``, ``csrc/fused_bf16.c``,
  ``csrc/decode_bf16.c``);
* **float32** on every x86-64 CPU with AVX2 and FMA, AVX-512 ones included (``csrc/kernels_f32.c``;
  where the CPU has AVX-512F the attention's inner loops use 512-bit registers, same bits).

The library is built and loaded by :mod:`ragcache_backend.model.kernels.library` (on first use, with
the system C compiler; its :data:`SOURCES`, :func:`build_library` and :func:`using_library` are
importable from here too); this module checks arguments and calls its functions. Where a kernel cannot
be used (no compiler, the CPU lacks the instructions, another dtype, not CPU,
``RAGCACHE_NATIVE_KERNELS=0``) :func:`available` is False, :func:`unavailable_reason` says why, and
callers take the torch reference path (:mod:`ragcache_backend.model.kernels.attention`), which
stays for tests and other devices.

Why: PyTorch's CPU attention gathers every sequence's context per layer and runs one small kernel
per sequence, and a decode step of a small model is mostly the dispatch of small row-wise ops.
These kernels read the arena in place for a whole step, one call per layer. In bf16 they also keep
cached and uncached prompts bit-identical: keys are blocked at absolute positions and each row is
computed alone (see the C files); the float32 prompt kernel keeps the same row independence.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ragcache_backend.model.kernels import library
from ragcache_backend.model.kernels.amx_gemm import (AMX_FEW_ROWS, AMXWeight, amx_linear, amx_linear_available,  # noqa: F401 (public here too)
                                                     amx_linear_silu, amx_pack, bf16_amx)
from ragcache_backend.model.kernels.chunk_stats import segment_mass, segment_mass_available  # noqa: F401 (public here too)
from ragcache_backend.model.kernels.library import (BUILD_FLAGS, HEADERS, SOURCES, NativeKernelError,  # noqa: F401 (public here too)
                                                     build_library, using_library)


def float32_wide(enable: bool | None = None) -> bool:
    """Whether the float32 attention runs its inner loops on 512-bit registers (by default on
    CPUs with AVX-512F; ``csrc/kernels_f32.c``, ``rc32_wide``). Every lane does the same FMAs in the
    same order at either width, so the outputs are the same bits; ``enable`` sets it for this
    process (True only takes effect where the CPU has AVX-512F), None only asks.

    Raises:
        RuntimeError: the native library is not available (:func:`unavailable_reason` says why).
    """
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {library.why_not()}")
    return bool(lib.rc32_wide(-1 if enable is None else int(enable)))


_PREFIX = {torch.bfloat16: "rc", torch.float32: "rc32"}
_HEAD_MULTIPLE = {torch.bfloat16: 64, torch.float32: 16}  # head sizes each kernel tiles
_ROW_MULTIPLE = {torch.bfloat16: 16, torch.float32: 8}  # hidden / intermediate sizes of the fused steps


def unavailable_reason(dtype: torch.dtype, device: torch.device | str, head_dim: int, group: int = 1) -> str | None:
    """Why :func:`paged_attention` cannot run for this dtype, device, head size and GQA group
    (query heads per KV head), or None when it can.

    It can for bf16 on a CPU with AVX512-BF16 (head size a multiple of 64, group <= 8) and for
    float32 on a CPU with AVX2 and FMA (head size a multiple of 16, group <= 16); head size <= 256.
    """
    if torch.device(device).type != "cpu":
        return f"the native kernels are for the CPU, the model is on {torch.device(device).type}"
    if dtype not in _PREFIX:
        return f"no native kernel for {dtype} (float32 and bfloat16 only)"
    if library.load() is None:
        return library.why_not()
    if dtype not in library.instruction_sets():
        need = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX2 and FMA"
        return f"this CPU lacks {need} for {dtype} kernels"
    most_group = 8 if dtype == torch.bfloat16 else 16
    if head_dim % _HEAD_MULTIPLE[dtype] or head_dim > 256 or not 1 <= group <= most_group:
        return (f"head size {head_dim} / group {group} do not fit the {dtype} kernel (head size a multiple of "
                f"{_HEAD_MULTIPLE[dtype]} up to 256, group 1..{most_group})")
    return None


def instruction_set(dtype: torch.dtype) -> str | None:
    """The instruction set the native kernels use for ``dtype`` on this CPU (e.g. ``"AVX2+FMA"``), or None."""
    lib, sets = library.load(), library.instruction_sets()
    if lib is None or dtype not in sets:
        return None
    if dtype == torch.float32 and lib.rc32_wide(-1):
        return f"{sets[dtype]}, attention loops on AVX-512F"
    if dtype == torch.bfloat16 and bf16_amx():
        return f"{sets[dtype]}, prompt attention and layer GEMMs on AMX"
    return sets[dtype]


def available(dtype: torch.dtype, device: torch.device | str, head_dim: int, group: int = 1) -> bool:
    """Whether :func:`paged_attention` can run for this dtype, device, head size and GQA group
    (:func:`unavailable_reason` is None)."""
    return unavailable_reason(dtype, device, head_dim, group) is None


def takes_positions(dtype: torch.dtype) -> bool:
    """Whether ``dtype``'s attention kernel takes rows at explicit positions inside their context
    (:attr:`AttentionBatch.q_pos`): the float32 and the bf16 kernels both do (the bf16 one since
    2026-11-28); a row at an explicit position gets the bits of the row at that position of an
    ordinary prompt over the same keys. An older revision's bf16 library (``benchmarks/kernel_ab.py``)
    does not: False while it runs (:func:`~ragcache_backend.model.kernels.library.using_library`)."""
    if dtype == torch.float32:
        return True
    lib = library.load() if dtype == torch.bfloat16 else None
    return lib is not None and hasattr(lib, "rc_takes_positions")


@dataclass(slots=True, frozen=True)
class AttentionBatch:
    """The sequences of one forward step as the native attention kernel reads them (built once per
    step, used by every layer).

    Attributes:
        slots: ``[sum S_b]`` int64 arena slots of every sequence's context, concatenated.
        ctx_off: ``[B + 1]`` int64 offsets of each context in ``slots``.
        q_off: ``[B + 1]`` int64 offsets of each sequence's new rows in the step (``T_b`` rows at the
            end of its context, unless ``q_pos`` places them).
        decode: ``[B]`` uint8, 1 where the one new token runs on the decode kernel (a generated token,
            or a prompt's one new token over a cached context the runner treats as one).
        q_pos: None (every sequence's rows are the last ``T_b`` positions of its context), or ``[N]``
            int64 position of every row in its context (strictly ascending within a sequence, ``<
            S_b``; row ``r`` attends to context positions ``0 .. q_pos[r]``; :func:`takes_positions`).
    """

    slots: torch.Tensor
    ctx_off: torch.Tensor
    q_off: torch.Tensor
    decode: torch.Tensor
    q_pos: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.q_off[-1])


def attention_batch(contexts: list[torch.Tensor], num_new: list[int], decode: list[bool],
                    positions: list[torch.Tensor | None] | None = None) -> AttentionBatch:
    """Pack per-sequence contexts (``[S_b]`` int64 slots in position order) into an :class:`AttentionBatch`.

    Args:
        contexts: per sequence, its context's slots (new tokens last, unless ``positions`` places them).
        num_new: per sequence, its new rows ``T_b``.
        decode: per sequence, whether its one new token runs on the decode kernel (see :class:`AttentionBatch`).
        positions: None, or per sequence None (its rows are the last ``T_b`` positions) or ``[T_b]``
            int64 positions of its rows inside its context (chunk-cache recomputation; prompt
            sequences only, strictly ascending, in ``[0, S_b)``). Where one is given the batch
            carries :attr:`AttentionBatch.q_pos`.

    Raises:
        NativeKernelError: lengths disagree, a sequence has no new token, more new tokens than
            context, a decode sequence with more than one new token, or positions that are not
            ``T_b`` strictly ascending ints in ``[0, S_b)`` (or given for a decode sequence).
    """
    if not (len(contexts) == len(num_new) == len(decode)) or not contexts:
        raise NativeKernelError("attention_batch: one context, count and flag per sequence, at least one")
    positions = positions if positions is not None else [None] * len(contexts)
    if len(positions) != len(contexts):
        raise NativeKernelError("attention_batch: one positions entry (or None) per sequence")
    for ctx, t, dec, pos in zip(contexts, num_new, decode, positions):
        if t < 1 or ctx.numel() < t or (dec and t != 1) or ctx.dtype != torch.int64:
            raise NativeKernelError(f"attention_batch: bad sequence (context {ctx.numel()} {ctx.dtype}, new {t}, decode {dec})")
        if pos is not None and (dec or pos.dtype != torch.int64 or pos.shape != (t,) or int(pos.min()) < 0
                                or int(pos.max()) >= ctx.numel() or bool((pos.diff() <= 0).any())):
            raise NativeKernelError(f"attention_batch: positions must be {t} strictly ascending int64 in [0, {ctx.numel()}) "
                                    f"of a prompt sequence, got {pos.tolist() if pos.numel() <= 8 else tuple(pos.shape)} "
                                    f"{pos.dtype} (decode {dec})")
    ctx_off = torch.tensor([0, *(int(c.numel()) for c in contexts)], dtype=torch.int64).cumsum(0)
    q_off = torch.tensor([0, *num_new], dtype=torch.int64).cumsum(0)
    q_pos = None
    if any(pos is not None for pos in positions):
        q_pos = torch.cat([pos.cpu() if pos is not None else torch.arange(ctx.numel() - t, ctx.numel())
                           for ctx, t, pos in zip(contexts, num_new, positions)]).contiguous()
    return AttentionBatch(torch.cat(contexts).cpu().contiguous(), ctx_off, q_off, torch.tensor(decode, dtype=torch.uint8),
                          q_pos)


def _kernel(dtype: torch.dtype, name: str):
    """The C function ``name`` for ``dtype``'s kernels, or None when they are not available here."""
    lib = library.load()
    if lib is None or dtype not in library.instruction_sets():
        return None
    return getattr(lib, f"{_PREFIX[dtype]}_{name}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every sequence's new rows over its context, read straight from the arena.

    Prompt rows take a tiled kernel (keys packed per call, fixed 64-key blocks from position 0);
    generated tokens take a decode kernel that reads the arena unpacked. Either way each prompt row
    is computed alone, so it is the same whatever else runs in the call and however much of its
    prefix came from the cache (bit-identical in bf16 and in float32).

    Args:
        q: ``[N, Hq, D]`` queries (RoPE applied), bf16 or float32 as the arena, ``N =
            batch.num_rows``; rows may be strided (a view of the fused QKV output) but each head's
            ``D`` values contiguous.
        k_cache, v_cache: one layer of the arena, ``[slots, Hkv, D]``, q's dtype, contiguous; the new
            tokens' K/V already written. Slots in ``batch`` must lie inside it.
        batch: the step's sequences (:func:`attention_batch`); rows at explicit positions
            (``batch.q_pos``) attend to their context up to their position.
        scale: softmax scale.
        out: optional contiguous ``[N, Hq, D]`` tensor of q's dtype to write into.

    Returns:
        ``out`` or a new ``[N, Hq, D]`` tensor of q's dtype.

    Raises:
        NativeKernelError: the kernel is not available for q's dtype, shapes/dtypes do not fit it,
            or the batch has explicit positions and q's dtype has no kernel for them
            (:func:`takes_positions`).
    """
    n, hq, d = q.shape
    fn = _kernel(q.dtype, "paged_attention")
    if fn is None:
        raise NativeKernelError(f"no native attention kernel for {q.dtype} here: {unavailable_reason(q.dtype, 'cpu', d)}")
    if (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
            or q.stride(2) != 1 or q.stride(1) != d or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or k_cache.shape != v_cache.shape or k_cache.shape[2] != d or n != batch.num_rows
            or hq % k_cache.shape[1] != 0 or d % _HEAD_MULTIPLE[q.dtype]):
        raise NativeKernelError(f"paged_attention: bad arguments q={tuple(q.shape)}/{q.dtype}/{q.stride()}, "
                                f"kv={tuple(k_cache.shape)}/{k_cache.dtype}, rows={batch.num_rows}")
    if batch.q_pos is not None and (not takes_positions(q.dtype) or batch.q_pos.shape != (n,)):
        raise NativeKernelError(f"paged_attention: explicit row positions need a kernel that takes them and one per row "
                                f"(q {q.dtype}, {n} rows, {tuple(batch.q_pos.shape)} positions)")
    if out is None:
        out = torch.empty((n, hq, d), dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise NativeKernelError(f"paged_attention: bad out {tuple(out.shape)}/{out.dtype}")
    # the rows' positions (NULL: the last T of each context), where the kernel has the argument
    qpos = ((None if batch.q_pos is None else batch.q_pos.data_ptr()),) if takes_positions(q.dtype) else ()
    rc = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), batch.slots.data_ptr(),
            batch.ctx_off.data_ptr(), batch.q_off.data_ptr(), batch.decode.data_ptr(), *qpos, len(batch.decode), hq,
            k_cache.shape[1], d, scale, out.data_ptr(), torch.get_num_threads())
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
    model: the attention kernel is available for ``dtype`` (:func:`available`) and the hidden and
    intermediate sizes are multiples of 16 (bf16) or 8 (float32)."""
    return (available(dtype, device, head_dim, group) and hidden % _ROW_MULTIPLE[dtype] == 0
            and intermediate % _ROW_MULTIPLE[dtype] == 0)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise NativeKernelError(what)


def rope_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """RoPE on the query and key heads of ``qkv`` in place, then the keys and values written to the arena.

    Args:
        qkv: ``[N, Hq + 2 Hkv, D]`` bf16 or float32, contiguous (the fused QKV GEMM's output).
        cos, sin: ``[N, D]`` float32 tables (:func:`~ragcache_backend.model.kernels.rope.rope_cos_sin`).
        k_cache, v_cache: one layer of the arena, ``[slots, Hkv, D]`` of qkv's dtype, contiguous.
        slots: ``[N]`` int64 arena slot of each row.

    Raises:
        NativeKernelError: the kernel is unavailable for qkv's dtype or the arguments do not fit it.
    """
    fn = _kernel(qkv.dtype, "rope_write")
    n, heads, d = qkv.shape
    _check(fn is not None and qkv.is_contiguous() and heads == num_heads + 2 * num_kv_heads and d % _HEAD_MULTIPLE[qkv.dtype] == 0
           and cos.shape == (n, d) and sin.shape == (n, d) and cos.dtype == torch.float32 and sin.dtype == torch.float32
           and cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
           and k_cache.dtype == qkv.dtype and v_cache.dtype == qkv.dtype
           and k_cache.shape[1:] == (num_kv_heads, d) and v_cache.shape == k_cache.shape and slots.dtype == torch.int64
           and slots.numel() == n and slots.is_contiguous(),
           f"rope_write: bad arguments qkv={tuple(qkv.shape)}/{qkv.dtype} cos={tuple(cos.shape)}")
    fn(qkv.data_ptr(), n, num_heads, num_kv_heads, d, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
       v_cache.data_ptr(), slots.data_ptr(), torch.get_num_threads())


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (when given), then RMSNorm of ``h`` (HF LlamaRMSNorm; in bf16 with its roundings).

    Args:
        h: ``[N, H]`` bf16 or float32 residual stream, contiguous; delta: ``[N, H]`` of h's dtype or None;
        weight: ``[H]`` of h's dtype; eps: variance epsilon.

    Returns:
        ``[N, H]`` normalised rows of h's dtype.

    Raises:
        NativeKernelError: the kernel is unavailable for h's dtype or the arguments do not fit it.
    """
    fn = _kernel(h.dtype, "add_rms_norm")
    n, hidden = h.shape
    _check(fn is not None and h.is_contiguous() and hidden % _ROW_MULTIPLE[h.dtype] == 0 and weight.shape == (hidden,)
           and weight.dtype == h.dtype and weight.is_contiguous()
           and (delta is None or (delta.shape == h.shape and delta.dtype == h.dtype and delta.is_contiguous())),
           f"add_rms_norm: bad arguments h={tuple(h.shape)}/{h.dtype}")
    out = torch.empty_like(h)
    fn(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps, n, hidden, out.data_ptr(),
       torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[N, 2I]`` bf16 or float32 (``[gate | up]`` per row) -> ``[N, I]``.

    Raises:
        NativeKernelError: the kernel is unavailable for the dtype or the arguments do not fit it
            (``2I`` a multiple of 32 in bf16, 16 in float32).
    """
    fn = _kernel(gate_up.dtype, "silu_mul")
    n, two_i = gate_up.shape
    _check(fn is not None and gate_up.is_contiguous() and two_i % (2 * _ROW_MULTIPLE[gate_up.dtype]) == 0,
           f"silu_mul: bad arguments {tuple(gate_up.shape)}/{gate_up.dtype}")
    out = torch.empty((n, two_i // 2), dtype=gate_up.dtype)
    fn(gate_up.data_ptr(), n, two_i // 2, out.data_ptr(), torch.get_num_threads())
    return out


LINEAR_ROWS_MAX = 16
"""Most rows of a whole-step decode (:func:`decode_step`) and of one :func:`linear_rows` call for
rows picked out of a step (the LM head's) or a bf16 step's generated tokens."""

LINEAR_PROMPT_ROWS_F32 = 64
"""Most rows of a float32 layer GEMM that :func:`linear_rows` runs (in one call; in a mixed step with
up to :data:`LINEAR_ROWS_MAX` generated tokens' rows in the same call); beyond, oneDNN's
prepacked GEMM is faster. SmolLM2-135M's 120 layer GEMMs, every layer its own weights (from memory),
against oneDNN's packed GEMM, 2-core AMD EPYC Zen 3, AVX2, 2 threads (2026-11-29 19:50 UTC, medians
of 7 alternating rounds, ``benchmarks/prompt_rows_gemm.py``): 0.62 / 0.71 / 0.80 / 0.80 / 0.91x the
time at 16 / 24 / 32 / 48 / 64 rows, 0.98x at 96, 1.07x at 128 (until then the bound was 16, set
before the kernel's prefetch was shared over its tiles). A cache hit's question over cached
documents (tens of new rows) is such a call."""


_LINEAR_K_MULTIPLE = {torch.float32: 8, torch.bfloat16: 32}  # input sizes each few-row linear kernel tiles
_LINEAR_N_MULTIPLE = {torch.float32: 1, torch.bfloat16: 4}  # output sizes


def linear_rows_available(weight: torch.Tensor) -> bool:
    """Whether :func:`linear_rows` can run over ``weight``: ``[N, K]`` on the CPU, contiguous, float32
    (``K`` a positive multiple of 8, float32 kernels available) or bf16 (``K`` a multiple of 32, ``N`` of 4,
    bf16 kernels available: AVX512-BF16)."""
    return (weight.dtype in _LINEAR_K_MULTIPLE and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[1] > 0 and weight.shape[1] % _LINEAR_K_MULTIPLE[weight.dtype] == 0
            and weight.shape[0] % _LINEAR_N_MULTIPLE[weight.dtype] == 0
            and _kernel(weight.dtype, "linear_rows") is not None)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for a few rows, streaming the weight from memory once for all of them.

    A decode step of a small model is bound by reading its weights: oneDNN's GEMM reaches ~16 GB/s
    on small layers at one row here, this ~25 GB/s in float32 (``benchmarks/forward_vs_vllm.py`` prints
    the memory bandwidth and the floor it implies). Each row's result is independent of the other
    rows and of how many there are. float32: FMAs in float32. bf16 (``csrc/decode_bf16.c``): VDPBF16PS
    products accumulated in float32, the bias added, one bf16 rounding per output; the bits differ
    from PyTorch's bf16 GEMM by the summation order.

    Args:
        x: ``[M, K]`` of the weight's dtype (``M`` up to :data:`LINEAR_ROWS_MAX` is where it pays).
        weight: ``[N, K]`` float32 or bf16, contiguous (:func:`linear_rows_available`); bias: ``[N]``
            of its dtype, or None.

    Returns:
        ``[M, N]`` of the weight's dtype.

    Raises:
        NativeKernelError: the kernel is unavailable or the arguments do not fit it.
    """
    m, k = x.shape
    _check(linear_rows_available(weight) and weight.shape[1] == k and x.dtype == weight.dtype and m >= 1
           and (bias is None or (bias.shape == (weight.shape[0],) and bias.dtype == weight.dtype and bias.is_contiguous())),
           f"linear_rows: bad arguments x={tuple(x.shape)}/{x.dtype} weight={tuple(weight.shape)}/{weight.dtype}")
    x = x.contiguous()
    out = torch.empty((m, weight.shape[0]), dtype=weight.dtype)
    rc = _kernel(weight.dtype, "linear_rows")(x.data_ptr(), m, k, weight.data_ptr(), None if bias is None else bias.data_ptr(), weight.shape[0],
            out.data_ptr(), torch.get_num_threads())
    if rc:
        raise NativeKernelError(f"linear_rows failed with code {rc} (1: arguments)")
    return out


def rerotate_copy_available(k_cache: torch.Tensor) -> bool:
    """Whether :func:`rerotate_copy` runs over this arena: a contiguous CPU float32 or bf16
    ``[layers, slots, Hkv, D]`` arena (``D`` even, at most 512), the library built here."""
    lib = library.load()
    return (lib is not None and hasattr(lib, "rc_rerotate_copy") and k_cache.device.type == "cpu" and k_cache.dim() == 4
            and k_cache.dtype in (torch.float32, torch.bfloat16) and k_cache.is_contiguous()
            and k_cache.shape[-1] % 2 == 0 and k_cache.shape[-1] <= 512)


def rerotate_copy(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> None:
    """Every layer's KV of slots ``src`` copied to slots ``dst``, keys rotated by ``cos`` / ``sin``
    (a RoPE re-rotation, Cache-Craft §3.4.3: ``R(p + d) k = R(d) R(p) k``; ``csrc/rerotate.c``): the
    bits of ``(k * cos + rotate_half(k) * sin)`` in float32 rounded once to the arena's dtype, as
    :meth:`~ragcache_backend.model.arena.KVArena.copy_rerotated`'s PyTorch ops compute it, each key
    row read and written once.

    Args:
        k_cache, v_cache: ``[L, slots, Hkv, D]`` float32 or bf16, contiguous (:func:`rerotate_copy_available`).
        src, dst: ``[T]`` int64 slots, in range, no slot in both (the copies run in parallel).
        cos, sin: float32 ``[D]``, or ``[L, D]`` one table per layer.

    Raises:
        NativeKernelError: the kernel is unavailable or the arguments do not fit it.
    """
    layers, slots, hkv, d = k_cache.shape
    per_layer = cos.dim() == 2
    _check(rerotate_copy_available(k_cache) and v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
           and v_cache.is_contiguous() and src.dtype == dst.dtype == torch.int64 and src.shape == dst.shape and src.dim() == 1
           and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape and cos.is_contiguous() and sin.is_contiguous()
           and cos.shape == ((layers, d) if per_layer else (d,))
           and (src.numel() == 0 or (int(src.min()) >= 0 and int(src.max()) < slots and int(dst.min()) >= 0 and int(dst.max()) < slots
                                     and not bool(torch.isin(dst, src).any()))),
           f"rerotate_copy: bad arguments kv={tuple(k_cache.shape)}/{k_cache.dtype} src={tuple(src.shape)} cos={tuple(cos.shape)}")
    src, dst = src.contiguous(), dst.contiguous()
    rc = library.load().rc_rerotate_copy(k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), layers, hkv, d, src.data_ptr(),
                                         dst.data_ptr(), src.numel(), cos.data_ptr(), sin.data_ptr(), int(per_layer),
                                         int(k_cache.dtype == torch.bfloat16), torch.get_num_threads())
    if rc:
        raise NativeKernelError(f"rerotate_copy failed with code {rc} (1: arguments)")


class _LayerStruct(ctypes.Structure):
    """``rc32_layer_t`` of ``csrc/kernels_f32.c`` and ``rc_layer_t`` of ``csrc/decode_bf16.c`` (the same
    layout, pointers to float32 or bf16): one decoder layer's weights for :func:`decode_step`."""

    _fields_ = [("qkv_w", ctypes.c_void_p), ("qkv_b", ctypes.c_void_p), ("o_w", ctypes.c_void_p),
                ("o_b", ctypes.c_void_p), ("gu_w", ctypes.c_void_p), ("down_w", ctypes.c_void_p),
                ("down_b", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("next_norm", ctypes.c_void_p),
                ("post_eps", ctypes.c_float), ("next_eps", ctypes.c_float)]


@dataclass(slots=True, frozen=True)
class DecodeLayer:
    """One decoder layer as :func:`decode_plan` takes it (float32 or bf16, one dtype for all, contiguous,
    on the CPU).

    Attributes:
        qkv: ``[(Hq + 2 Hkv) D, H]`` fused Q/K/V weight; qkv_bias: its ``[(Hq + 2 Hkv) D]`` bias or None.
        o: ``[H, Hq D]``; o_bias: ``[H]`` or None.
        gate_up: ``[2 I, H]`` (gate rows, then up rows).
        down: ``[H, I]``; down_bias: ``[H]`` or None.
        post_norm, post_eps: the post-attention RMSNorm.
        next_norm, next_eps: the next layer's input RMSNorm (the final norm after the last layer).
        qkv_amx, o_amx, gate_up_amx, down_amx: bf16 only, each GEMM's weight packed for our AMX GEMM
            (:func:`amx_pack`, the same weight and bias) where that GEMM runs on it in a step's other
            rows too (:attr:`~ragcache_backend.model.kernels.linear.Linear.amx`), else None: the step
            then runs it on AMX tiles as well, so a generated token's bits do not depend on the path.
    """

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    down_bias: torch.Tensor | None
    post_norm: torch.Tensor
    post_eps: float
    next_norm: torch.Tensor
    next_eps: float
    qkv_amx: AMXWeight | None = None
    o_amx: AMXWeight | None = None
    gate_up_amx: AMXWeight | None = None
    down_amx: AMXWeight | None = None


class _LayerTilesStruct(ctypes.Structure):
    """``rc_layer_tiles_t`` of ``csrc/decode_bf16.c``: one layer's AMX-packed GEMM weights (or NULL)."""

    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gu", ctypes.c_void_p), ("down", ctypes.c_void_p)]


@dataclass(slots=True, frozen=True)
class DecodePlan:
    """The layers of a model as :func:`decode_step` reads them, built once (:func:`decode_plan`).

    Attributes:
        layers: the layer structs' array; keep: the tensors its pointers point into.
        tiles: the layers' AMX-packed GEMM weights (bf16, where any GEMM has them), or None.
        hidden, intermediate: ``H`` and ``I``.
        dtype: the weights' dtype (float32: ``rc32_decode_step``; bf16: ``rc_decode_step``).
    """

    layers: ctypes.Array
    keep: tuple
    hidden: int
    intermediate: int
    dtype: torch.dtype = torch.float32
    tiles: ctypes.Array | None = None


def decode_plan(layers: list[DecodeLayer]) -> DecodePlan | None:
    """The decode-step plan of ``layers``, or None where :func:`decode_step` cannot run them: no
    native kernels for their dtype here (float32: AVX2 + FMA; bf16: AVX512-BF16), a tensor that is
    not a contiguous CPU tensor of the first weight's dtype, hidden or MLP sizes that are not
    multiples of 8 (float32) or 32 (bf16), an AMX-packed weight that is not its GEMM's."""
    if not layers:
        return None
    dtype = layers[0].qkv.dtype
    if dtype not in _LINEAR_K_MULTIPLE or _kernel(dtype, "decode_step") is None:
        return None
    tensors = [t for lay in layers for t in (lay.qkv, lay.qkv_bias, lay.o, lay.o_bias, lay.gate_up, lay.down, lay.down_bias,
                                             lay.post_norm, lay.next_norm) if t is not None]
    if any(t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    hidden, intermediate = layers[0].qkv.shape[1], layers[0].down.shape[1]
    if hidden % _LINEAR_K_MULTIPLE[dtype] or intermediate % _LINEAR_K_MULTIPLE[dtype]:  # the step's GEMMs' input sizes
        return None
    packed = [((lay.qkv_amx, lay.qkv), (lay.o_amx, lay.o), (lay.gate_up_amx, lay.gate_up), (lay.down_amx, lay.down))
              for lay in layers]
    if any(a is not None and (dtype != torch.bfloat16 or (a.out_features, a.in_features) != tuple(w.shape))
           for row in packed for a, w in row):
        return None
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    array = (_LayerStruct * len(layers))(*[
        _LayerStruct(ptr(lay.qkv), ptr(lay.qkv_bias), ptr(lay.o), ptr(lay.o_bias), ptr(lay.gate_up), ptr(lay.down),
                     ptr(lay.down_bias), ptr(lay.post_norm), ptr(lay.next_norm), lay.post_eps, lay.next_eps)
        for lay in layers])
    tiles = None
    if any(a is not None for row in packed for a, _ in row):
        tiles = (_LayerTilesStruct * len(layers))(*[_LayerTilesStruct(*[None if a is None else a.tiles.data_ptr() for a, _ in row])
                                                    for row in packed])
        tensors += [a.tiles for row in packed for a, _ in row if a is not None]
    return DecodePlan(array, tuple(tensors), hidden, intermediate, dtype, tiles)


def decode_step(plan: DecodePlan, h: torch.Tensor, x: torch.Tensor, num_heads: int, num_kv_heads: int,
                cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write: torch.Tensor,
                batch: AttentionBatch, scale: float) -> None:
    """Every decoder layer of a step whose rows are all generated tokens (at most
    :data:`LINEAR_ROWS_MAX`), in one native call and one OpenMP region.

    float32 (``rc32_decode_step``): the same arithmetic, bit for bit, as the per-operation kernels
    (:func:`linear_rows`, :func:`rope_write`, :func:`paged_attention`, :func:`add_rms_norm`,
    :func:`silu_mul`), without their per-call dispatch. bf16 (``rc_decode_step``): the per-operation
    kernels' rows, with :func:`linear_rows`' bf16 GEMM in place of PyTorch's (the bits differ from the
    per-operation path's by the GEMMs' float32 summation order; a row's bits never depend on the
    other rows of the step), or on AMX CPUs our AMX GEMM's (:func:`amx_linear`'s bits, for the GEMMs
    whose packed weight the plan holds: ``DecodePlan.tiles``).

    Args:
        plan: the model's layers (:func:`decode_plan`), of the dtype of ``h``, ``x`` and the arena.
        h: ``[M, H]`` residual stream (the embeddings), contiguous; updated in place.
        x: ``[M, H]``, contiguous: layer 0's input-normed rows in, the final-normed rows out.
        cos, sin: ``[M, D]`` float32 RoPE tables of the rows' positions.
        k_cache, v_cache: the whole arena, ``[layers, slots, Hkv, D]``, contiguous.
        write: ``[M]`` int64 slot of each row's new K/V.
        batch: the rows' contexts (:func:`attention_batch`, every row a decode row).
        scale: softmax scale.

    Raises:
        NativeKernelError: the kernel is unavailable or the arguments do not fit it.
    """
    m, hidden = h.shape
    d = k_cache.shape[-1]
    dtype = plan.dtype
    step = _kernel(dtype, "decode_step")
    _check(step is not None and 1 <= m <= LINEAR_ROWS_MAX and hidden == plan.hidden
           and h.is_contiguous() and x.shape == h.shape and x.is_contiguous() and h.dtype == x.dtype == dtype
           and k_cache.is_contiguous() and v_cache.shape == k_cache.shape and v_cache.is_contiguous()
           and k_cache.dtype == dtype and v_cache.dtype == dtype and k_cache.shape[0] == len(plan.layers)
           and k_cache.shape[2] == num_kv_heads and d % _HEAD_MULTIPLE[dtype] == 0
           and cos.shape == (m, d) and sin.shape == (m, d) and cos.dtype == sin.dtype == torch.float32
           and cos.is_contiguous() and sin.is_contiguous()
           and write.shape == (m,) and write.dtype == torch.int64 and write.is_contiguous()
           and batch.num_rows == m and len(batch.decode) == m and bool(batch.decode.all()),
           f"decode_step: bad arguments h={tuple(h.shape)}/{h.dtype} kv={tuple(k_cache.shape)}/{k_cache.dtype} "
           f"plan {plan.dtype} rows={batch.num_rows}")
    # an older revision's library (benchmarks/kernel_ab.py) takes no tiles: its own GEMM then
    tiles = (plan.tiles,) if dtype == torch.bfloat16 and hasattr(library.load(), "rc_decode_takes_tiles") else ()
    rc = step(
        ctypes.addressof(plan.layers), len(plan.layers), h.data_ptr(), x.data_ptr(), m, hidden, num_heads, num_kv_heads, d,
        plan.intermediate, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        write.data_ptr(), batch.slots.data_ptr(), batch.ctx_off.data_ptr(), scale, torch.get_num_threads(), *tiles)
    if rc != 0:
        raise NativeKernelError(f"decode_step failed with code {rc} (1: arguments or AMX not running, 2: memory)")
