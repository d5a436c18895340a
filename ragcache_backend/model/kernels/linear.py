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
from the same row computed alone for M = 33..1,100; calls of up to 32 rows agree with each other).
There a row's result is made independent of the rest of the batch by the class of the row
(:func:`step_rows` tells a layer's GEMMs which rows of the step are which):

* prompt rows run in calls of exactly :data:`ROW_TILE` rows (the last one padded), on AMX: a
  prompt's last token rounds the same computed alone (a cache hit) or inside its whole prompt;
* generated tokens' rows (decode), and rows picked out of a step (the LM head's), run in calls of
  at most 32 rows, on AVX-512, where a decode step costs what it did.

Measured there (SmolLM2-135M bf16, 2 threads, 2026-11-23, ``engine.generate``): a 1,050-token
miss 0.65 s instead of 0.40 s untiled (without AMX the GEMMs alone take 5-10x longer), a full
cache hit 68 ms instead of 40 ms, a decode step unchanged (39 ms). Re-measured 2026-11-28 on a
2-core Xeon with AMX (one forward pass of 1,000 prompt tokens, alternating): the layer GEMMs 173-185
ms in 128-row calls against 141-158 ms in one call, the pass 268-286 against 231-250 ms (~1.15x;
calls of 256 or 384 rows gain nothing). That was the price of exact bf16 reuse on AMX; float32
never uses AMX and is unaffected.

