"""The knowledge tree: a prefix tree of segment KV caches (RAGCache §5.1, Fig. 7/8).

A node holds the KV of one segment (the system prompt or one document) *given the exact path of
segments before it*: the KV of a token depends on every token before it, so the same document met
after a different prefix is a different node. The root is key-less and stands for the empty
prefix; the first segment of a request (the system prompt) is a child of the root. Prefix
matching walks children by segment key and stops at the first missing or non-resident node,
O(h) for a tree of height h.

Every node also has a *path key* (:func:`path_key`): a hash chained over the segment keys from the
root, the node's identity outside this process (the disk tier's file names; a remote tier's keys).

This module is plain bookkeeping: where a node's KV lives (device block ids, an opaque host
handle) is recorded here but moved and freed by the tier classes (:mod:`ragcache_backend.cache.stack`).
Not thread-safe: callers serialize access.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

from ragcache_backend.cache.chunk_reuse import VariantInfo
from ragcache_backend.cache.policy import NodeStats
from ragcache_backend.errors import InvalidRequestError

__all__ = ["TierName", "SegmentKey", "Node", "KnowledgeTree", "approximate_key", "approximate_rule", "path_key"]

SegmentKey = NewType("SegmentKey", str)
"""Content hash of a segment's token ids (computed by the caller)."""

_APPROX = "approx:"


def approximate_key(key: SegmentKey, rule: str = "") -> SegmentKey:
    """The child key of a segment whose KV is *approximate*: computed over reused chunk caches (or a
    reused chunk itself) under the recompute rule whose :attr:`RecomputeRule.key
    <ragcache_backend.cache.chunk_reuse.RecomputeRule.key>` is ``rule``. It can never equal a
    segment's own key, so exact and approximate versions of a segment live side by side and exact
    matching never reaches an approximate one; approximations made under different rules have
    different keys, so one never serves a request that asked for another. An approximate key is
    returned unchanged."""
    if key.startswith(_APPROX):
        return key
    return SegmentKey(f"{_APPROX}{rule}|{key}" if rule else _APPROX + key)


def approximate_rule(key: SegmentKey) -> str:
    """The rule key an approximate key was made under ("" for an exact key or none recorded)."""
    if not key.startswith(_APPROX) or "|" not in key:
        return ""
    return key[len(_APPROX):].split("|", 1)[0]


def path_key(parent: str, key: str) -> str:
    """The path key of a node: a hash chained over its path's segment keys (32 hex chars).

    Args:
        parent: the parent's path key ("" for a child of the root).
        key: the node's segment key.
    """
    digest = hashlib.sha256(b"ragcache-path-v1\x00")
    digest.update(parent.encode())
    digest.update(b"/")
    digest.update(key.encode())
    return digest.hexdigest()[:32]


class TierName(StrEnum):
    """Cache tiers, fastest first (RAGCache Fig. 8: GPU, host; then our disk tier)."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(slots=True, eq=False)
class Node:
    """One segment's KV given its prefix.

    Attributes:
        key: segment content hash; None only for the root.
        num_tokens: segment length (tokens).
        parent: the node of the preceding segment (None for the root and for removed nodes).
        children: next-segment nodes by key.
        device_blocks: device block ids holding the KV; resident on device iff not None.
        host_kv: opaque handle from ``KVMover.swap_out``; resident on host iff not None.
        lock_ref: number of running requests using the node; locked nodes are never evicted.
        frequency: requests that referenced the node (Alg. 1 line 3).
        total_cost: sum over computing requests of ``T(alpha, beta) / beta`` (seconds per token,
            Alg. 1 line 10).
        num_computed: requests that had to compute the node (``m`` in eq. 3).
        last_access: logical access counter at the last reference (0 = never referenced).
        priority: replacement priority per tier the node is resident in (eq. 1).
        serial: creation order, a deterministic tie-breaker.
        variant: set when the node's KV may also serve its segment at other positions and after
            other prefixes (a chunk variant, Cache-Craft §3.3): its recorded statistics, origin
            position and reuse score.
        approximate: the KV was computed over reused chunk caches (or is a reused chunk): its key
            is :func:`approximate_key` of the segment's, and so are its descendants'.
        path_key: :func:`path_key` of the node's path ("" for the root).
        tokens: the segment's token ids, when the inserter gave them: a match compares them with
            the request's (a segment key is a hash; it is never trusted alone). Empty: not recorded.
    """

    key: SegmentKey | None
    num_tokens: int
    parent: Node | None = None
    children: dict[SegmentKey, Node] = field(default_factory=dict)
    device_blocks: list[int] | None = None
    host_kv: object | None = None
    lock_ref: int = 0
    frequency: int = 0
    total_cost: float = 0.0
    num_computed: int = 0
    last_access: int = 0
    priority: dict[TierName, float] = field(default_factory=dict)
    serial: int = 0
    variant: VariantInfo | None = None
    approximate: bool = False
    path_key: str = ""
    tokens: tuple[int, ...] = ()

    def serves(self, tokens: Sequence[int]) -> bool:
        """True unless both this node's and ``tokens`` are known and they differ (a hash collision
        or a foreign file: never served)."""
        return not self.tokens or not tokens or self.tokens == tuple(tokens)

    @property
    def is_root(self) -> bool:
        return self.key is None

    @property
    def in_device(self) -> bool:
        return self.device_blocks is not None

    @property
    def in_host(self) -> bool:
        return self.host_kv is not None

    @property
    def resident(self) -> bool:
        """True if the KV is in at least one tier."""
        return self.device_blocks is not None or self.host_kv is not None

    @property
    def tiers(self) -> tuple[TierName, ...]:
        """Tiers holding the node's KV, fastest first."""
        out: list[TierName] = []
        if self.device_blocks is not None:
            out.append(TierName.DEVICE)
        if self.host_kv is not None:
            out.append(TierName.HOST)
        return tuple(out)

    @property
    def avg_cost(self) -> float:
        """Mean seconds per non-cached token over computing requests (eq. 3); 0.0 if none."""
        return self.total_cost / self.num_computed if self.num_computed else 0.0

    def stats(self) -> NodeStats:
        return NodeStats(self.frequency, self.avg_cost, self.num_tokens, self.last_access)

    def __repr__(self) -> str:
        where = "+".join(t.value for t in self.tiers) or "nowhere"
        return f"Node({self.key!r}, {self.num_tokens} tok, {where}, lock={self.lock_ref})"


