"""What a request holds in the cache between admission and release (plain data).

The engine asks :meth:`ragcache_backend.cache.tiers.TieredCache.admit` for a :class:`Lease` with the
request's cacheable lead (one :class:`SegmentSpec` per segment, in prompt order) and the number of
tokens it will compute past the lead (the prompt's rest plus ``max_tokens``). The lease says which
prefix nodes are reused (locked, on device), where each missing lead segment's KV must be written
(``pending``, then inserted as tree nodes by ``commit``) and where the rest goes (``tail_blocks``,
request-owned, freed by ``release``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ragcache_backend.cache.knowledge_tree import Node, SegmentKey

__all__ = ["ChunkLease", "ChunkPiece", "ChunkSpec", "ContextPart", "Lease", "PendingSegment", "SegmentSpec", "VariantUse"]


@dataclass(slots=True, frozen=True)
class SegmentSpec:
    """A cacheable prompt segment as the cache sees it.

    Attributes:
        key: content hash of the segment's token ids (the knowledge-tree child key).
        num_tokens: its length in tokens, >= 1.
    """

    key: SegmentKey
    num_tokens: int


@dataclass(slots=True)
class PendingSegment:
    """A lead segment the request computes: its KV goes to ``blocks``, then becomes a node."""

    spec: SegmentSpec
    blocks: list[int]


@dataclass(slots=True)
class Lease:
    """A request's hold on the cache (RAGCache §5.1: lock the matched path, own the new blocks).

    Attributes:
        path: locked tree nodes in prompt order: the reused prefix, then (after ``commit``) the
            nodes inserted for the pending segments.
        reused: how many nodes at the start of ``path`` were served from the cache.
        pending: lead segments still to compute and insert, in prompt order.
        tail_blocks: request-owned device blocks for the tokens past the lead (prompt rest and
            generated tokens), ``ceil(tail_tokens / block_size)`` of them.
        device_hits, host_hits: reused nodes found on device / swapped in from host.
        disk_hits: reused nodes read back from the disk tier (then swapped in; not in ``host_hits``).
        committed: ``commit`` ran (pending segments are now nodes of ``path``).
        released: ``release`` ran; the lease holds nothing any more.
    """

    path: list[Node]
    reused: int
    pending: list[PendingSegment]
    tail_blocks: list[int]
    device_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    committed: bool = False
    released: bool = False

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the cache (the reused prefix)."""
        return sum(n.num_tokens for n in self.path[: self.reused])

    @property
    def pending_tokens(self) -> int:
        """Lead tokens this request computes."""
        return sum(p.spec.num_tokens for p in self.pending)


# ---- chunk-cache mode (Cache-Craft §3) ------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class ContextPart:
    """A stretch of a prompt as Cache-Craft's statistics see it: a document, or a window of other
    text (template, instructions, question), with an id that is the same wherever that content
    recurs. Inter-attention (eq. 3), beta and gamma (eq. 6-8) are counted per part.

    Attributes:
        key: the part's id (a document's key, a text window's content hash, ``<sink>``).
        num_tokens: its length, >= 1.
    """

    key: str
    num_tokens: int


@dataclass(slots=True, frozen=True)
class ChunkSpec:
    """A prompt segment as chunk-mode admission sees it.

    Attributes:
        key: content hash of its token ids.
        num_tokens: length in tokens, >= 1.
        chunk: True for a document: reusable at any position from a cached variant, and recorded
            as a variant when computed.
        parts: how its tokens split into :class:`ContextPart` (lengths sum to ``num_tokens``); a
            document is one part with its own key. Empty: one part, the segment's key.
    """

    key: SegmentKey
    num_tokens: int
    chunk: bool
    parts: tuple[ContextPart, ...] = ()

    def context_parts(self) -> tuple[ContextPart, ...]:
        return self.parts or (ContextPart(self.key, self.num_tokens),)


@dataclass(slots=True)
class VariantUse:
    """A cached variant serving one chunk of a request (Cache-Craft §3.1-3.2).

    Attributes:
        node: the variant (locked and on device until the request commits or finishes).
        cfo: its cache fix overhead for this request, the share of tokens recomputed, [0, 1].
        recompute: offsets (within the chunk) of the tokens to recompute, ascending.
        delta: new position minus the variant's origin position, in tokens (RoPE re-rotation).
    """

    node: Node
    cfo: float
    recompute: tuple[int, ...]
    delta: int


@dataclass(slots=True)
class ChunkPiece:
    """One segment of a chunk-mode request past its exact prefix.

    Attributes:
        spec: the segment.
        start: position of its first token in the prompt.
        context: the ids of the context parts before it (``context_keys``: unique within the prompt).
        blocks: where its KV is written (request-owned until ``commit`` hands them to a node).
        use: the variant it is served from, or None: computed in full.
        node: after ``commit``: the tree node that owns its KV (exact or approximate), else None.
    """

    spec: ChunkSpec
    start: int
    context: tuple[str, ...]
    blocks: list[int]
    use: VariantUse | None = None
    node: Node | None = None


@dataclass(slots=True)
class ChunkLease:
    """A chunk-mode request's hold on the cache: an exact prefix from the knowledge tree, then
    every other segment in request-owned blocks, some filled from cached variants.

    Attributes:
        prefix: locked tree nodes served exactly (RAGCache §5.1), in prompt order.
        pieces: the remaining lead segments, in prompt order.
        tail_blocks: blocks for the prompt's rest and the generated tokens.
        sources: the variant nodes ``pieces`` copy from (locked until commit or finish).
        device_hits, host_hits: prefix nodes and variants found on device / swapped in.
        disk_hits: prefix nodes read back from the disk tier.
        committed, released: as :class:`Lease`.
    """

    prefix: list[Node]
    pieces: list[ChunkPiece]
    tail_blocks: list[int]
    sources: list[Node]
    device_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    committed: bool = False
    released: bool = False

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the tree's prefix (exact and approximate nodes)."""
        return sum(n.num_tokens for n in self.prefix)

    @property
    def approximate_prefix_tokens(self) -> int:
        """The part of ``cached_tokens`` from approximate nodes (chunk reuse by earlier requests)."""
        return sum(n.num_tokens for n in self.prefix if n.approximate)

    @property
    def reused_tokens(self) -> int:
        """Tokens served from chunk variants without recomputation (approximate hits)."""
        return sum(p.spec.num_tokens - len(p.use.recompute) for p in self.pieces if p.use is not None)

    @property
    def recomputed_tokens(self) -> int:
        """Tokens of reused chunks recomputed over the new context."""
        return sum(len(p.use.recompute) for p in self.pieces if p.use is not None)
