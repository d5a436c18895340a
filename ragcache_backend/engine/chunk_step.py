"""A chunk-mode request's prefill (Cache-Craft §3.2-3.4): the engine's side, as plain data.

The cache's :class:`~ragcache_backend.cache.lease.ChunkLease` says, for every segment past the exact
prefix, where its KV goes and which cached variant (if any) serves it. This module turns that into
one :class:`~ragcache_backend.model.runner.ForwardInput`:

1. each reused variant's KV is copied into the request's blocks with its keys re-rotated to the new
   position (:meth:`ModelRunner.copy_rerotated`);
2. the new tokens are every token of a fresh segment, the chosen tokens of each reused chunk (eq.
   14) and the prompt's rest, each at its own position, attending causally over the merged context;
3. attention statistics are asked for when a fresh document will become a variant, over the
   prompt's context parts (:func:`context_parts`: the attention sink, each document, and windows of
   16 tokens of any other text, so that a question inside a template counts apart from the
   template's stable instructions; eq. 3-4), and the KV deviation of the recomputed tokens when
   the quality guard is on.

After the forward, :func:`variant_stats` turns the runner's per-row attention mass into each new
variant's statistics and :func:`guard_flags` says which reused chunks moved too far and must be
recomputed in full (a second pass, :func:`build_input` with ``full``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ragcache_backend.cache.chunk_reuse import SINK_KEY, SINK_TOKENS, RecomputeRule, VariantStats, context_keys, stats_from_mass
from ragcache_backend.cache.lease import ChunkLease, ChunkSpec, ContextPart
from ragcache_backend.model.chunk_rows import BlendSelection, FocusSelection
from ragcache_backend.model.runner import MAX_STAT_SEGMENTS, ForwardInput, KVRun, ModelRunner, SegmentAttention
from ragcache_backend.prompts.builder import PromptPlan, SegmentKind

__all__ = ["ChunkLayout", "build_input", "chunk_deviations", "chunk_specs", "context_parts", "context_runs",
           "copy_variants", "guard_flags", "variant_stats"]

_REST_KEY = "<rest>"
TEXT_WINDOW = 16
"""Tokens per context part of non-document text (more when a prompt would exceed the statistics'
segment limit)."""


def context_parts(lead: Sequence, rest_tokens: int) -> list[tuple[ContextPart, ...]]:
    """Per lead segment, its context parts: a document is one part (its key); other text is cut
    into windows of :data:`TEXT_WINDOW` tokens keyed by content; the prompt's first tokens (the
    attention sink, :data:`SINK_TOKENS`) are a part of their own. Windows widen so that the parts
    plus the rest stay within the runner's statistics limit."""
    docs = sum(1 for s in lead if s.kind is SegmentKind.DOCUMENT)
    text = sum(len(s) for s in lead if s.kind is not SegmentKind.DOCUMENT)
    window = max(TEXT_WINDOW, math.ceil(text / max(1, MAX_STAT_SEGMENTS - docs - 3 - len(lead))))
    out = []
    for i, seg in enumerate(lead):
        ids = seg.token_ids
        if seg.kind is SegmentKind.DOCUMENT:
            out.append((ContextPart(seg.key, len(ids)),))
            continue
        parts = []
        start = 0
        if i == 0 and len(ids) > 1:
            start = min(SINK_TOKENS, len(ids) - 1)
            parts.append(ContextPart(SINK_KEY, start))
        for a in range(start, len(ids), window):
            piece = ids[a : a + window]
            digest = hashlib.sha256(",".join(map(str, piece)).encode()).hexdigest()[:16]
            parts.append(ContextPart("w:" + digest, len(piece)))
        out.append(tuple(parts))
    return out


def chunk_specs(lead: Sequence, rest_tokens: int) -> list[ChunkSpec]:
    """The cache's view of a prompt's lead segments (documents are chunks)."""
    return [ChunkSpec(s.key, len(s), s.kind is SegmentKind.DOCUMENT, parts)
            for s, parts in zip(lead, context_parts(lead, rest_tokens))]


