"""From a request's lease to the runner's input and back, in every reuse mode (plain data).

The cache's :class:`~ragcache_backend.cache.lease.Lease` says, for every lead segment past the
reused prefix, where its KV goes and which cached chunk variant (if any) serves it (Cache-Craft
§3, chunk modes only). This module is the one place that turns it into a
:class:`~ragcache_backend.model.forward.ForwardInput`, and the forward's outputs back into what
the cache records:

1. :func:`lead_specs`: the cache's view of a prompt's lead (documents are chunks in the chunk modes);
2. :func:`prefill_input`: each reused variant's KV is copied into the request's blocks with its keys
   re-rotated to the new position (:meth:`KVArena.copy_rerotated`); the new tokens are every token
   of a fresh segment, the chosen tokens of each reused chunk (eq. 14) and the prompt's rest, each
   at its own position. An exact request is the case with nothing reused: an ordinary prefill
   over its prefix. Attention statistics are asked for when a fresh document will become a
   variant, over the prompt's context parts (:func:`context_parts`: the attention sink, each
   document, and windows of 16 tokens of any other text, eq. 3-4), and the KV deviation of the
   recomputed tokens when the quality guard is on;
   A prefill with nothing reused (exact mode) may instead be computed in chunks over several
   steps (vLLM's and SGLang's chunked prefill): :func:`prefill_chunk_input` gives chunk ``k``
   with the prefix's runs and the earlier chunks' runs as cached context and its own as target,
   and :func:`complete_pieces` says which lead segments the chunks computed so far completed
   (committed at once, :meth:`TieredCache.commit_prefix`);
3. :func:`decode_input`: one generated token over the whole context;
4. when a request finishes: :func:`tail_block_specs` (the full blocks it computed past its lead,
   block nodes for the next turn of a chat);
5. after the forward: :func:`variant_stats` (each new variant's statistics), :func:`guard_flags`
   (reused chunks that moved too far and are recomputed in full by a second pass, :func:`prefill_input`
   with ``full``) and :func:`recomputed_tokens`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ragcache_backend.cache.blocks import KVRun
from ragcache_backend.cache.chunk_reuse import SINK_KEY, SINK_TOKENS, RecomputeRule, VariantStats, context_keys, stats_from_mass
from ragcache_backend.cache.lease import ContextPart, Lease, SegmentSpec
from ragcache_backend.engine.request import ChunkReuse
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.arena import KVArena
from ragcache_backend.model.chunk_rows import BlendSelection, FocusSelection
from ragcache_backend.model.forward import MAX_STAT_SEGMENTS, ForwardInput, SegmentAttention
from ragcache_backend.prompts.builder import PromptPlan, Segment, SegmentKind, split_blocks

__all__ = ["ChunkLayout", "chunk_attention", "chunk_deviations", "chunk_reuse", "complete_pieces", "context_parts", "copy_variants", "decode_input",
           "guard_flags", "guard_signals", "lead_specs", "prefill_chunk_input", "prefill_input", "prefill_tokens", "recomputed_tokens", "rows_from",
           "tail_block_specs", "variant_stats"]

_REST_KEY = "<rest>"
TEXT_WINDOW = 16
"""Tokens per context part of non-document text (more when a prompt would exceed the statistics'
segment limit)."""


def context_parts(lead: Sequence[Segment]) -> list[tuple[ContextPart, ...]]:
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


def lead_specs(lead: Sequence[Segment], *, chunks: bool) -> list[SegmentSpec]:
    """The cache's view of a prompt's lead segments: with ``chunks`` (the chunk modes) documents
    are chunks, and every segment carries its context parts; otherwise plain exact segments."""
    if not chunks:
        return [SegmentSpec(s.key, len(s), token_ids=s.token_ids) for s in lead]
    return [SegmentSpec(s.key, len(s), s.kind is SegmentKind.DOCUMENT, parts, s.token_ids)
            for s, parts in zip(lead, context_parts(lead))]


@dataclass(slots=True, frozen=True)
class ChunkLayout:
    """How one prefill input maps back to the lease's pieces.

    Attributes:
        rows: per piece, the indices (into ``new_tokens``) of its computed tokens.
        recorded: per piece, whether its statistics are recorded (a fresh document's first
            occurrence in the prompt).
        stat_keys, stat_lengths: the statistics segments' ids and token counts (empty: none asked).
        stat_skip: leading statistics segments left out of inter-attention (the sink).
        piece_segment: per piece, the index of its (first) statistics segment.
        guard_pieces: ``(piece, segment)`` for each reused piece whose span is a guard segment
            (:attr:`ForwardInput.guard_segments`: the last row's attention to it is measured).
    """

    rows: tuple[tuple[int, ...], ...]
    recorded: tuple[bool, ...]
    stat_keys: tuple[str, ...]
    stat_lengths: tuple[int, ...]
    stat_skip: int
    piece_segment: tuple[int, ...]
    guard_pieces: tuple[tuple[int, int], ...] = ()


def copy_variants(lease: Lease, arena: KVArena) -> None:
    """Copy every reused variant's KV into its piece's blocks, keys re-rotated by the position delta."""
    for piece in lease.pieces:
        if piece.use is not None:
            node = piece.use.node
            src = KVRun(tuple(node.device_blocks or ()), 0, node.num_tokens)
            arena.copy_rerotated(src, KVRun(tuple(piece.blocks), 0, piece.spec.num_tokens), piece.use.delta)


def prefill_input(plan: PromptPlan, lease: Lease, *, rule: RecomputeRule, guard: bool = True,
                  full: frozenset[int] = frozenset()) -> tuple[ForwardInput, ChunkLayout]:
    """The forward input of a prefill (after :func:`copy_variants` when chunks are reused).

    Args:
        plan: the request's prompt plan (its lead segments match the lease's prefix + pieces).
        lease: the admitted lease.
        rule: the recompute rule (its guard, CacheBlend-style selection and Algorithm 1 window).
        guard: ask for the KV deviation when the rule has a guard (False for the guard's own pass).
        full: indices of reused pieces to recompute in full (the guard's second pass: no row stops).
            The pieces before the first of them are not computed again (their KV, written by the
            first pass, did not depend on what follows): their rows are empty in the layout.

    Returns:
        the input and its :class:`ChunkLayout`.
    """
    lead = plan.lead
    n_prefix = len(lease.prefix)
    pos = lease.cached_tokens
    first = min(full, default=0)
    new_tokens: list[int] = []
    positions: list[int] = []
    rows: list[tuple[int, ...]] = []
    for i, (piece, seg) in enumerate(zip(lease.pieces, lead[n_prefix:])):
        if i < first:
            offsets = range(0)
        else:
            offsets = range(piece.spec.num_tokens) if piece.use is None or i in full else piece.use.recompute
        rows.append(tuple(range(len(new_tokens), len(new_tokens) + len(offsets))))
        new_tokens.extend(seg.token_ids[o] for o in offsets)
        positions.extend(pos + o for o in offsets)
        pos += piece.spec.num_tokens
    new_tokens.extend(plan.rest)
    positions.extend(range(pos, pos + len(plan.rest)))
    recorded, stat_keys, stat_lengths, skip, piece_segment = _statistics(plan, lease, full)
    runs = lease.context_runs(len(plan.rest))
    blend = focus = None
    reused = [i for i, p in enumerate(lease.pieces) if p.use is not None and i not in full and rows[i]]
    if not full and reused and rule.kind == "blend":
        blend = BlendSelection(tuple(rows[i] for i in reused), rule.share, layer=1)
    elif not full and reused and rule.focus_window is not None:
        focus = _focus(lead, lease, rows, len(new_tokens), rule.focus_window)
    stats = tuple(stat_lengths) if stat_keys else None
    guarded = guard and rule.guard is not None and bool(reused)  # nothing recomputed: no deviation to measure
    served = [i for i, p in enumerate(lease.pieces) if p.use is not None and i not in full]  # every reused chunk
    spans, guard_pieces = _guard_segments(lease, served, pos + len(plan.rest)) if guarded else (None, ())
    skipped = sum(p.spec.num_tokens for p in lease.pieces[:first])
    if len(positions) == pos + len(plan.rest) - lease.cached_tokens - skipped and blend is None and focus is None:
        # every token past the prefix (and the pieces a second pass keeps) is computed through every
        # layer: an ordinary prefill over them, which takes the causal kernels instead of a masked one
        # (always so in exact mode)
        item = ForwardInput(tuple(new_tokens), runs[:n_prefix + first], runs[n_prefix + first:], stat_segments=stats,
                            guard=guarded, guard_segments=spans)
    else:
        item = ForwardInput(tuple(new_tokens), runs, (), positions=tuple(positions), stat_segments=stats,
                            guard=guarded, blend=blend, focus=focus, guard_segments=spans)
    return item, ChunkLayout(tuple(rows), recorded, stat_keys, tuple(stat_lengths), skip, piece_segment, guard_pieces)


def _guard_segments(lease: Lease, reused: Sequence[int],
                    total: int) -> tuple[tuple[int, ...] | None, tuple[tuple[int, int], ...]]:
    """The guard's segments of a ``total``-token context: each reused piece's span, and the text
    between them; with the segment each reused piece is measured by. Past :data:`MAX_STAT_SEGMENTS`
    spans, consecutive spans are merged in equal groups (at most that many): a piece then gets its
    group's mass, an upper bound on its own, never the unweighted deviation (which the guard's
    threshold is not set for)."""
    spans: list[tuple[int, int | None]] = []  # (tokens, the reused piece or None for text between)
    at = 0
    for i in reused:
        piece = lease.pieces[i]
        if piece.start > at:
            spans.append((piece.start - at, None))
        spans.append((piece.spec.num_tokens, i))
        at = piece.start + piece.spec.num_tokens
    if total > at:
        spans.append((total - at, None))
    per = -(-len(spans) // MAX_STAT_SEGMENTS)  # spans per segment: 1 unless there are too many
    lengths = tuple(sum(n for n, _ in spans[j : j + per]) for j in range(0, len(spans), per))
    return lengths, tuple((i, j // per) for j, (_, i) in enumerate(spans) if i is not None)


def prefill_tokens(plan: PromptPlan, lease: Lease) -> int:
    """Tokens an exact prefill computes: every piece's (the lead past the reused prefix), then the
    prompt's rest; >= 1 (the rest holds at least the prompt's last token)."""
    return lease.pending_tokens + len(plan.rest)


def prefill_chunk_input(plan: PromptPlan, lease: Lease, start: int, count: int) -> ForwardInput:
    """Chunk ``[start, start + count)`` of an exact prefill's tokens (every piece's, then the rest;
    vLLM's and SGLang's chunked prefill). Its cached context is the prefix's runs and the runs
    the earlier chunks wrote, its target this chunk's runs: an ordinary prefill over that
    context, which equals the unchunked one (the same causal attention over the same KV). With
    ``start=0`` and every token it is the whole prefill.

    Raises:
        InvalidRequestError: a lease with a chunk variant in use (its prefill is computed whole,
            :func:`prefill_input`), or a chunk outside the prefill's tokens.
    """
    if lease.chunk_hits:
        raise InvalidRequestError("a prefill that reuses chunk variants is computed whole")
    total = prefill_tokens(plan, lease)
    if start < 0 or count < 1 or start + count > total:
        raise InvalidRequestError(f"chunk [{start}, {start + count}) is outside a prefill of {total} tokens")
    tokens: list[int] = []
    for seg in plan.lead[len(lease.prefix):]:
        tokens.extend(seg.token_ids)
    tokens.extend(plan.rest)
    runs = lease.piece_runs(len(plan.rest))
    return ForwardInput(tuple(tokens[start:start + count]), lease.prefix_runs() + _slice_runs(runs, 0, start),
                        _slice_runs(runs, start, start + count))


def _slice_runs(runs: Sequence[KVRun], lo: int, hi: int) -> tuple[KVRun, ...]:
    """Tokens ``[lo, hi)`` of the concatenation of ``runs``, as runs (empty ones left out)."""
    out, offset = [], 0
    for run in runs:
        a, b = max(lo, offset), min(hi, offset + run.length)
        if a < b:
            out.append(KVRun(run.blocks, run.start + a - offset, b - a))
        offset += run.length
    return tuple(out)


def complete_pieces(lease: Lease, computed: int) -> int:
    """How many leading pieces an exact prefill's first ``computed`` tokens cover whole (the
    pieces a chunked prefill may commit now)."""
    done, end = 0, 0
    for piece in lease.pieces:
        end += piece.spec.num_tokens
        if end > computed:
            break
        done += 1
    return done


def _statistics(plan: PromptPlan, lease: Lease, full: frozenset[int]):
    """Which pieces record variant statistics, and the statistics segments (none in exact mode)."""
    n_prefix, none = len(lease.prefix), (False,) * len(lease.pieces)
    if not any(p.spec.chunk and (p.use is None or i in full) for i, p in enumerate(lease.pieces)):
        return none, (), [], 0, (0,) * len(lease.pieces)
    first_part, flat = [], []
    for seg_parts in context_parts(plan.lead):
        first_part.append(len(flat))
        flat.extend(seg_parts)
    keys = context_keys([part.key for part in flat])
    recorded = tuple(
        piece.spec.chunk and (piece.use is None or i in full) and keys[first_part[n_prefix + i]] == piece.spec.key
        for i, piece in enumerate(lease.pieces))
    skip = 1 if flat and flat[0].key == SINK_KEY else 0
    stat_lengths = [part.num_tokens for part in flat] + [len(plan.rest)]
    stat_keys = keys + (_REST_KEY,)
    piece_segment = tuple(first_part[n_prefix + i] for i in range(len(lease.pieces)))
    if not any(recorded) or len(stat_lengths) > MAX_STAT_SEGMENTS:
        return none, (), [], skip, piece_segment
    return recorded, stat_keys, stat_lengths, skip, piece_segment


def _focus(lead, lease: Lease, rows: list[tuple[int, ...]], num_rows: int, window: int) -> FocusSelection | None:
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


def decode_input(lease: Lease, token: int, position: int) -> ForwardInput:
    """The one-token decode step feeding ``token`` (the last sampled one), which sits ``position``
    tokens past the lead."""
    context, target = lease.decode_runs(position)
    return ForwardInput((token,), context, target, decode=True)


def recomputed_tokens(lease: Lease, layout: ChunkLayout, depth: Sequence[int] | None, num_layers: int) -> int:
    """Tokens of reused chunks recomputed, in full-depth equivalents: a token recomputed through
    ``l`` of ``L`` layers (CacheBlend-style selection, Algorithm 1) counts ``l / L``."""
    total = 0.0
    for piece, rows in zip(lease.pieces, layout.rows):
        if piece.use is None:
            continue
        total += sum(depth[r] for r in rows) / num_layers if depth is not None else len(rows)
    return round(total)


def rows_from(layout: ChunkLayout, first: int, rest_tokens: int, depth: Sequence[int] | None, num_layers: int) -> int:
    """Rows a prefill computed for piece ``first`` and every later piece and the prompt's rest, in
    full-depth equivalents (a row computed through ``l`` of ``L`` layers counts ``l / L``): the
    work the guard's second pass, which starts at piece ``first``, does again."""
    rows = [r for piece_rows in layout.rows[first:] for r in piece_rows]
    last = max((r for piece_rows in layout.rows for r in piece_rows), default=-1)
    rows += list(range(last + 1, last + 1 + rest_tokens))
    if depth is None:
        return len(rows)
    return round(sum(depth[r] for r in rows) / num_layers)


