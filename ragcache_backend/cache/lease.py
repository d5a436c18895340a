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

__all__ = ["Lease", "PendingSegment", "SegmentSpec"]


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
        committed: ``commit`` ran (pending segments are now nodes of ``path``).
        released: ``release`` ran; the lease holds nothing any more.
    """

    path: list[Node]
    reused: int
    pending: list[PendingSegment]
    tail_blocks: list[int]
    device_hits: int = 0
    host_hits: int = 0
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
