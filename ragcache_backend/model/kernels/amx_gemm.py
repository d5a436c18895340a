"""Our bf16 GEMM on AMX tiles (``csrc/linear_amx.c``, and ``csrc/decode_bf16.c``'s few-row form): each
output row computed from its own input row only, so a row's bits are the same in a call of any size,
beside any other rows. What lets a forward step's prompt rows run in one call on CPUs with AMX and
still round as they would over any cached prefix (oneDNN's AMX GEMMs block by the row count, so
their rows do not), and generated tokens and the LM head run on the same arithmetic at any batch.

:func:`bf16_amx` says (and sets) whether AMX runs here; :func:`amx_pack` lays a weight out once;
:func:`amx_linear` and :func:`amx_linear_silu` (SiLU(gate) * up in the GEMM's epilogue) run it.
All are importable from :mod:`~ragcache_backend.model.kernels.native` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragcache_backend.model.kernels import library
from ragcache_backend.model.kernels.library import NativeKernelError

__all__ = ["AMX_FEW_ROWS", "AMXWeight", "amx_linear", "amx_linear_available", "amx_linear_silu", "amx_pack", "bf16_amx"]


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise NativeKernelError(what)


def bf16_amx(enable: bool | None = None) -> bool:
    """Whether bf16 prompt attention runs its dot products on AMX tiles (TDPBF16PS; by default where
    the CPU has AMX-TILE and AMX-BF16 and Linux grants this process the tile state:
    ``csrc/paged_attention_bf16.c``, ``rc_amx``) instead of AVX512-BF16 (VDPBF16PS). Either way
    every prompt row is computed alone (cache exactness); the two round some rows differently
    (another summation order of the same bf16 products), so switch only before an engine runs:
    K/V cached under one is not bit-identical under the other. ``enable`` sets it for this process
    (True only takes effect where AMX runs), None only asks; ``RAGCACHE_AMX=0`` in the environment
    turns it off when the library loads. Measured on a 2-core Xeon with AMX (2026-11-28, SmolLM2's
    9 / 3 heads of 64): a 1,000-token prompt's attention 2.2 against 7.4 ms per layer, 30 rows over
    1,000 keys 0.23 against 0.51 ms. It also decides, when a model's weights are packed, whether its
    layer GEMMs take our AMX GEMM (:func:`amx_linear`) or oneDNN's in 128-row calls
    (:mod:`~ragcache_backend.model.kernels.linear`).

    Raises:
        RuntimeError: the native library is not available
            (:func:`~ragcache_backend.model.kernels.native.unavailable_reason` says why).
    """
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {library.why_not()}")
    if not hasattr(lib, "rc_amx"):  # another revision's library (benchmarks/kernel_ab.py)
        return False
    return bool(lib.rc_amx(-1 if enable is None else int(enable)))


@dataclass(slots=True, frozen=True)
class AMXWeight:
    """A bf16 weight laid out for :func:`amx_linear` (``csrc/linear_amx.c``: per 16 output columns,
    their bf16 input pairs side by side, so that a tile's operand is 1 KB contiguous).

    Attributes:
        tiles: ``[N * K]`` bf16, the packed weight.
        out_features, in_features: ``N`` and ``K``, multiples of 32.
        bias: ``[N]`` float32 (the bias converted once), or None.
    """

    tiles: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None


def amx_linear_available(weight: torch.Tensor) -> bool:
    """Whether :func:`amx_pack` / :func:`amx_linear` run over ``weight``: ``[N, K]`` bf16 on the CPU,
    ``N`` and ``K`` multiples of 32, and AMX running here (:func:`bf16_amx`: the CPU has AMX-BF16,
    Linux granted the tile state, ``RAGCACHE_AMX`` is not 0)."""
    if not (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0 and weight.shape[0] >= 32):
        return False
    lib = library.load()
    return lib is not None and hasattr(lib, "rc_amx_linear") and torch.bfloat16 in library.instruction_sets() and bf16_amx()


def amx_pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> AMXWeight:
    """``weight`` ``[N, K]`` bf16 (and its bias ``[N]``) laid out for :func:`amx_linear` (a copy:
    ``N * K`` bf16 more in memory).

    Raises:
        NativeKernelError: :func:`amx_linear_available` is False for it, or the bias is not ``[N]``.
    """
    n, k = weight.shape
    _check(amx_linear_available(weight) and (bias is None or bias.shape == (n,)),
           f"amx_pack: bad arguments weight={tuple(weight.shape)}/{weight.dtype}")
    w = weight.contiguous()
    tiles = torch.empty(n * k, dtype=torch.bfloat16)
    library.load().rc_amx_pack(w.data_ptr(), n, k, tiles.data_ptr())
    return AMXWeight(tiles, n, k, None if bias is None else bias.detach().float().contiguous())


AMX_FEW_ROWS = 16
"""Most rows :func:`amx_linear` computes on tiles of as many rows (``rc_amx_linear_rows``, the
whole-step decode's GEMM) instead of padded 32-row blocks: the same bits. SmolLM2-135M's LM head
(49,152 x 576) on a 2-core Xeon with AMX (2026-11-28, medians of 15): at 1 / 2 / 8 / 16 rows 1.20 /
1.18 / 1.27 / 1.25 ms, padded 1.73 / 1.62 / 1.74 / 1.83 ms, :func:`linear_rows` 1.31 / 1.38 / 3.19 / 4.63 ms."""


def amx_linear(x: torch.Tensor, weight: AMXWeight) -> torch.Tensor:
    """``x W^T + b`` in bf16 on AMX tiles, each output row computed from its own input row only: its
    bits are the same in a call of any number of rows, beside any other rows (``csrc/linear_amx.c``:
    TDPBF16PS over the input size in order, float32 sums, the bias added in float32, one bf16
    rounding). What lets a prompt's rows run in one call on AMX CPUs and still round as they would
    over any cached prefix (oneDNN's AMX GEMMs block by the row count, so their rows do not). Against
    oneDNN in calls of 128 rows on a 2-core Xeon with AMX (2026-11-28, SmolLM2-135M's four layer
    shapes): 0.42-0.68x the time at 1,024-2,048 rows, the same at 128.

    Args:
        x: ``[M, K]`` bf16 on the CPU, rows may be strided (each row's ``K`` values contiguous).
        weight: from :func:`amx_pack`.

    Returns:
        ``[M, N]`` bf16, contiguous.

    Raises:
        NativeKernelError: shapes or dtypes that do not fit, AMX not running (code 3), or no memory
            for the kernel's scratch (code 2).
    """
    m, k = x.shape
    _check(x.dtype == torch.bfloat16 and x.device.type == "cpu" and k == weight.in_features and m >= 1,
           f"amx_linear: bad arguments x={tuple(x.shape)}/{x.dtype} for a {weight.out_features} x {weight.in_features} weight")
    if x.stride(1) != 1 or x.stride(0) < k:
        x = x.contiguous()
    out = torch.empty((m, weight.out_features), dtype=torch.bfloat16)
    lib = library.load()
    # up to 16 rows on tiles of as many rows (the same bits; an older revision's library lacks it)
    fn = lib.rc_amx_linear_rows if m <= AMX_FEW_ROWS and hasattr(lib, "rc_amx_linear_rows") else lib.rc_amx_linear
    rc = fn(x.data_ptr(), x.stride(0), weight.tiles.data_ptr(), None if weight.bias is None else weight.bias.data_ptr(), m,
            weight.out_features, k, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise NativeKernelError(f"amx_linear failed with code {rc} (1: arguments, 2: memory, 3: AMX not running)")
    return out


def amx_linear_silu(x: torch.Tensor, weight: AMXWeight) -> torch.Tensor:
    """``silu_mul(amx_linear(x, weight))`` for a ``[gate; up]`` weight (``[2 I, K]``: the gate's rows,
    then the up projection's), the same bits, in one call that never writes the ``[M, 2 I]`` product
    (``csrc/linear_amx.c``, ``rc_amx_linear_silu``: each 32-row block's gate and up sums side by side
    in the tiles, each rounded to bf16 as :func:`amx_linear` rounds it, then :func:`silu_mul`'s SiLU
    and product).

    Args:
        x: ``[M, K]`` bf16 on the CPU (rows may be strided); weight: from :func:`amx_pack`, ``2 I``
            rows with ``I`` a multiple of 16.

    Returns:
        ``[M, I]`` bf16, contiguous.

    Raises:
        NativeKernelError: as :func:`amx_linear`; also a library without the kernel (an older revision's).
    """
    m, k = x.shape
    fn = getattr(library.load(), "rc_amx_linear_silu", None)
    _check(fn is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and k == weight.in_features and m >= 1
           and weight.out_features % 32 == 0,
           f"amx_linear_silu: bad arguments x={tuple(x.shape)}/{x.dtype} for a {weight.out_features} x {weight.in_features} weight")
    if x.stride(1) != 1 or x.stride(0) < k:
        x = x.contiguous()
    out = torch.empty((m, weight.out_features // 2), dtype=torch.bfloat16)
    rc = fn(x.data_ptr(), x.stride(0), weight.tiles.data_ptr(), None if weight.bias is None else weight.bias.data_ptr(), m,
            weight.out_features // 2, k, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise NativeKernelError(f"amx_linear_silu failed with code {rc} (1: arguments, 2: memory, 3: AMX not running)")
    return out