def variant_stats(lease: Lease, layout: ChunkLayout, attention: SegmentAttention | None) -> list[VariantStats | None]:
    """Per piece, the statistics of the variant it becomes (None: not recorded)."""
    out: list[VariantStats | None] = []
    for piece, rows, rec, own in zip(lease.pieces, layout.rows, layout.recorded, layout.piece_segment):
        if not rec or attention is None or not rows:
            out.append(None)
            continue
        mass = [attention.mass[r] for r in rows]
        out.append(stats_from_mass(piece.spec.key, mass, own, layout.stat_keys, layout.stat_lengths, layout.stat_skip))
    return out


def chunk_deviations(lease: Lease, layout: ChunkLayout, deviation: Sequence[float] | None) -> dict[int, float]:
    """Per reused piece with recomputed tokens: the mean relative change of those tokens' K/V
    (the quality guard's signal; how far reuse had moved this chunk's computation)."""
    if deviation is None:
        return {}
    return {i: sum(deviation[r] for r in rows) / len(rows)
            for i, (piece, rows) in enumerate(zip(lease.pieces, layout.rows)) if piece.use is not None and rows}


def chunk_attention(layout: ChunkLayout, last_mass: Sequence[float] | None) -> dict[int, float]:
    """Per reused piece the guard measured: the attention mass the prompt's last token gave its
    span (averaged over layers and KV heads; :attr:`StepOutput.last_mass`)."""
    if last_mass is None:
        return {}
    return {piece: last_mass[segment] for piece, segment in layout.guard_pieces}


