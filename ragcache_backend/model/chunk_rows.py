"""Per-layer work of a forward step's chunk-cache sequences (Cache-Craft §3.2-3.4), for the runner.

A sequence needs this module when its new tokens sit at explicit positions inside the context (the
recomputed tokens of reused chunks), when it records attention statistics (eq. 3-4), measures how
far its recomputed K/V moved (the quality guard), or stops recomputing some rows part-way through
the layers:

* :class:`BlendSelection` (CacheBlend-style selection): every token of the reused chunks is
  recomputed through ``layer``; there each chunk keeps its ``share`` of tokens whose K/V deviate
  most from the cached values, and the others stop (their cached KV serves the later layers).
* :class:`FocusSelection` (Cache-Craft Algorithm 1, focused-chunk early termination): after every
  layer the question rows' attention to each chunk is accumulated; once the set of focused chunks
  is stable for ``window`` layers, the recomputed tokens of unfocused reused chunks stop.

Accumulators are kept per *original* row (the order of ``new_tokens``), so the outputs need no
remapping when rows stop; ``alive`` maps the rows still computed to their original index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ragcache_backend.cache.chunk_reuse import FocusTracker
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.kernels import chunk_stats, position_mask, segment_attention_mass

__all__ = ["BlendSelection", "ChunkRows", "FocusSelection"]


@dataclass(slots=True, frozen=True)
class BlendSelection:
    """CacheBlend-style token selection by measured KV deviation.

    Attributes:
        groups: per reused chunk, the indices (into ``new_tokens``) of its rows (all its tokens).
        share: the share of each group kept past ``layer``, [0, 1] (at least one row per group).
        layer: the layer (0-based) whose K/V deviation picks the rows; CacheBlend uses an early
            layer (1: the first whose K/V depend on the context).
    """

    groups: tuple[tuple[int, ...], ...]
    share: float
    layer: int = 1


@dataclass(slots=True, frozen=True)
class FocusSelection:
    """Focused-chunk early termination (Cache-Craft §3.2.2, Algorithm 1).

    Attributes:
        chunks: ``(start, end)`` positions of every retrieved chunk in the prompt, in order.
        groups: per chunk (same order), the indices (into ``new_tokens``) of its rows that may stop
            (recomputed tokens of a reused chunk; empty for a chunk computed in full).
        question: indices (into ``new_tokens``) of the rows standing for the question ``U`` (the
            prompt's tail, which attends to every chunk).
        window: ``w``, layers the focused set must stay unchanged.
    """

    chunks: tuple[tuple[int, int], ...]
    groups: tuple[tuple[int, ...], ...]
    question: tuple[int, ...]
    window: int = 3


@dataclass(slots=True, eq=False)
class ChunkRows:
    """One sequence's chunk-cache state through the layers of a step (tensors; runner-internal).

    Attributes:
        index: the sequence's place in the batch.
        lo, hi: its rows in the step now (they move when rows stop).
        context: ``[S]`` arena slots of its context in position order.
        positions: ``[T]`` positions of the rows still computed.
        write: ``[T]`` their slots.
        explicit: the rows sit at explicit positions inside the context (else: an ordinary suffix).
        native: the native kernel computes their attention over explicit positions (set by
            :meth:`~ragcache_backend.model.forward.StepRows.plan_native`); else :meth:`after_write`
            does, with the masked torch attention.
        bias: ``[T, S]`` additive mask of the explicit positions in ``dtype``, built on first use by
            the torch attention (None until then, and after rows stop).
        dtype: the model dtype (the mask's).
        alive: ``[T]`` original row index of each row still computed.
        segments, num_segments: statistics segment of every context key (None: no statistics).
        segment_offsets: ``[nseg + 1]`` int64 (CPU) boundaries of those segments, for the native
            statistics kernel.
        mass: ``[n, nseg]`` float32 attention mass per original row, summed over heads and layers.
        deviation, dev_layers: ``[n]`` K/V deviation summed over layers, and layers measured.
        guard: measure the deviation on every layer.
        blend, focus: row selections (see the module doc).
        focus_segments: ``[S]`` chunk index of every context key for Algorithm 1 (``k``: no chunk).
        tracker: Algorithm 1's state.
        stopped: original row -> layers it was computed in, for rows that stopped early.
        focus_layer: ``L*`` once Algorithm 1 decided (0 before).
        window_bias: sliding window -> ``bias`` limited to it (built on first use, dropped when rows stop).
        last_mass: ``[nseg]`` float32 attention mass of the last row (the one that yields the
            logits) to each guard segment, summed over layers and one query head per KV head
            (None: not asked); ``guard_offsets`` ``[nseg + 1]`` and ``guard_ids`` ``[S]`` describe
            those segments for the native and the torch kernel.
    """

    index: int
    lo: int
    hi: int
    context: torch.Tensor
    positions: torch.Tensor
    write: torch.Tensor
    explicit: bool
    dtype: torch.dtype
    alive: torch.Tensor
    segments: torch.Tensor | None
    num_segments: int
    mass: torch.Tensor | None
    deviation: torch.Tensor | None
    dev_layers: torch.Tensor | None
    guard: bool
    blend: BlendSelection | None = None
    focus: FocusSelection | None = None
    focus_segments: torch.Tensor | None = None
    tracker: FocusTracker | None = None
    native: bool = False
    bias: torch.Tensor | None = None
    stopped: dict[int, int] = field(default_factory=dict)
    focus_layer: int = 0
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    segment_offsets: torch.Tensor | None = None
    last_mass: torch.Tensor | None = None
    guard_offsets: torch.Tensor | None = None
    guard_ids: torch.Tensor | None = None
    _blend_dev: torch.Tensor | None = None

    # ---- set-up ----------------------------------------------------------------------------------
    @staticmethod
    def create(index: int, row: int, n: int, context: torch.Tensor, positions: torch.Tensor, explicit: bool,
               stat_segments: tuple[int, ...] | None, guard: bool, blend: BlendSelection | None,
               focus: FocusSelection | None, dtype: torch.dtype, max_segments: int,
               guard_segments: tuple[int, ...] | None = None) -> ChunkRows:
        """Validate a sequence's chunk-cache extras and build its state.

        Raises:
            InvalidRequestError: statistics or guard segments that do not cover the context, selections that
                name rows out of range or the sequence's last row (it yields the logits), a share
                outside [0, 1], a focus window below 1 or chunk ranges outside the context.
        """
        s, dev = context.numel(), context.device
        segments, mass, offsets = None, None, None
        if stat_segments is not None:
            if sum(stat_segments) != s or min(stat_segments, default=0) < 1 or len(stat_segments) > max_segments:
                raise InvalidRequestError(f"statistics segments {list(stat_segments)} must cover the {s}-token context, "
                                          f"each >= 1 token, at most {max_segments}")
            segments = torch.repeat_interleave(torch.arange(len(stat_segments)), torch.tensor(stat_segments)).to(dev)
            mass = torch.zeros(n, len(stat_segments), dtype=torch.float32, device=dev)
            offsets = torch.tensor((0, *stat_segments), dtype=torch.int64).cumsum(0)
        selectable = [r for group in (blend.groups if blend else ()) + (focus.groups if focus else ()) for r in group]
        if any(not 0 <= r < n - 1 for r in selectable) or (focus and any(not 0 <= r < n for r in focus.question)):
            raise InvalidRequestError(f"row selections must name rows 0 .. {n - 2} (the last row yields the logits)")
        if blend is not None and not 0.0 <= blend.share <= 1.0:
            raise InvalidRequestError(f"blend share must be in [0, 1], got {blend.share}")
        focus_segments = tracker = None
        if focus is not None:
            if focus.window < 1 or len(focus.groups) != len(focus.chunks) or any(not 0 <= a < b <= s for a, b in focus.chunks):
                raise InvalidRequestError("focus selection: window >= 1, one group per chunk, chunk ranges inside the context")
            focus_segments = torch.full((s,), len(focus.chunks), dtype=torch.int64)
            for i, (a, b) in enumerate(focus.chunks):
                focus_segments[a:b] = i
            focus_segments = focus_segments.to(dev)
            tracker = FocusTracker(window=focus.window)
        write = context.index_select(0, positions) if explicit else context[s - n:]
        last_mass = guard_offsets = guard_ids = None
        if guard_segments is not None:
            if sum(guard_segments) != s or min(guard_segments, default=0) < 1 or len(guard_segments) > max_segments:
                raise InvalidRequestError(f"guard segments {list(guard_segments)} must cover the {s}-token context, "
                                          f"each >= 1 token, at most {max_segments}")
            guard_ids = torch.repeat_interleave(torch.arange(len(guard_segments)), torch.tensor(guard_segments)).to(dev)
            guard_offsets = torch.tensor((0, *guard_segments), dtype=torch.int64).cumsum(0)
            last_mass = torch.zeros(len(guard_segments), dtype=torch.float32, device=dev)
        track = guard or blend is not None
        return ChunkRows(index, row, row + n, context, positions, write, explicit, dtype, torch.arange(n, device=dev), segments,
                         len(stat_segments or ()), mass,
                         torch.zeros(n, dtype=torch.float32, device=dev) if track else None,
                         torch.zeros(n, dtype=torch.float32, device=dev) if track else None,
                         guard, blend, focus, focus_segments, tracker, segment_offsets=offsets, last_mass=last_mass,
                         guard_offsets=guard_offsets, guard_ids=guard_ids)

    # ---- per layer -------------------------------------------------------------------------------
    def before_write(self, kc: torch.Tensor, vc: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The slots' contents before this layer's write, where the deviation is measured (in the
        arena's dtype where the native kernel measures it, else in float32)."""
        if self.guard or (self.blend is not None and layer == self.blend.layer):
            k_old, v_old = kc.index_select(0, self.write), vc.index_select(0, self.write)
            return (k_old, v_old) if chunk_stats.kv_deviation_available(kc) else (k_old.float(), v_old.float())
        return None

    def _bias(self, window: int | None) -> torch.Tensor:
        """The explicit positions' additive mask ``[T, S]`` (keys ``0 .. pos``), limited to a sliding
        window (keys ``pos - window + 1 .. pos``); built on first use."""
        if self.bias is None:
            mask = position_mask(self.positions.cpu(), self.context.numel())
            self.bias = torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(~mask, float("-inf")).to(self.context.device)
        if window is None:
            return self.bias
        if window not in self.window_bias:
            keys = torch.arange(self.context.numel(), device=self.bias.device)
            outside = keys[None, :] <= self.positions.to(self.bias.device)[:, None] - window
            self.window_bias[window] = self.bias.masked_fill(outside, float("-inf"))
        return self.window_bias[window]

    def after_write(self, before, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, a: torch.Tensor, layer: int,
                    scale: float, attention: Callable, stat_layer: bool, window: int | None = None) -> None:
        """After the rows' K/V were written: attention over explicit positions (into ``a``, unless
        the native kernel already computed it: :attr:`native`), statistics, deviation, Algorithm 1's
        update; ``window`` is the layer's sliding window (None: full attention)."""
        qs = q[self.lo : self.hi]
        stats = self.mass is not None and stat_layer
        native_stats = stats and window is None and chunk_stats.segment_mass_available(qs, kc)  # keys read in place
        masked = self.explicit and not self.native
        need_k = masked or (stats and not native_stats) or self.focus is not None
        ctx_k = kc.index_select(0, self.context) if need_k else None
        if masked:
            a[self.lo : self.hi] = attention(qs, ctx_k, vc.index_select(0, self.context), scale=scale, mask=self._bias(window))
        if stats:  # one query head per KV head (heads of a group see the same keys)
            group = qs.shape[1] // kc.shape[1]
            if native_stats:
                m = chunk_stats.segment_mass(qs[:, ::group], kc, self.context, self.positions, self.segment_offsets, scale)
            else:
                m = segment_attention_mass(qs[:, ::group], ctx_k, self.positions, self.segments, self.num_segments,
                                           scale=scale, window=window)
            self.mass.index_add_(0, self.alive, m.sum(dim=1))
        if before is not None:
            k_old, v_old = before
            if k_old.dtype == kc.dtype and chunk_stats.kv_deviation_available(kc):  # one pass, no conversions
                dev = chunk_stats.kv_deviation(kc, vc, self.write, k_old, v_old)
            else:  # the reference form
                new = torch.cat((kc.index_select(0, self.write).float().flatten(1),
                                 vc.index_select(0, self.write).float().flatten(1)), 1)
                old = torch.cat((k_old.float().flatten(1), v_old.float().flatten(1)), 1)
                ref = old.norm(dim=1)
                dev = torch.where(ref > 0, (new - old).norm(dim=1) / ref.clamp_min(1e-6), torch.zeros_like(ref))
            if self.blend is not None and layer == self.blend.layer:
                self._blend_dev = dev
            if self.guard:
                self.deviation.index_add_(0, self.alive, dev)
                self.dev_layers.index_add_(0, self.alive, torch.ones_like(dev))
        if self.focus is not None and self.tracker.focused is None:
            self._feed_focus(qs, ctx_k, scale, window)
        if self.last_mass is not None:
            self._feed_last(qs, kc, ctx_k, scale, window)

    def _feed_last(self, qs: torch.Tensor, kc: torch.Tensor, ctx_k: torch.Tensor | None, scale: float,
                   window: int | None) -> None:
        """Add the last row's attention mass to each guard segment (one query head per KV head)."""
        group = qs.shape[1] // kc.shape[1]
        q, pos = qs[-1:, ::group], self.positions[-1:]  # the last row never stops
        if window is None and chunk_stats.segment_mass_available(q, kc):
            m = chunk_stats.segment_mass(q, kc, self.context, pos, self.guard_offsets, scale)
        else:
            keys = ctx_k if ctx_k is not None else kc.index_select(0, self.context)
            m = segment_attention_mass(q, keys, pos, self.guard_ids, self.last_mass.numel(), scale=scale, window=window)
        self.last_mass += m[0].sum(dim=0)

    def _feed_focus(self, qs: torch.Tensor, ctx_k: torch.Tensor, scale: float, window: int | None) -> None:
        local = {int(o): i for i, o in enumerate(self.alive.tolist())}
        rows = [local[r] for r in self.focus.question if r in local]
        if not rows:
            return
        idx = torch.tensor(rows, device=qs.device)
        k = len(self.focus.chunks)
        m = segment_attention_mass(qs.index_select(0, idx), ctx_k, self.positions.index_select(0, idx),
                                   self.focus_segments, k + 1, scale=scale, window=window)  # [U, Hq, k + 1]
        self.tracker.feed(m[..., :k].mean(dim=1).sum(dim=0).tolist())

    def rows_to_stop(self, layer: int) -> list[int]:
        """Local indices of rows that stop after ``layer`` (blend at its layer; focus once decided)."""
        stop: set[int] = set()
        if self.blend is not None and layer == self.blend.layer and self._blend_dev is not None:
            dev = self._blend_dev.tolist()
            local = {int(o): i for i, o in enumerate(self.alive.tolist())}
            for group in self.blend.groups:
                rows = [local[r] for r in group if r in local]
                keep = max(1, round(self.blend.share * len(rows))) if rows else 0
                ranked = sorted(rows, key=lambda i: (-dev[i], i))
                stop.update(ranked[keep:])
            self._blend_dev = None
        if self.focus is not None and self.tracker.focused is not None and not self.focus_layer:
            self.focus_layer = layer + 1
            local = {int(o): i for i, o in enumerate(self.alive.tolist())}
            for c, group in enumerate(self.focus.groups):
                if c not in self.tracker.focused:
                    stop.update(local[r] for r in group if r in local)
        return sorted(stop)

    def keep(self, local_keep: torch.Tensor, new_lo: int, layers_done: int) -> None:
        """Keep only the local rows ``local_keep`` (ascending) from the next layer on; the others
        stop with ``layers_done`` layers computed."""
        gone = set(range(self.hi - self.lo)) - set(local_keep.tolist())
        self.stopped.update((int(self.alive[i]), layers_done) for i in gone)
        self.alive = self.alive.index_select(0, local_keep)
        self.positions = self.positions.index_select(0, local_keep)
        self.write = self.write.index_select(0, local_keep)
        self.bias = None  # rebuilt from the kept positions on first use
        self.window_bias.clear()
        self.lo, self.hi = new_lo, new_lo + local_keep.numel()
