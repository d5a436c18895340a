"""The plain data of one forward step, and the step's row bookkeeping.

:class:`ForwardInput` is what the engine asks of one sequence in a step (new tokens, the context
already in the arena as :class:`~ragcache_backend.cache.blocks.KVRun`, the chunk-cache extras of
Cache-Craft §3.2-3.4), :class:`StepOutput` what the step returns per sequence.

:class:`StepRows` is internal to the model package: the runner builds it from a batch and the
decoder layers (:mod:`ragcache_backend.model.llama`) read and shrink it as rows stop part-way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ragcache_backend.cache.blocks import KVRun
from ragcache_backend.model.chunk_rows import BlendSelection, ChunkRows, FocusSelection
from ragcache_backend.model.kernels import native
from ragcache_backend.model.kernels.linear import StepRowClasses

__all__ = ["MAX_STAT_SEGMENTS", "ForwardInput", "SegmentAttention", "StepOutput", "StepRows"]


@dataclass(slots=True, frozen=True)
class ForwardInput:
    """One sequence's share of a forward step (plain data from the engine/scheduler).

    Attributes:
        new_tokens: token ids to compute, ``T >= 1``.
        cached: context already in the arena, in order (prefix documents, earlier decode steps).
            With ``positions``: the *whole* context in position order, the new tokens' slots included.
        target: where the new tokens' KV is written, in order; lengths sum to ``T``. Empty with
            ``positions``.
        decode: the one new token is a generated token (decode kernels), not a prompt token. In
            bf16 prompt tokens always take the prefill kernels (exactness); in float32 on the native
            fused path the runner also runs a prompt's one new token over a cached context (no
            chunk-cache extras) on the decode kernels.
        positions: ascending positions of the new tokens inside the context (``< S``), or None for
            the ``T`` positions after ``cached``. Token ``i`` is written at the slot of position
            ``positions[i]`` and attends to positions ``0 .. positions[i]`` (chunk-cache
            recomputation: the other positions hold reused KV).
        stat_segments: lengths (tokens) of consecutive context segments, summing to the context
            length, or None. When given, every new token's attention mass to each segment is
            recorded (Cache-Craft eq. 3-4), averaged over the runner's ``stat_layers`` and one query
            head per KV head (:attr:`StepOutput.attention`). At most 64 segments.
        guard: measure, for every new token, how far its new K/V moved from the values its slot
            held before the write (:attr:`StepOutput.deviation`; the quality guard's signal).
        guard_segments: lengths (tokens, each >= 1) of consecutive context segments summing to the
            context length, or None. When given, the attention mass the last new token (the one
            that yields the logits) gives each segment is recorded, averaged over every layer and
            one query head per KV head (:attr:`StepOutput.last_mass`): how much the next token
            reads each span (the guard weighs reused chunks by it). At most 64 segments.
        blend: stop most reused-chunk rows after an early layer, keeping those whose K/V deviate
            most (CacheBlend-style selection; :class:`~ragcache_backend.model.chunk_rows.BlendSelection`).
        focus: stop the recomputed rows of chunks the question does not focus on, once Algorithm 1
            decides (:class:`~ragcache_backend.model.chunk_rows.FocusSelection`).
    """

    new_tokens: tuple[int, ...]
    cached: tuple[KVRun, ...]
    target: tuple[KVRun, ...]
    decode: bool = False
    positions: tuple[int, ...] | None = None
    stat_segments: tuple[int, ...] | None = None
    guard: bool = False
    blend: BlendSelection | None = None
    focus: FocusSelection | None = None
    guard_segments: tuple[int, ...] | None = None

    @property
    def chunk_rows(self) -> bool:
        """Whether the sequence needs the chunk-cache row bookkeeping (:class:`ChunkRows`): explicit
        positions, attention statistics, the guard, or rows that stop part-way (blend, focus)."""
        return (self.positions is not None or self.stat_segments is not None or self.guard or self.blend is not None
                or self.focus is not None or self.guard_segments is not None)


@dataclass(slots=True, frozen=True)
class SegmentAttention:
    """Attention mass of a sequence's new tokens to each context segment (Cache-Craft eq. 3-4).

    Attributes:
        mass: per new token (in ``new_tokens`` order), per segment of ``stat_segments``: the
            softmax weight it gave that segment's keys, averaged over the recorded layers and one
            query head of each KV group (the first); each row sums to 1 (float32 arithmetic).
    """

    mass: tuple[tuple[float, ...], ...]


@dataclass(slots=True, frozen=True)
class StepOutput:
    """What one forward step returns, per sequence in batch order.

    Attributes:
        logits: float32 ``[vocab]`` for the last new token (``[T, vocab]`` with ``all_logits``).
        attention: :class:`SegmentAttention` where the input asked for ``stat_segments``, else None.
        deviation: where the input asked for ``guard``: per new token, the relative change of its
            K and V from the values its slot held before the write, ``||new - old|| / ||old||``
            averaged over the layers it was computed in (0 for a slot that held zeros); else None.
        depth: per sequence with ``blend`` or ``focus``, the layers each new token was computed in
            (``num_layers`` unless it stopped part-way); None otherwise.
        focus_layer: per sequence, ``L*``: the layers after which Algorithm 1 decided (0: it did not).
        last_mass: per sequence with ``guard_segments``, the last new token's attention mass to
            each of those segments (float32 arithmetic; sums to 1); None otherwise.
    """

    logits: list[torch.Tensor]
    attention: list[SegmentAttention | None]
    deviation: list[tuple[float, ...] | None]
    depth: list[tuple[int, ...] | None] = field(default_factory=list)
    focus_layer: list[int] = field(default_factory=list)
    last_mass: list[tuple[float, ...] | None] = field(default_factory=list)


MAX_STAT_SEGMENTS = 64
"""Most attention-statistics segments one sequence may ask for."""


@dataclass(slots=True)
class StepRows:
    """One forward step's row bookkeeping, updated when rows stop part-way (internal to the model
    package: built by the runner, read and shrunk by the decoder layers).

    The step's ``N`` rows are the new tokens of every sequence, concatenated in batch order.

    Attributes:
        num_layers: decoder layers of the model (rows never stop after the last one).
        native_attention: the native attention kernel serves the ordinary sequences.
        device: where the step's index tensors live (the arena's device).
        lengths: rows per sequence now.
        write: ``[N]`` int64 arena slots the rows' K/V are written to.
        positions: ``[N]`` int64 positions of the rows.
        cached_slots: per sequence, ``[S_cached]`` slots of its cached context (None: cold, or
            explicit positions).
        modes: per sequence, its attention plan (None: explicit positions).
        context: per sequence, ``[S]`` slots of its whole context (native kernel; None: explicit
            positions).
        decode: per sequence, whether its one new token runs as a generated token's row (decode
            kernels): a decode step, and in float32 on the native fused path a prompt's one new
            token over a cached context (the runner decides).
        chunks: the :class:`~ragcache_backend.model.chunk_rows.ChunkRows` of the chunk-cache sequences.
        native_positions: the native kernel also serves the sequences at explicit positions (the
            float32 and bf16 kernels: :func:`~ragcache_backend.model.kernels.native.takes_positions`); else
            their attention is the masked torch one (``ChunkRows.after_write``).
        native_batch: the native kernel's batch over the sequences it serves (None: none, or no kernel).
        native_rows: their rows in the step (None: every row is theirs).
        rope: dtype -> ``(cos, sin)`` tables for ``positions`` (cleared when rows stop).
        gemm_rows: which rows are prompt rows, for the layer GEMMs (updated when rows stop).
        windowed: ``(sequence, window)`` -> its attention plan in sliding-window layers (built on
            first use from ``modes``).
    """

    num_layers: int
    native_attention: bool
    device: torch.device
    lengths: list[int]
    write: torch.Tensor
    positions: torch.Tensor
    cached_slots: list
    modes: list
    context: list
    decode: list[bool]
    chunks: list[ChunkRows]
    native_positions: bool = False
    native_batch: object | None = None
    native_rows: torch.Tensor | None = None
    rope: dict = field(default_factory=dict)
    gemm_rows: StepRowClasses | None = None
    windowed: dict = field(default_factory=dict)

    def classify_rows(self) -> StepRowClasses:
        """The step's rows by class for the layer GEMMs (:func:`~ragcache_backend.model.kernels.linear.step_rows`)."""
        classes = StepRowClasses.of(self.lengths, self.decode)
        if self.gemm_rows is None:
            self.gemm_rows = classes
        else:  # the object the GEMMs' context holds is updated in place
            self.gemm_rows.rows, self.gemm_rows.prompt = classes.rows, classes.prompt
            self.gemm_rows.decode, self.gemm_rows.split = classes.decode, classes.split
        return self.gemm_rows

    @property
    def offsets(self) -> list[int]:
        """Row offset of every sequence, and the total row count last (``len(lengths) + 1`` ints)."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out

    def last_rows(self) -> torch.Tensor:
        """``[B]`` int64 (on :attr:`device`): each sequence's last row in the step, the row its logits
        come from."""
        return (torch.tensor(self.offsets[1:]) - 1).to(self.device)

    def plan_native(self) -> None:
        """The native kernel's batch over the step's sequences as they are now: the ordinary ones,
        and with :attr:`native_positions` those at explicit positions (their rows' current positions;
        rebuilt when rows stop), which otherwise take the torch path. Marks each explicit
        sequence's :class:`~ragcache_backend.model.chunk_rows.ChunkRows` ``native`` accordingly."""
        self.native_batch = self.native_rows = None
        explicit = {c.index: c for c in self.chunks if c.explicit}
        on_native = self.native_attention and self.native_positions
        for c in explicit.values():
            c.native = on_native
        if not self.native_attention:
            return
        served = [i for i in range(len(self.lengths)) if (i not in explicit or on_native) and self.lengths[i] > 0]
        if not served:
            return
        offsets = self.offsets
        self.native_batch = native.attention_batch(
            [explicit[i].context if i in explicit else self.context[i] for i in served], [self.lengths[i] for i in served],
            [self.decode[i] for i in served], [explicit[i].positions if i in explicit else None for i in served])
        if len(served) < len(self.lengths):
            self.native_rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in served])

    def stop_rows(self, layer: int, *rows_tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """After ``layer``: drop the rows that stop (blend, focus) from the step and from each of
        ``rows_tensors`` (``[N, ...]``: the residual stream, the next layer's input)."""
        stops = {c.index: c.rows_to_stop(layer) for c in self.chunks if c.blend is not None or c.focus is not None}
        if not any(stops.values()) or layer + 1 >= self.num_layers:
            return rows_tensors
        offsets = self.offsets
        keep_global, new_lengths = [], list(self.lengths)
        for i, n in enumerate(self.lengths):
            drop = set(stops.get(i, ()))
            local = [r for r in range(n) if r not in drop]
            keep_global.extend(offsets[i] + r for r in local)
            new_lengths[i] = len(local)
        keep = torch.tensor(keep_global, device=self.device)
        self.lengths = new_lengths
        self.write = self.write.index_select(0, keep)
        self.positions = self.positions.index_select(0, keep)
        self.rope.clear()
        new_offsets = self.offsets
        for c in self.chunks:
            drop = set(stops.get(c.index, ()))
            local = torch.tensor([r for r in range(c.hi - c.lo) if r not in drop], dtype=torch.int64, device=self.device)
            c.keep(local, new_offsets[c.index], layer + 1)
        self.plan_native()
        if self.gemm_rows is not None:  # the GEMMs tell rows apart (AMX CPUs)
            self.classify_rows()
        return tuple(t.index_select(0, keep) for t in rows_tensors)