def chunk_reuse(lease: Lease, deviations: dict[int, float], attention: dict[int, float],
                flagged: frozenset[int]) -> tuple[ChunkReuse, ...]:
    """Per piece served from a chunk variant, in prompt order, how it was fixed and what the guard
    measured (``deviations`` from :func:`chunk_deviations`, ``attention`` from
    :func:`chunk_attention`; ``flagged`` from :func:`guard_flags`)."""
    return tuple(ChunkReuse(str(p.spec.key), p.start, p.spec.num_tokens, p.use.cfo, len(p.use.recompute),
                            deviations.get(i), attention.get(i), i in flagged)
                 for i, p in enumerate(lease.pieces) if p.use is not None)


def guard_signals(deviations: dict[int, float], attention: dict[int, float]) -> dict[int, float]:
    """The quality guard's signal per reused piece with recomputed tokens: how far those tokens' K/V
    moved (``deviations``) times the attention the prompt's last token gives the piece
    (``attention``): stale KV the answer hardly reads matters little. It picks out the requests
    with the largest first-token KL better than the deviation alone (``docs/benchmarks.md``, "The
    quality guard weighed by attention", 2026-11-27). A piece with no attention figure (none is
    missing from an engine pass: past :data:`MAX_STAT_SEGMENTS` spans a piece gets its group's)
    keeps its deviation alone: the larger."""
    return {i: d * attention.get(i, 1.0) for i, d in deviations.items()}