Since 2026-11-28 a layer GEMM's prompt rows on AMX run instead in one call of our own AMX GEMM
(:func:`~ragcache_backend.model.kernels.native.amx_linear`, ``csrc/linear_amx.c``), whose blocking
never mixes rows, so a row's bits are its own by construction, in a call of any size (where it runs:
:attr:`Linear.amx`; the 128-row oneDNN calls stay the fallback). On that Xeon, two engines
alternating in one process: a cold 1,000-token pass 0.71x the time of the 128-row calls, 2,000 tokens
0.75x (``docs/benchmarks/2026-11-28-xeon-amx-gemm/ab_amx_gemm.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragcache_backend.model.kernels import native

log = logging.getLogger(__name__)
_REDUCED = (torch.bfloat16, torch.float16)
ROW_TILE = 128
"""Rows per reduced-precision GEMM call of prompt rows on AMX CPUs (see the module docstring)."""
TAIL_TILE = 64
"""Rows of the last, padded call of a prompt's rows on AMX CPUs when at most this many rows are left
and this weight shape was seen to give the same row bits in calls of this many rows as in
:data:`ROW_TILE` ones (:func:`pack_linear` checks once per shape). A cache hit's few new rows then
pay for 64 rows, not 128: 20 new tokens over 500 cached 34 against 41-42 ms on a 2-core Xeon with
AMX (2026-11-28)."""
SMALL_CALL = 32
"""Most rows per call that oneDNN runs on AVX-512 (not AMX) kernels, whose rows do not depend on M."""


@dataclass(slots=True)
class StepRowClasses:
    """Which rows of a forward step's layer GEMMs are prompt tokens (the rest are generated tokens).

    Attributes:
        rows: the step's row count now (a call with another row count is not a layer GEMM).
        prompt: ``[P]`` int64 indices of the prompt rows, ascending.
        decode: ``[N - P]`` int64 indices of the generated tokens' rows, ascending.
        split: ``P`` when the prompt rows are exactly the first ``P`` rows (the engine's order), else None.
    """

    rows: int
    prompt: torch.Tensor
    decode: torch.Tensor
    split: int | None

    @classmethod
    def of(cls, lengths: list[int], decode: list[bool]) -> StepRowClasses:
        """From per-sequence row counts and decode flags (a decode sequence has one row)."""
        prompt_rows, decode_rows, row = [], [], 0
        for n, dec in zip(lengths, decode):
            (decode_rows if dec else prompt_rows).extend(range(row, row + n))
            row += n
        split = len(prompt_rows) if prompt_rows == list(range(len(prompt_rows))) else None
        return cls(row, torch.tensor(prompt_rows, dtype=torch.int64), torch.tensor(decode_rows, dtype=torch.int64), split)


_STEP_ROWS: contextvars.ContextVar[StepRowClasses | None] = contextvars.ContextVar("ragcache_step_rows", default=None)


@contextlib.contextmanager
def step_rows(classes: StepRowClasses) -> Iterator[None]:
    """Within the block, layer GEMMs of ``classes.rows`` rows split their rows by class (AMX CPUs)."""
    token = _STEP_ROWS.set(classes)
    try:
        yield
    finally:
        _STEP_ROWS.reset(token)


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
ROWS_BY_CLASS = _AMX
"""Whether a step's GEMM rows must be told apart by class (:func:`step_rows`): only on AMX CPUs."""


@dataclass(slots=True)
class Linear:
    """``y = x W^T + b`` for ``x`` ``[N, in]`` -> ``[N, out]`` in the weight's dtype; on the CPU in
    bf16/fp16 every row's result is the same whatever ``N`` is (the property cache exactness needs).

    Attributes:
        weight: ``[out, in]`` (the plain weight, used when ``packed`` is None).
        bias: ``[out]`` or None.
        packed: the oneDNN-packed weight, or None for ``F.linear``.
        per_step: its input rows are a forward step's rows (a decoder layer's GEMMs); False for
            rows picked out of a step (the LM head's), which on AMX CPUs always run as small calls.
        rows_kernel: calls of at most ``rows_max`` rows take the native kernel that reads the weight
            once for all rows (:func:`~ragcache_backend.model.kernels.native.linear_rows`, in calls of
            at most ``max(rows_max, LINEAR_ROWS_MAX)`` rows; a mixed step's prompt rows, when they
            take it, share one call with its generated tokens' rows up to ``rows_max + LINEAR_ROWS_MAX``
            rows in all: :meth:`_decode_apart`).
        rows_max: most rows of a call that takes the native kernel; None: any number (see :func:`pack_linear`).
        tail_tile: rows of the last, padded tiled call when no more are left (:data:`TAIL_TILE` where
            checked to give :data:`ROW_TILE` calls' bits, else :data:`ROW_TILE`).
        amx: the weight laid out for our own AMX GEMM (:func:`~ragcache_backend.model.kernels.native.amx_linear`,
            each row's bits independent of the call): every row of a step (prompt and generated
            tokens alike) then runs in one call of it, instead of :data:`ROW_TILE`-row oneDNN calls
            and the few-row kernel, and the whole-step decode runs it on tiles too
            (:func:`~ragcache_backend.model.kernels.native.decode_step`: the same bits); None where it
            does not run (no AMX, ``RAGCACHE_AMX=0``, not bf16, not a layer GEMM, a shape it does not tile).
        decode_rows: a layer GEMM whose generated tokens' rows (told apart by :func:`step_rows`)
            take the native kernel whatever else the step holds (calls as for ``rows_kernel``): the
            GEMM of a whole-step decode (:func:`~ragcache_backend.model.kernels.native.decode_step`), so a
            generated token gets the same bits in a step mixed with prompt chunks as in a
            decode-only one.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None
    per_step: bool = True
    rows_kernel: bool = False
    rows_max: int | None = native.LINEAR_ROWS_MAX
    decode_rows: bool = False
    tail_tile: int = ROW_TILE
    amx: native.AMXWeight | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._on_amx(x):
            return native.amx_linear(x, self.amx)
        if self.decode_rows:
            classes = _STEP_ROWS.get()
            if classes is not None and classes.rows == x.shape[0] and classes.decode.numel():
                return self._decode_apart(x, classes)
        return self._rows_alike(x)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        """``SiLU(gate) * up`` of this fused ``[gate; up]`` GEMM (``[out] = 2 I``): ``[N, in]`` ->
        ``[N, I]``, the bits of :func:`~ragcache_backend.model.kernels.native.silu_mul` over
        ``self(x)``; on our AMX GEMM in one call that never writes the ``[N, 2 I]`` product
        (:func:`~ragcache_backend.model.kernels.native.amx_linear_silu`: a cold 1,000-token pass of
        SmolLM2-135M writes and reads ~360 MB less)."""
        if self._on_amx(x):
            return native.amx_linear_silu(x, self.amx)
        return native.silu_mul(self(x))

    def _on_amx(self, x: torch.Tensor) -> bool:
        """Whether ``x`` runs on our AMX GEMM: where it runs for this weight, for a forward step's
        rows (prompt and generated tokens alike: each row's bits its own) or rows outside any step."""
        if self.amx is None or x.dtype != torch.bfloat16:
            return False
        if not self.per_step:  # rows picked out of a step (the LM head): any call
            return True
        classes = _STEP_ROWS.get()
        return classes is None or classes.rows == x.shape[0]

    def _decode_apart(self, x: torch.Tensor, classes: StepRowClasses) -> torch.Tensor:
        """Generated tokens' rows on the native few-row kernel, prompt rows as without classes.

        Where the prompt rows are the step's first ``P`` rows and no AMX tiling applies, no row
        is moved: when the ``P`` prompt rows would take the native kernel too (float32, ``P`` up to
        ``rows_max``), every row runs in it (in one call up to ``rows_max +``
        :data:`~ragcache_backend.model.kernels.native.LINEAR_ROWS_MAX` rows in all: one pass over
        the weight instead of two; each row's bits its own whatever the call, so the same bits);
        otherwise oneDNN's GEMM runs over all ``N`` rows and the generated tokens' rows are then
        overwritten with the native kernel's (the prompt rows' outputs are not copied into a new
        tensor: a 2,048-row step's layer GEMMs write ~40 MB a layer; oneDNN's extra ``N - P`` rows
        cost ``(N - P) / N`` of its time). A prompt row's bits may then differ from a ``P``-row call
        in float32 (never bit-exact across chunkings); in bf16 oneDNN's rows are the same for any
        ``N`` (see the class)."""
        p = classes.split
        if p is None or (_AMX and x.dtype in _REDUCED and x.device.type == "cpu"):
            return self._split_by_class(x, classes, self._prompt_parts, self._native)
        if p == 0 or self._native_takes(p, x.dtype):  # one call up to rows_max + 16 rows in all
            one_call = x.shape[0] <= (self.rows_max or 0) + native.LINEAR_ROWS_MAX
            return native.linear_rows(x, self.weight, self.bias) if one_call else self._native(x)
        out = self._rows_alike(x)
        out[p:] = self._native(x[p:])
        return out

    def _native_takes(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a call of ``rows`` rows of ``dtype`` with no row told apart takes the native kernel."""
        return self.rows_kernel and (self.rows_max is None or rows <= self.rows_max) and dtype == self.weight.dtype

    @staticmethod
    def _split_by_class(x: torch.Tensor, classes: StepRowClasses, prompt_parts, decode_fn) -> torch.Tensor:
        """``prompt_parts`` over the step's prompt rows (their outputs as consecutive row blocks) and
        ``decode_fn`` over its generated tokens' rows (``classes.decode`` not empty), put back in the
        step's row order (one copy where the prompt rows come first)."""
        if classes.split is not None:
            p = classes.split
            return torch.cat([*prompt_parts(x[:p].contiguous()), decode_fn(x[p:])]) if p else decode_fn(x)
        parts = prompt_parts(x.index_select(0, classes.prompt))
        prompt_out = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = x.new_empty((x.shape[0], prompt_out.shape[1]))
        out[classes.prompt] = prompt_out
        out[classes.decode] = decode_fn(x.index_select(0, classes.decode))
        return out

    def _prompt_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """A step's prompt rows: tiled on AMX CPUs in bf16/fp16 (:meth:`_by_class`), else as any call;
        their outputs as consecutive row blocks."""
        return self._tile_parts(x) if _AMX and x.dtype in _REDUCED and x.device.type == "cpu" else [self._rows_alike(x)]

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on the native few-row kernel, in calls of at most ``rows_max`` rows where that is more
        than :data:`~ragcache_backend.model.kernels.native.LINEAR_ROWS_MAX` (float32 layer GEMMs:
        :data:`~ragcache_backend.model.kernels.native.LINEAR_PROMPT_ROWS_F32`), else of at most
        ``LINEAR_ROWS_MAX`` (each row's bits independent of the others and of the call)."""
        step = max(native.LINEAR_ROWS_MAX, self.rows_max or 0)
        if x.shape[0] <= step:
            return native.linear_rows(x, self.weight, self.bias)
        return torch.cat([native.linear_rows(x[i : i + step], self.weight, self.bias) for i in range(0, x.shape[0], step)])

    def _rows_alike(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with no row told apart from the others."""
        if self._native_takes(x.shape[0], x.dtype):
            return self._native(x)  # few rows: bound by reading the weight
        if _AMX and x.dtype in _REDUCED and x.device.type == "cpu":
            return self._by_class(x)
        if x.shape[0] == 1 and x.dtype in _REDUCED and x.device.type == "cpu":
            # oneDNN sums a lone row in another order than a row of a larger batch (measured for
            # K = 1,536: ~9% of single rows round differently in bf16; every M >= 2 agrees), so a
            # single row runs as two: a prompt's last token then rounds the same whether it was
            # computed alone (a cache hit) or with the rest of its prompt. Costs nothing measurable.
            return self.gemm(x.expand(2, -1).contiguous())[:1]
        return self.gemm(x)

    def _by_class(self, x: torch.Tensor) -> torch.Tensor:
        """AMX CPUs: prompt rows in :data:`ROW_TILE`-row calls, other rows in small calls."""
        classes = _STEP_ROWS.get()
        if not self.per_step or (classes is not None and classes.rows != x.shape[0]):
            return self._small(x)
        if classes is None or not classes.decode.numel():
            return self._tiled(x)
        return self._split_by_class(x, classes, self._tile_parts, self._small)

    def _small(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in calls of at most :data:`SMALL_CALL` rows (a lone row run as two)."""
        if x.shape[0] == 1:
            return self.gemm(x.expand(2, -1).contiguous())[:1]
        if x.shape[0] <= SMALL_CALL:
            return self.gemm(x.contiguous())
        return torch.cat([self.gemm(x[i : i + SMALL_CALL].contiguous()) for i in range(0, x.shape[0], SMALL_CALL)])

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in calls of exactly :data:`ROW_TILE` rows (AMX CPUs: row results independent of M)."""
        parts = self._tile_parts(x)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _tile_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`_tiled`'s outputs, one per call, before they are put together (a layer on our AMX
        GEMM never gets here: :meth:`__call__` sends all its step's rows there)."""
        rows = x.shape[0]
        full = rows - rows % ROW_TILE
        x = x.contiguous()
        outs = [self.gemm(x[i : i + ROW_TILE]) for i in range(0, full, ROW_TILE)]
        if full < rows:  # only the last tile is copied to pad it, not all of x (a time saving not shown: tile_cost.py)
            tile = self.tail_tile if rows - full <= self.tail_tile else ROW_TILE
            outs.append(self.gemm(torch.cat((x[full:], x.new_zeros(full + tile - rows, x.shape[1]))))[: rows - full])
        return outs

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` in one call of oneDNN's GEMM over the packed weight (``F.linear`` when
        not packed), whatever the row count: the path :meth:`__call__` takes for the rows the native
        kernel does not; public for benchmarks that compare the two."""
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
_tails: dict[tuple[int, int, torch.dtype, bool, int], int] = {}


def _tail_tile(lin: Linear) -> int:
    """:data:`TAIL_TILE` if oneDNN gives ``lin``'s weight shape the same row bits in calls of that
    many rows as in :data:`ROW_TILE`-row calls (both halves of a random ``ROW_TILE``-row input, each
    row at another offset), else :data:`ROW_TILE`; once per shape, dtype, bias or not and thread
    count. oneDNN picks its kernel and blocking by those, not by the values, so equal bits here mean
    the same summation order for every input."""
    key = (*lin.weight.shape, lin.weight.dtype, lin.bias is not None, torch.get_num_threads())
    if key not in _tails:
        x = torch.randn(ROW_TILE, lin.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(lin.weight.dtype)
        full = lin.gemm(x)  # with the bias, if any: the primitive the calls use
        same = all(torch.equal(lin.gemm(x[i : i + TAIL_TILE].contiguous()), full[i : i + TAIL_TILE])
                   for i in range(0, ROW_TILE, TAIL_TILE))
        _tails[key] = TAIL_TILE if same else ROW_TILE
        if not same:
            log.info("linear %s: %d-row calls round rows differently from %d-row ones on this CPU; prompt tails "
                     "pad to %d rows", tuple(lin.weight.shape), TAIL_TILE, ROW_TILE, ROW_TILE)
    return _tails[key]


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, per_step: bool = True,
                picked_rows: bool = False) -> Linear:
    """A :class:`Linear` over ``weight`` ``[out, in]`` (and ``bias``), packed for oneDNN when the
    weight is on the CPU in float32 or bf16 and packing works in this torch; plain otherwise.

    Args:
        per_step: see :class:`Linear`.
        picked_rows: its rows are picked out of a step, one per sequence (the LM head): every call
            (float32 or bf16) takes the native few-row kernel, so a row's logits never depend on how
            many sequences share its step. Against oneDNN's packed GEMM, SmolLM2-135M's head
            (49,152 x 576) on a 2-core Zen 4 (2026-11-28, one call, medians of 9): bf16 0.56 / 0.60 /
            0.80x the time at 1 / 2 / 3 rows, 1.1-1.5x from 4 rows; float32 0.70x at 1-2 rows,
            1.1-1.5x from 3. On AMX CPUs in bf16 every call takes our AMX GEMM instead (each row's bits
            its own as well; 1-16 rows on tiles of as many rows: 0.27-0.91x the few-row kernel's
            time for that head, :data:`~ragcache_backend.model.kernels.native.AMX_FEW_ROWS`).
            Otherwise float32 calls of up to
            :data:`~ragcache_backend.model.kernels.native.LINEAR_PROMPT_ROWS_F32` rows take it (decode
            rows, a cache hit's new rows) and bf16 calls never (a prompt row's K/V must keep the
            prompt GEMM's bits, whatever the call's size).

    The packed copy adds the weight's size in memory (the plain weight stays for other users); a
    layer GEMM on our AMX GEMM (:attr:`Linear.amx`) has that one instead of oneDNN's.
    """
    weight = weight.detach()
    bias = bias.detach().contiguous() if bias is not None else None
    if picked_rows:
        rows_max = None
    else:  # bf16 prompts keep oneDNN's bits
        rows_max = native.LINEAR_PROMPT_ROWS_F32 if weight.dtype == torch.float32 else 0
    native_ok = native.linear_rows_available(weight)
    rows = rows_max != 0 and native_ok
    decode = per_step and not picked_rows and native_ok
    plain = Linear(weight, bias, per_step=per_step, rows_kernel=rows, rows_max=rows_max, decode_rows=decode)
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return plain
    if picked_rows and weight.dtype == torch.bfloat16 and native.amx_linear_available(weight):
        plain.amx = native.amx_pack(weight, bias)  # the LM head on AMX tiles: 1-16 rows 0.27-0.91x the few-row kernel's time
        return plain
    tiled = _AMX and weight.dtype in _REDUCED and per_step  # only a step's layer GEMMs run tiled (_by_class)
    if tiled and native.amx_linear_available(weight):  # prompt rows in one call of our AMX GEMM
        # no oneDNN copy: the few calls left to it (rows of a step whose row count changed part-way:
        # chunk rows that stop early) take F.linear on the plain weight
        plain.amx = native.amx_pack(weight, bias)
        return plain
    if weight.dtype not in _works:
        _works[weight.dtype] = _packing_works(weight.dtype)
    if not _works[weight.dtype]:
        return plain
    packed = Linear(weight, bias, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()), per_step=per_step,
                    rows_kernel=rows, rows_max=rows_max, decode_rows=decode)
    if tiled:
        packed.tail_tile = _tail_tile(packed)
    return packed