class KnowledgeTree:
    """Prefix tree of :class:`Node` under a key-less root."""

    __slots__ = ("root", "_num_nodes", "_next_serial")

    def __init__(self) -> None:
        self.root = Node(key=None, num_tokens=0)
        self._num_nodes = 0
        self._next_serial = 1

    def __len__(self) -> int:
        """Number of nodes, root excluded."""
        return self._num_nodes

    def __iter__(self) -> Iterator[Node]:
        """All nodes except the root, parents before children."""
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def match_prefix(self, keys: Sequence[SegmentKey], *, approximate: bool = False,
                     tokens: Sequence[Sequence[int]] = (), rule: str = "") -> list[Node]:
        """Longest resident path matching ``keys`` from the root; O(len(result) + 1) lookups.

        ``approximate``: where a segment has no exact child, follow its approximate one made under
        the recompute rule ``rule`` (and from there on only approximate ones); otherwise
        approximate nodes are never matched.
        ``tokens``: per key, the segment's token ids (empty: not compared); the match stops at a
        node whose recorded tokens differ (:meth:`Node.serves`).
        """
        out: list[Node] = []
        node = self.root
        for i, key in enumerate(keys):
            child = None if node.approximate else node.children.get(key)
            if (child is None or not child.resident) and approximate:
                child = node.children.get(approximate_key(key, rule))
            if child is None or not child.resident or (i < len(tokens) and not child.serves(tokens[i])):
                break
            out.append(child)
            node = child
        return out

    def add_child(self, parent: Node, key: SegmentKey, num_tokens: int, tokens: Sequence[int] = ()) -> Node:
        """Create a non-resident child of ``parent``; the caller then records where its KV lives.
        ``tokens``: the segment's token ids (recorded when given; their count must be ``num_tokens``)."""
        if not self.contains(parent):
            raise InvalidRequestError("parent node is not in this knowledge tree")
        if key is None:
            raise InvalidRequestError("a segment key is required (only the root has none)")
        if key in parent.children:
            raise InvalidRequestError(f"segment {key!r} is already a child of this parent")
        if num_tokens < 0:
            raise InvalidRequestError(f"num_tokens must be >= 0, got {num_tokens}")
        if tokens and len(tokens) != num_tokens:
            raise InvalidRequestError(f"{len(tokens)} token ids for a segment of {num_tokens} tokens")
        node = Node(key=key, num_tokens=num_tokens, parent=parent, serial=self._next_serial,
                    path_key=path_key(parent.path_key, key), tokens=tuple(tokens))
        self._next_serial += 1
        parent.children[key] = node
        self._num_nodes += 1
        return node

    def remove(self, node: Node) -> list[Node]:
        """Detach ``node`` and its subtree; return them (parents first) so the caller frees their KV.

        Removed nodes keep their KV fields but lose ``parent`` and ``children`` links.
        """
        if node.is_root:
            raise InvalidRequestError("the root of the knowledge tree cannot be removed")
        if not self.contains(node):
            raise InvalidRequestError(f"{node!r} is not in this knowledge tree")
        assert node.parent is not None
        del node.parent.children[node.key]  # type: ignore[arg-type]
        removed: list[Node] = []
        stack = [node]
        while stack:
            n = stack.pop()
            removed.append(n)
            stack.extend(n.children.values())
            n.children = {}
            n.parent = None
        self._num_nodes -= len(removed)
        return removed

    def contains(self, node: Node) -> bool:
        """True if ``node`` is the root or reachable from it; O(depth)."""
        while node.parent is not None:
            if node.parent.children.get(node.key) is not node:  # type: ignore[arg-type]
                return False
            node = node.parent
        return node is self.root

    @staticmethod
    def path_to(node: Node) -> list[Node]:
        """Nodes from the first segment down to ``node`` (root excluded)."""
        out: list[Node] = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out