def guard_flags(signals: dict[int, float], threshold: float | None) -> frozenset[int]:
    """Indices of reused pieces whose guard signal (:func:`guard_signals`) exceeds ``threshold``:
    their cached KV was too far from this context, where the answer reads it, to serve it."""
    if threshold is None:
        return frozenset()
    return frozenset(i for i, d in signals.items() if d > threshold)


def tail_block_specs(plan: PromptPlan, fed: Sequence[int], block_tokens: int, salt: str = "") -> list[SegmentSpec]:
    """The block nodes a finished request leaves behind: its prompt's rest then ``fed`` (the
    generated tokens whose KV it wrote), cut into full blocks of ``block_tokens`` from where the
    lead ended. Empty unless the plan is block-granular (its rest starts on a block boundary).

    Args:
        plan: the request's prompt plan.
        fed: generated tokens fed back through the model (every sampled token but the last).
        block_tokens: tokens per block node.
        salt: the request's ``cache_salt`` (part of every key).
    """
    tokens = tuple(plan.rest) + tuple(fed)
    if not plan.rest_blocks or len(tokens) < block_tokens:
        return []
    seg = Segment(tokens, SegmentKind.TAIL, cacheable=True, salt=salt)
    return [SegmentSpec(b.key, len(b), token_ids=b.token_ids) for b in split_blocks(seg, block_tokens, partial=False)]
