"""Linear layers with weights prepacked once for oneDNN (CPU), as Inductor's frozen graphs do.

``F.linear`` on the CPU re-lays the weight out for oneDNN on every call (bf16) or runs MKL's
GEMM (float32). Packing once at load time and calling oneDNN's linear directly is, measured on
this project's 2-core AMD EPYC (AVX512-BF16, no AMX) for SmolLM2's shapes: bf16 1.3-2.3x faster at
1-30 rows and ~5% at 1,000 rows, bit-identical to ``F.linear``; float32 2-4x faster (not
bit-identical to MKL; rows stay independent of the batch, which MKL's do not).

The packed path goes through PyTorch's internal ``torch.ops.mkldnn`` ops (the ones Inductor's
weight freezing uses); :func:`pack_linear` probes them once and falls back to ``F.linear`` where
they are missing or disagree, so a torch without them only loses speed.

On CPUs with AMX (Intel Sapphire Rapids and later) oneDNN runs bf16 GEMMs of more than 32 rows on
AMX tiles and smaller ones on AVX-512, and the AMX kernels' blocking (so a row's rounding)
changes with the row count as well (measured 2026-11-23 on a 2-core Xeon with AMX: rows differ
from the same row computed alone for M = 33..1,100). There every reduced-precision GEMM runs in
calls of exactly :data:`ROW_TILE` rows (the last padded), which makes each row's result the same
whatever else is in the batch, at AMX speed: a prompt's last token then rounds the same computed
alone (a cache hit) or inside its whole prompt. Measured there for SmolLM2's shapes: 1,000 rows
take 1.2-1.9x the untiled AMX time (5-10x faster than without AMX), one row 1.6-2x.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
_REDUCED = (torch.bfloat16, torch.float16)
ROW_TILE = 64
"""Rows per reduced-precision GEMM call on AMX CPUs (see the module docstring)."""


def _cpu_has_amx() -> bool:
    """True when the CPU advertises AMX tiles for bf16 (``/proc/cpuinfo`` flags; False elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"amx_tile", "amx_bf16"} <= flags
    except OSError:
        pass
    return False


_AMX = _cpu_has_amx()


@dataclass(slots=True)
class Linear:
    """``y = x W^T + b`` for ``x`` ``[N, in]`` -> ``[N, out]`` in the weight's dtype; on the CPU in
    bf16/fp16 every row's result is the same whatever ``N`` is (the property cache exactness needs).

    Attributes:
        weight: ``[out, in]`` (the plain weight, used when ``packed`` is None).
        bias: ``[out]`` or None.
        packed: the oneDNN-packed weight, or None for ``F.linear``.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _AMX and x.dtype in _REDUCED and x.device.type == "cpu":
            return self._tiled(x)
        if x.shape[0] == 1 and x.dtype in _REDUCED and x.device.type == "cpu":
            # oneDNN sums a lone row in another order than a row of a larger batch (measured for
            # K = 1,536: ~9% of single rows round differently in bf16; every M >= 2 agrees), so a
            # single row runs as two: a prompt's last token then rounds the same whether it was
            # computed alone (a cache hit) or with the rest of its prompt. Costs nothing measurable.
            return self._apply(x.expand(2, -1).contiguous())[:1]
        return self._apply(x)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in calls of exactly :data:`ROW_TILE` rows (AMX CPUs: row results independent of M)."""
        rows = x.shape[0]
        pad = -rows % ROW_TILE
        if pad:
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        x = x.contiguous()
        if x.shape[0] == ROW_TILE:
            return self._apply(x)[:rows]
        return torch.cat([self._apply(x[i : i + ROW_TILE]) for i in range(0, x.shape[0], ROW_TILE)])[:rows]

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _packing_works(dtype: torch.dtype) -> bool:
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        log.info("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return False
    return bool(torch.allclose(y.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2))


_works: dict[torch.dtype, bool] = {}


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A :class:`Linear` over ``weight`` ``[out, in]`` (and ``bias``), packed for oneDNN when the
    weight is on the CPU in float32 or bf16 and packing works in this torch; plain otherwise.

    The packed copy adds the weight's size in memory (the plain weight stays for other users).
    """
    weight = weight.detach()
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return Linear(weight, bias)
    if weight.dtype not in _works:
        _works[weight.dtype] = _packing_works(weight.dtype)
    if not _works[weight.dtype]:
        return Linear(weight, bias)
    return Linear(weight, bias, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()))
