"""The host tier: copies of node KV in host memory under a byte budget (RAGCache Fig. 8).

A node reaches the host tier when the device evicts it (swap out once: the copy then lives until
the host evicts it, and later device evictions of the node free its blocks without a copy), when
an upper node is replicated at insertion (RAGCache §6), or when the disk tier reads it back. Nodes
leave by the policy's order among *host leaves*: unlocked nodes whose host copy nothing depends
on (a copy of a node also on device can always go; a host-only node must have no resident child).

On a CPU the device arena is host memory too. There the host tier can hold its copies in blocks
of the arena itself (a *shared pool*: one pool of blocks, two budgets): a device victim's blocks
are handed over to the host tier (:meth:`HostTier.take`) and handed back on a hit
(:meth:`HostTier.release`), so a host-tier hit is attended in place and no KV is copied between
the two tiers; a node is then in one of them at a time. Copies remain where the memories differ
(CUDA) and for KV coming from below (disk, remote), which is written into pool blocks once. Not
thread-safe: callers serialize access.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ragcache_backend.cache.blocks import BlockAllocator, blocks_for
from ragcache_backend.cache.evictor import Evictor
from ragcache_backend.cache.knowledge_tree import Node, TierName
from ragcache_backend.cache.policy import PolicyFn
from ragcache_backend.cache.tier import Demote, KVHandle, KVMover, NodeLocks
from ragcache_backend.errors import InvalidRequestError

__all__ = ["HostTier", "PoolCopy"]

HOST = TierName.HOST


@dataclass(slots=True, frozen=True)
class PoolCopy:
    """A host copy kept in blocks of a shared pool (the arena's memory on a CPU).

    Attributes:
        blocks: block ids of the arena, ``ceil(num_tokens / block_size)`` of them.
        num_tokens: tokens of KV they hold.
    """

    blocks: tuple[int, ...]
    num_tokens: int


def _is_leaf(n: Node) -> bool:
    """Alg. 1 line 17 for the host: an unlocked host copy that no resident child depends on."""
    return (not n.lock_ref and not n.is_root and n.in_host
            and (n.in_device or not any(c.resident for c in n.children.values())))


class HostTier:
    """Host buffers of node KV, at most ``budget_bytes`` in all (0 disables the tier).

    Args:
        budget_bytes: the tier's budget, bytes (>= 0).
        mover: sizes and frees host buffers (and copies KV into pool blocks).
        policy: the replacement policy (eviction order among host leaves).
        locks: the cache's locked nodes (their copies are never evicted).
        pool: the arena's block pool, shared with the device tier (copies are then
            :class:`PoolCopy` blocks, counted in whole blocks); None: copies are the mover's buffers.
        block_size: tokens per block (with ``pool``).

    Raises:
        InvalidRequestError: a negative budget, or a pool without a block size.
    """

    name = HOST

    def __init__(self, budget_bytes: int, mover: KVMover, policy: PolicyFn, locks: NodeLocks,
                 pool: BlockAllocator | None = None, block_size: int = 0) -> None:
        if budget_bytes < 0:
            raise InvalidRequestError(f"host_budget_bytes must be >= 0, got {budget_bytes}")
        if pool is not None and block_size < 1:
            raise InvalidRequestError("a host tier in a shared pool needs the block size")
        self._pool = pool
        self._block_size = block_size
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

    @property
    def shared(self) -> bool:
        """True when the copies live in blocks of the arena's pool (moves to and from the device
        tier hand blocks over, :meth:`take` / :meth:`release`)."""
        return self._pool is not None

    def nbytes(self, num_tokens: int) -> int:
        """Bytes a copy of ``num_tokens`` tokens of KV takes here (whole blocks in a shared pool)."""
        if self._pool is not None:
            return blocks_for(num_tokens, self._block_size) * self._mover.host_nbytes(self._block_size)
        return self._mover.host_nbytes(num_tokens)

    # ---- the tier protocol -------------------------------------------------------------------
    def contains(self, node: Node) -> bool:
        """True if the node has a host copy."""
        return node.in_host

    def _check_new(self, node: Node) -> None:
        parent = node.parent
        if parent is not None and not parent.is_root and not parent.resident:
            raise InvalidRequestError(f"parent {parent!r} of {node!r} is resident nowhere")
        if node.host_kv is not None:
            raise InvalidRequestError(f"{node!r} already has a host copy")

    def put(self, node: Node, kv: KVHandle) -> bool:
        """Keep ``kv`` as the node's host copy; False if it does not fit the free budget now. In a
        shared pool ``kv`` is written into new pool blocks and freed (one copy: KV from the disk or
        remote tier, or a request's tail).

        Raises:
            InvalidRequestError: ``kv`` holds another number of tokens than the node, the node
                already has a host copy, or its parent's KV is resident nowhere (an orphan).
        """
        if self._mover.kv_tokens(kv) != node.num_tokens:
            raise InvalidRequestError(f"a copy of {self._mover.kv_tokens(kv)} tokens cannot be {node!r}'s KV")
        self._check_new(node)
        nbytes = self.nbytes(node.num_tokens)
        if self._used + nbytes > self._budget:
            return False
        if self._pool is not None:
            blocks = self._pool.allocate(blocks_for(node.num_tokens, self._block_size))
            try:
                self._mover.swap_in(kv, blocks)
            except BaseException:
                self._pool.free(blocks)
                raise
            self._mover.free_host(kv)
            kv = PoolCopy(tuple(blocks), node.num_tokens)
        node.host_kv = kv
        self._used += nbytes
        self.evictor.reprice(node)
        return True

    def take(self, node: Node, blocks: Sequence[int]) -> bool:
        """Shared pool: make ``blocks`` (the node's device blocks, released by the device tier) its
        host copy, with no copy; False if it does not fit the free budget now.

        Raises:
            InvalidRequestError: not a shared pool, a block count that does not fit the node's
                tokens, the node already has a host copy, or its parent is resident nowhere.
        """
        if self._pool is None:
            raise InvalidRequestError("only a host tier in a shared pool takes device blocks")
        if len(blocks) != blocks_for(node.num_tokens, self._block_size):
            raise InvalidRequestError(f"{len(blocks)} blocks cannot hold {node!r}")
        self._check_new(node)
        nbytes = self.nbytes(node.num_tokens)
        if self._used + nbytes > self._budget:
            return False
        node.host_kv = PoolCopy(tuple(blocks), node.num_tokens)
        self._used += nbytes
        self.evictor.reprice(node)
        return True

    def release(self, node: Node) -> list[int]:
        """Shared pool: take the node's copy out of the tier *without freeing its blocks*, which
        the caller hands to the device tier (:meth:`DeviceTier.take`).

        Raises:
            InvalidRequestError: not a shared pool, or the node has no host copy.
        """
        if self._pool is None or not isinstance(node.host_kv, PoolCopy):
            raise InvalidRequestError(f"{node!r} has no host copy in a shared pool")
        blocks = list(node.host_kv.blocks)
        self._used -= self.nbytes(node.num_tokens)
        node.host_kv = None
        self.evictor.forget(node)
        if node.parent is not None:
            self.evictor.offer(node.parent)
        return blocks

    def get(self, node: Node) -> KVHandle | None:
        """The node's host copy itself (the tier keeps owning it), or None. In a shared pool: a
        new copy of its blocks' KV, which the caller frees with the mover (see :meth:`borrows`)."""
        if node.host_kv is None:
            return None
        if isinstance(node.host_kv, PoolCopy):
            return self._mover.swap_out(node.host_kv.blocks, node.num_tokens)
        return node.host_kv

    @property
    def borrows(self) -> bool:
        """True when :meth:`get` returns the tier's own copy (the caller must not free it); False
        when it returns a new one (shared pool: the caller frees it)."""
        return self._pool is None

    def drop(self, node: Node) -> None:
        """Free the node's host copy; its parent may become a host leaf."""
        if node.host_kv is not None:
            if isinstance(node.host_kv, PoolCopy):
                self._pool.free(node.host_kv.blocks)
            else:
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
        if self._pool is not None:  # copies are pool blocks, each held by one node, allocated in the pool
            seen: set[int] = set()
            for n in nodes:
                if n.host_kv is None:
                    continue
                blocks = n.host_kv.blocks if isinstance(n.host_kv, PoolCopy) else ()
                if len(blocks) != blocks_for(n.num_tokens, self._block_size) or seen.intersection(blocks):
                    out.append(f"{n!r}: host copy {n.host_kv!r} is not its own pool blocks")
                if not all(self._pool.is_used(b) for b in blocks):
                    out.append(f"{n!r}: host blocks not allocated in the pool")
                if n.in_device:
                    out.append(f"{n!r}: on device and on host in one shared pool")
                seen.update(blocks)
        if held != self._used:
            out.append(f"host bytes counted {self._used}, nodes hold {held}")
        if self._used > self._budget:
            out.append(f"host over budget: {self._used} > {self._budget} bytes")
        return out