@dataclass(slots=True, frozen=True)
class ChunkLayout:
    """How one chunk-mode forward input maps back to the lease's pieces.

    Attributes:
        rows: per piece, the indices (into ``new_tokens``) of its computed tokens.
        recorded: per piece, whether its statistics are recorded (a fresh document's first
            occurrence in the prompt).
        stat_keys, stat_lengths: the statistics segments' ids and token counts (empty: none asked).
        stat_skip: leading statistics segments left out of inter-attention (the sink).
        piece_segment: per piece, the index of its (first) statistics segment.
    """

    rows: tuple[tuple[int, ...], ...]
    recorded: tuple[bool, ...]
    stat_keys: tuple[str, ...]
    stat_lengths: tuple[int, ...]
    stat_skip: int
    piece_segment: tuple[int, ...]


def context_runs(lease: ChunkLease, rest_tokens: int) -> tuple[KVRun, ...]:
    """The prompt's KV in position order: exact prefix nodes, every piece, the prompt's rest."""
    runs = [KVRun(tuple(n.device_blocks or ()), 0, n.num_tokens) for n in lease.prefix]
    runs += [KVRun(tuple(p.blocks), 0, p.spec.num_tokens) for p in lease.pieces]
    runs.append(KVRun(tuple(lease.tail_blocks), 0, rest_tokens))
    return tuple(runs)


def copy_variants(lease: ChunkLease, runner: ModelRunner) -> None:
    """Copy every reused variant's KV into its piece's blocks, keys re-rotated by the position delta."""
    for piece in lease.pieces:
        if piece.use is not None:
            node = piece.use.node
            src = KVRun(tuple(node.device_blocks or ()), 0, node.num_tokens)
            runner.copy_rerotated(src, KVRun(tuple(piece.blocks), 0, piece.spec.num_tokens), piece.use.delta)


def build_input(plan: PromptPlan, lease: ChunkLease, *, rule: RecomputeRule, guard: bool = True,
                full: frozenset[int] = frozenset()) -> tuple[ForwardInput, ChunkLayout]:
    """The forward input of a chunk-mode prefill (after :func:`copy_variants`).

    Args:
        plan: the request's prompt plan (its lead segments match the lease's prefix + pieces).
        lease: the admitted lease.
        rule: the recompute rule (its guard, CacheBlend-style selection and Algorithm 1 window).
        guard: ask for the KV deviation when the rule has a guard (False for the guard's own pass).
        full: indices of reused pieces to recompute in full (the guard's second pass: no row stops).

    Returns:
        the input and its :class:`ChunkLayout`.
    """
    lead = plan.lead
    n_prefix = len(lease.prefix)
    pos = lease.cached_tokens
    new_tokens: list[int] = []
    positions: list[int] = []
    rows: list[tuple[int, ...]] = []
    for i, (piece, seg) in enumerate(zip(lease.pieces, lead[n_prefix:])):
        offsets = range(piece.spec.num_tokens) if piece.use is None or i in full else piece.use.recompute
        rows.append(tuple(range(len(new_tokens), len(new_tokens) + len(offsets))))
        new_tokens.extend(seg.token_ids[o] for o in offsets)
        positions.extend(pos + o for o in offsets)
        pos += piece.spec.num_tokens
    new_tokens.extend(plan.rest)
    positions.extend(range(pos, pos + len(plan.rest)))
    parts = context_parts(lead, len(plan.rest))
    first_part, flat = [], []
    for seg_parts in parts:
        first_part.append(len(flat))
        flat.extend(seg_parts)
    keys = context_keys([part.key for part in flat])
    recorded = tuple(
        piece.spec.chunk and (piece.use is None or i in full) and keys[first_part[n_prefix + i]] == piece.spec.key
        for i, piece in enumerate(lease.pieces))
    skip = 1 if flat and flat[0].key == SINK_KEY else 0
    stat_lengths = [part.num_tokens for part in flat] + [len(plan.rest)]
    stat_keys = keys + (_REST_KEY,)
    if not any(recorded) or len(stat_lengths) > MAX_STAT_SEGMENTS:
        recorded, stat_keys, stat_lengths = (False,) * len(lease.pieces), (), []
    runs = context_runs(lease, len(plan.rest))
    blend = focus = None
    reused = [i for i, p in enumerate(lease.pieces) if p.use is not None and i not in full and rows[i]]
    if not full and reused and rule.kind == "blend":
        blend = BlendSelection(tuple(rows[i] for i in reused), rule.share, layer=1)
    elif not full and reused and rule.focus_window is not None:
        focus = _focus(lead, lease, rows, len(new_tokens), rule.focus_window)
    stats = tuple(stat_lengths) if stat_keys else None
    guarded = guard and rule.guard is not None and bool(reused)  # nothing reused: no deviation to measure
    if len(positions) == pos + len(plan.rest) - lease.cached_tokens and blend is None and focus is None:
        # every token past the prefix is computed through every layer: an ordinary prefill over the
        # prefix, which takes the causal kernels instead of a masked one
        item = ForwardInput(tuple(new_tokens), runs[:n_prefix], runs[n_prefix:], stat_segments=stats, guard=guarded)
    else:
        item = ForwardInput(tuple(new_tokens), runs, (), positions=tuple(positions), stat_segments=stats,
                            guard=guarded, blend=blend, focus=focus)
    layout = ChunkLayout(tuple(rows), recorded, stat_keys, tuple(stat_lengths), skip,
                         tuple(first_part[n_prefix + i] for i in range(len(lease.pieces))))
    return item, layout


