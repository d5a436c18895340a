"""What a request holds in the cache between admission and release (plain data), in every reuse mode.

The engine asks :meth:`ragcache_backend.cache.tiers.TieredCache.admit` for a :class:`Lease` with the
request's cacheable lead (one :class:`SegmentSpec` per segment, in prompt order) and the number of
tokens it will compute past the lead (the prompt's rest plus ``max_tokens``). The lease says which
prefix nodes are reused (locked, on device), where each other lead segment's KV must be written
(one :class:`Piece` each, inserted as tree nodes by ``commit``), which of those are filled from a
cached chunk variant (Cache-Craft §3, chunk modes only), and where the rest goes
(``tail_blocks``, request-owned, freed by ``finish``).

An exact request's lease is the same object with no variant in use: one interface for the
engine's batch building (:meth:`Lease.prefill_runs`, :meth:`Lease.decode_runs`) and its results
(hit counts, cached and recomputed tokens), whatever the mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ragcache_backend.cache.blocks import KVRun
from ragcache_backend.cache.knowledge_tree import Node, SegmentKey, TierName

__all__ = ["AcquiredPrefix", "ChunkLease", "ChunkPiece", "ChunkSpec", "ContextPart", "Lease", "MatchResult", "Piece",
           "SegmentSpec", "VariantUse"]


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
class SegmentSpec:
    """A cacheable prompt segment as the cache sees it.

    Attributes:
        key: content hash of the segment's token ids (the knowledge-tree child key).
        num_tokens: its length in tokens, >= 1.
        chunk: True for a document in a chunk mode: reusable at any position from a cached variant,
            and recorded as a variant when computed. False (exact mode, or text that is no document):
            served only as an exact prefix.
        parts: how its tokens split into :class:`ContextPart` (lengths sum to ``num_tokens``); a
            document is one part with its own key. Empty: one part, the segment's key.
        token_ids: the segment's tokens (``num_tokens`` of them), recorded on the node it becomes and
            compared with a cached node's before that node serves it (the key is a hash, never
            trusted alone). Empty: not compared (callers that know only keys).
    """

    key: SegmentKey
    num_tokens: int
    chunk: bool = False
    parts: tuple[ContextPart, ...] = ()
    token_ids: tuple[int, ...] = ()

    def context_parts(self) -> tuple[ContextPart, ...]:
        return self.parts or (ContextPart(self.key, self.num_tokens),)


ChunkSpec = SegmentSpec
"""The chunk modes' name for :class:`SegmentSpec` (same type)."""


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
class Piece:
    """One lead segment a request writes itself (past its reused prefix).

    Attributes:
        spec: the segment.
        start: position of its first token in the prompt.
        context: the ids of the context parts before it (``context_keys``: unique within the prompt;
            empty in exact mode, where no statistics are recorded).
        blocks: where its KV is written (request-owned until ``commit`` hands them to a node).
        use: the chunk variant it is served from, or None: computed in full.
        node: after ``commit``: the tree node that owns its KV (exact or approximate), else None.
    """

    spec: SegmentSpec
    start: int
    context: tuple[str, ...]
    blocks: list[int]
    use: VariantUse | None = None
    node: Node | None = None


ChunkPiece = Piece
"""The chunk modes' name for :class:`Piece` (same type)."""


