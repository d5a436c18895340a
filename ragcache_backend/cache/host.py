"""The host tier: copies of node KV in host memory under a byte budget (RAGCache Fig. 8).

A node reaches the host tier when the device evicts it (swap out once: the copy then lives until
the host evicts it, and later device evictions of the node free its blocks without a copy), when
an upper node is replicated at insertion (RAGCache §6), or when the disk tier reads it back. Nodes
leave by the policy's order among *host leaves*: unlocked nodes whose host copy nothing depends
on (a copy of a node also on device can always go; a host-only node must have no resident child).

On a CPU the "device" arena is host memory too; the copy between the two tiers remains (issue:
attend host-tier hits in place). Not thread-safe: callers serialize access.
"""

from __future__ import annotations

from collections.abc import Sequence

from ragcache_backend.cache.evictor import Evictor
from ragcache_backend.cache.knowledge_tree import Node, TierName
from ragcache_backend.cache.policy import PolicyFn
from ragcache_backend.cache.tier import Demote, KVHandle, KVMover, NodeLocks
from ragcache_backend.errors import InvalidRequestError

__all__ = ["HostTier"]

HOST = TierName.HOST


def _is_leaf(n: Node) -> bool:
    """Alg. 1 line 17 for the host: an unlocked host copy that no resident child depends on."""
    return (not n.lock_ref and not n.is_root and n.in_host
            and (n.in_device or not any(c.resident for c in n.children.values())))


class HostTier:
    """Host buffers of node KV, at most ``budget_bytes`` in all (0 disables the tier).

    Args:
        budget_bytes: the tier's budget, bytes (>= 0).
        mover: sizes and frees host buffers.
        policy: the replacement policy (eviction order among host leaves).
        locks: the cache's locked nodes (their copies are never evicted).

    Raises:
        InvalidRequestError: a negative budget.
    """

    name = HOST

    def __init__(self, budget_bytes: int, mover: KVMover, policy: PolicyFn, locks: NodeLocks) -> None:
        if budget_bytes < 0:
            raise InvalidRequestError(f"host_budget_bytes must be >= 0, got {budget_bytes}")
        self._budget = budget_bytes
        self.evictor: Evictor[Node] = Evictor(HOST, policy, _is_leaf)
        self._mover = mover
        self._locks = locks
        self._used = 0

    @property
    def budget_bytes(self) -> int:
        """The tier's budget, bytes."""
        return self._budget

    @property
    def used_bytes(self) -> int:
        """Bytes of the host copies held."""
        return self._used

    @property
    def enabled(self) -> bool:
        """False when the budget is 0 (no host tier)."""
        return self._budget > 0

    def nbytes(self, num_tokens: int) -> int:
        """Bytes a copy of ``num_tokens`` tokens of KV takes here."""
        return self._mover.host_nbytes(num_tokens)

    # ---- the tier protocol -------------------------------------------------------------------
    def contains(self, node: Node) -> bool:
        """True if the node has a host copy."""
        return node.in_host

    def put(self, node: Node, kv: KVHandle) -> bool:
        """Keep ``kv`` as the node's host copy; False if it does not fit the free budget now.

        Raises:
            InvalidRequestError: ``kv`` holds another number of tokens than the node, the node
                already has a host copy, or its parent's KV is resident nowhere (an orphan).
        """
        if self._mover.kv_tokens(kv) != node.num_tokens:
            raise InvalidRequestError(f"a copy of {self._mover.kv_tokens(kv)} tokens cannot be {node!r}'s KV")
        parent = node.parent
        if parent is not None and not parent.is_root and not parent.resident:
            raise InvalidRequestError(f"parent {parent!r} of {node!r} is resident nowhere")
        if node.host_kv is not None:
            raise InvalidRequestError(f"{node!r} already has a host copy")
        nbytes = self.nbytes(node.num_tokens)
        if self._used + nbytes > self._budget:
            return False
        node.host_kv = kv
        self._used += nbytes
        self.evictor.reprice(node)
        return True

    def get(self, node: Node) -> KVHandle | None:
        """The node's host copy itself (the tier keeps owning it), or None."""
        return node.host_kv

    def drop(self, node: Node) -> None:
        """Free the node's host copy; its parent may become a host leaf."""
        if node.host_kv is not None:
            self._mover.free_host(node.host_kv)
            self._used -= self.nbytes(node.num_tokens)
            node.host_kv = None
        self.evictor.forget(node)
        if node.parent is not None:
            self.evictor.offer(node.parent)

    def make_room(self, nbytes: int, demote: Demote) -> bool:
        """Evict host leaves (lowest priority first, each handed to ``demote``) until ``nbytes``
        more fit; False, evicting nothing, if the tier is off, too small, or locked copies fill it."""
        if self._budget == 0 or nbytes > self._budget:
            return False
        short = nbytes - (self._budget - self._used)
        if short <= 0:
            return True
        locked = sum(self.nbytes(m.num_tokens) for m in self._locks if m.in_host)
        if short > self._used - locked:
            return False
        while self._budget - self._used < nbytes:
            victim = self.evictor.evict(demote)  # eq. 2: the clock advances
            if victim.in_host:
                raise AssertionError(f"{victim!r} kept its host copy after its demotion")
        return True

    def eviction_order(self) -> list[str]:
        """Path keys of the host leaves, first victim first."""
        return [n.path_key for n in self.evictor.order()]

    # ---- checks --------------------------------------------------------------------------------
    def problems(self, nodes: Sequence[Node]) -> list[str]:
        """Broken invariants of this tier given the tree's nodes (for ``check_invariants``)."""
        held = sum(self.nbytes(n.num_tokens) for n in nodes if n.host_kv is not None)
        out: list[str] = []
        if held != self._used:
            out.append(f"host bytes counted {self._used}, nodes hold {held}")
        if self._used > self._budget:
            out.append(f"host over budget: {self._used} > {self._budget} bytes")
        return out