def _focus(lead, lease: ChunkLease, rows: list[tuple[int, ...]], num_rows: int, window: int) -> FocusSelection | None:
    """Algorithm 1's input: every document's span, the stoppable rows of the reused ones, and the
    rows after the last document as the question (they attend to every chunk); None with fewer
    than three documents (the algorithm needs a gap between two groups)."""
    n_prefix, spans, groups, pos = len(lease.prefix), [], [], 0
    last_doc_row = -1
    for i, seg in enumerate(lead):
        if seg.kind is SegmentKind.DOCUMENT:
            spans.append((pos, pos + len(seg)))
            j = i - n_prefix
            piece_rows = rows[j] if j >= 0 else ()
            groups.append(piece_rows if j >= 0 and lease.pieces[j].use is not None else ())
            if j >= 0 and piece_rows:
                last_doc_row = max(last_doc_row, piece_rows[-1])
        pos += len(seg)
    question = tuple(range(last_doc_row + 1, num_rows))
    if len(spans) < 3 or not question:
        return None
    return FocusSelection(tuple(spans), tuple(groups), question, window)


def recomputed_tokens(lease: ChunkLease, layout: ChunkLayout, depth: Sequence[int] | None, num_layers: int) -> int:
    """Tokens of reused chunks recomputed, in full-depth equivalents: a token recomputed through
    ``l`` of ``L`` layers (CacheBlend-style selection, Algorithm 1) counts ``l / L``."""
    total = 0.0
    for piece, rows in zip(lease.pieces, layout.rows):
        if piece.use is None:
            continue
        total += sum(depth[r] for r in rows) / num_layers if depth is not None else len(rows)
    return round(total)


def variant_stats(lease: ChunkLease, layout: ChunkLayout, attention: SegmentAttention | None) -> list[VariantStats | None]:
    """Per piece, the statistics of the variant it becomes (None: not recorded)."""
    out: list[VariantStats | None] = []
    for piece, rows, rec, own in zip(lease.pieces, layout.rows, layout.recorded, layout.piece_segment):
        if not rec or attention is None or not rows:
            out.append(None)
            continue
        mass = [attention.mass[r] for r in rows]
        out.append(stats_from_mass(piece.spec.key, mass, own, layout.stat_keys, layout.stat_lengths, layout.stat_skip))
    return out


def chunk_deviations(lease: ChunkLease, layout: ChunkLayout, deviation: Sequence[float] | None) -> dict[int, float]:
    """Per reused piece with recomputed tokens: the mean relative change of those tokens' K/V
    (the quality guard's signal; how far reuse had moved this chunk's computation)."""
    if deviation is None:
        return {}
    return {i: sum(deviation[r] for r in rows) / len(rows)
            for i, (piece, rows) in enumerate(zip(lease.pieces, layout.rows)) if piece.use is not None and rows}


def guard_flags(deviations: dict[int, float], threshold: float | None) -> frozenset[int]:
    """Indices of reused pieces whose recomputed tokens' K/V moved by more than ``threshold``:
    their cached KV was too far from this context to serve it."""
    if threshold is None:
        return frozenset()
    return frozenset(i for i, d in deviations.items() if d > threshold)