@dataclass(slots=True)
class Lease:
    """A request's hold on the cache (RAGCache §5.1: lock the matched path, own the new blocks).

    Attributes:
        prefix: locked tree nodes served from the cache, in prompt order (exact nodes; in the
            chunk modes also approximate ones built over earlier chunk reuse).
        pieces: the other lead segments, in prompt order: computed, or fixed from a variant.
        tail_blocks: request-owned device blocks for the tokens past the lead (prompt rest and
            generated tokens), ``ceil(tail_tokens / block_size)`` of them.
        sources: the variant nodes ``pieces`` copy from (locked until commit or finish).
        device_hits, host_hits: prefix nodes and variants found on device / swapped in from host.
        disk_hits: reused nodes read back from the disk tier (then swapped in; not in ``host_hits``).
        committed_pieces: how many leading pieces a commit has covered (a chunked prefill commits
            the pieces its chunks completed, ``commit_prefix``): each is a tree node now, or could
            not hang from the tree (another version of its path is cached), and so are all after
            it. The others are not computed yet, or not committed.
        committed: ``commit`` ran (every piece is covered; the prefill is complete).
        released: ``finish`` ran; the lease holds nothing any more.
        rule_key: the recompute rule's key (:attr:`RecomputeRule.key`) in the chunk modes: the
            approximate nodes this request inserts carry it; "" in exact mode.
    """

    prefix: list[Node]
    pieces: list[Piece]
    tail_blocks: list[int]
    sources: list[Node] = field(default_factory=list)
    device_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    committed_pieces: int = 0
    committed: bool = False
    released: bool = False
    rule_key: str = ""

    # ---- token counts ---------------------------------------------------------------------------
    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the tree's prefix (exact and approximate nodes)."""
        return sum(n.num_tokens for n in self.prefix)

    @property
    def approximate_prefix_tokens(self) -> int:
        """The part of ``cached_tokens`` from approximate nodes (chunk reuse by earlier requests)."""
        return sum(n.num_tokens for n in self.prefix if n.approximate)

    @property
    def pending_tokens(self) -> int:
        """Lead tokens this request writes (computed or fixed)."""
        return sum(p.spec.num_tokens for p in self.pieces)

    @property
    def reused_tokens(self) -> int:
        """Tokens served from chunk variants without recomputation (approximate hits)."""
        return sum(p.spec.num_tokens - len(p.use.recompute) for p in self.pieces if p.use is not None)

    @property
    def recomputed_tokens(self) -> int:
        """Tokens of reused chunks recomputed over the new context."""
        return sum(len(p.use.recompute) for p in self.pieces if p.use is not None)

    @property
    def chunk_hits(self) -> int:
        """Pieces served from a chunk variant."""
        return sum(p.use is not None for p in self.pieces)

    # ---- the exact protocol's view ----------------------------------------------------------------
    @property
    def reused(self) -> int:
        """How many nodes at the start of :attr:`path` were served from the cache."""
        return len(self.prefix)

    @property
    def path(self) -> list[Node]:
        """The prefix, then (after ``commit``) the nodes inserted for the pieces."""
        return list(self.prefix) + [p.node for p in self.pieces if p.node is not None]

    @property
    def pending(self) -> list[Piece]:
        """Pieces not yet inserted as tree nodes."""
        return [p for p in self.pieces if p.node is None]

    # ---- where the KV is, for the forward pass ----------------------------------------------------
    def prefix_runs(self) -> tuple[KVRun, ...]:
        """The reused prefix's KV, in position order."""
        return tuple(KVRun(tuple(n.device_blocks or ()), 0, n.num_tokens) for n in self.prefix)

    def piece_runs(self, rest_tokens: int) -> tuple[KVRun, ...]:
        """Where the pieces' KV is written (in order), then the prompt's ``rest_tokens``."""
        runs = [KVRun(tuple(p.blocks), 0, p.spec.num_tokens) for p in self.pieces]
        runs.append(KVRun(tuple(self.tail_blocks), 0, rest_tokens))
        return tuple(runs)

    def context_runs(self, rest_tokens: int) -> tuple[KVRun, ...]:
        """The prompt's KV in position order: the prefix, every piece, the prompt's rest."""
        return self.prefix_runs() + self.piece_runs(rest_tokens)

    def decode_runs(self, position: int) -> tuple[tuple[KVRun, ...], tuple[KVRun, ...]]:
        """For a decode step whose new token sits at ``position`` (tokens past the lead): the
        context it attends to (prefix, pieces, tail up to ``position``) and where it is written."""
        tail = tuple(self.tail_blocks)
        return self.context_runs(0)[:-1] + (KVRun(tail, 0, position),), (KVRun(tail, position, 1),)


ChunkLease = Lease
"""The chunk modes' name for :class:`Lease` (same type)."""


@dataclass(slots=True, frozen=True)
class MatchResult:
    """Longest cached prefix of a request; read-only, pass it to ``acquire`` straight away."""

    nodes: tuple[Node, ...]
    tiers: tuple[TierName, ...]  # fastest tier each node was found in
    cached_tokens: int


@dataclass(slots=True)
class AcquiredPrefix:
    """A locked prefix, all on device. ``blocks[i]`` are the device block ids of ``nodes[i]``."""

    nodes: tuple[Node, ...]
    blocks: tuple[tuple[int, ...], ...]
    device_hits: int  # nodes already on device
    host_hits: int  # nodes swapped in from host
    cached_tokens: int
    disk_hits: int = 0  # nodes read back from the disk tier, then swapped in (not in host_hits)
