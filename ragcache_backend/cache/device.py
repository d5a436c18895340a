"""The device tier: the KV arena's blocks (RAGCache Fig. 8's GPU memory; DRAM on a CPU).

Attention reads KV only from here. Blocks are handed out by a free list
(:class:`~ragcache_backend.cache.blocks.BlockAllocator`); a block is owned either by a running
request (written by its prefill and decode steps, freed when it finishes) or by a tree node (its
segment's KV, ``ceil(num_tokens / block_size)`` blocks). A request's blocks become a node's when
its prefill is committed (:meth:`DeviceTier.adopt`, no copy). Nodes leave by the policy's order
among *device leaves*: unlocked nodes with no child on device (a child's KV is only valid after
its parent's, so a parent never goes first).

Budget and usage are counted in blocks and reported in bytes (``block_bytes`` each). With a
shared pool (a CPU, where the arena and the host tier are the same DRAM) the tier holds a quota of
the arena's blocks and a node moves to and from the host tier by handing its blocks over
(:meth:`DeviceTier.release`, :meth:`DeviceTier.take`), never copied. Not thread-safe: callers
serialize access.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ragcache_backend.cache.blocks import BlockAllocator, BlockQuota, blocks_for
from ragcache_backend.cache.evictor import Evictor
from ragcache_backend.cache.knowledge_tree import Node, TierName
from ragcache_backend.cache.policy import PolicyFn
from ragcache_backend.cache.tier import Demote, KVHandle, KVMover, NodeLocks
from ragcache_backend.errors import InvalidRequestError

__all__ = ["DeviceTier"]

DEVICE = TierName.DEVICE


def _require_on_device(parent: Node | None) -> None:
    """A node's KV is only valid after its parent's: a device copy needs the parent on device."""
    if parent is not None and not parent.is_root and not parent.in_device:
        raise InvalidRequestError(f"parent {parent!r} is not on device; acquire it first")


def _is_leaf(n: Node) -> bool:
    """Alg. 1 line 17 for the device: an unlocked node on device with no child on device."""
    return not n.lock_ref and not n.is_root and n.in_device and not any(c.in_device for c in n.children.values())


class DeviceTier:
    """The arena's ``num_blocks`` blocks of ``block_size`` tokens as a tier.

    Args:
        num_blocks: the tier's capacity, in blocks (>= 1).
        block_size: tokens per block (>= 1).
        mover: copies KV between the arena and host buffers.
        policy: the replacement policy (eviction order among device leaves).
        locks: the cache's locked nodes (never evicted).
        pool: the arena's block pool when it is shared with the host tier (the tier then holds at
            most ``num_blocks`` of it); None: a pool of ``num_blocks`` blocks of its own.

    Raises:
        InvalidRequestError: a capacity or block size below 1, or a capacity above the pool's.
    """

    name = DEVICE

    def __init__(self, num_blocks: int, block_size: int, mover: KVMover, policy: PolicyFn, locks: NodeLocks,
                 pool: BlockAllocator | None = None) -> None:
        if num_blocks < 1:
            raise InvalidRequestError(f"num_device_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1 token, got {block_size}")
        self.block_size = block_size
        self.evictor: Evictor[Node] = Evictor(DEVICE, policy, _is_leaf)
        self.mover = mover  # copies KV between the arena and host buffers
        self._locks = locks
        self._alloc = BlockQuota(pool if pool is not None else BlockAllocator(num_blocks), num_blocks)
        self._request_blocks: set[int] = set()
        #: seconds spent in the mover's copies into the arena (swap in)
        self.copy_s = 0.0

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def pool(self) -> BlockAllocator:
        """The arena's block pool (shared with the host tier, or this tier's own)."""
        return self._alloc.pool

    def held_blocks(self) -> frozenset[int]:
        """Block ids held by the tier's nodes and running requests (for invariant checks)."""
        return self._alloc.used_blocks()

    @property
    def num_blocks(self) -> int:
        return self._alloc.num_blocks

    @property
    def num_free(self) -> int:
        return self._alloc.num_free

    @property
    def num_used(self) -> int:
        """Blocks held by nodes and by running requests."""
        return self._alloc.num_used

    @property
    def num_request_blocks(self) -> int:
        """Blocks owned by running requests (not yet given to nodes)."""
        return len(self._request_blocks)

    @property
    def block_bytes(self) -> int:
        """Bytes of KV one block holds (``block_size`` tokens, as the mover counts them)."""
        return self.mover.host_nbytes(self.block_size)

    @property
    def budget_bytes(self) -> int:
        """The arena's capacity, bytes (``num_blocks * block_bytes``)."""
        return self.num_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks held by nodes and requests."""
        return self.num_used * self.block_bytes

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ---- request-owned blocks ----------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take free blocks for a request (the caller made room).

        Raises:
            CacheBudgetError: fewer than ``num_blocks`` are free.
        """
        blocks = self._alloc.allocate(num_blocks)
        self._request_blocks.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Return request-owned blocks; all-or-nothing.

        Raises:
            InvalidRequestError: a block is not owned by a request (or repeated).
        """
        ids = list(blocks)
        foreign = [b for b in ids if b not in self._request_blocks]
        if foreign:
            raise InvalidRequestError(f"blocks {foreign} are not owned by a request")
        self._alloc.free(ids)  # also rejects duplicates
        self._request_blocks.difference_update(ids)

    def owns(self, blocks: Sequence[int]) -> bool:
        """True if ``blocks`` are distinct blocks owned by requests."""
        ids = list(blocks)
        return len(set(ids)) == len(ids) and self._request_blocks.issuperset(ids)

    def adopt(self, node: Node, blocks: Sequence[int]) -> None:
        """Make request-owned ``blocks`` (holding the node's KV, just computed) the node's device copy.

        Raises:
            InvalidRequestError: wrong block count, blocks not owned by a request, or the parent
                is not on device.
        """
        ids = list(blocks)
        if node.device_blocks is not None:
            raise InvalidRequestError(f"{node!r} is already on device")
        self.check_adoption(node.parent, node.num_tokens, ids)
        self._request_blocks.difference_update(ids)
        node.device_blocks = ids
        self.evictor.reprice(node)

    def check_adoption(self, parent: Node | None, num_tokens: int, blocks: Sequence[int]) -> None:
        """Raise unless ``blocks`` can become the device copy of a ``num_tokens``-token child of ``parent``.

        Raises:
            InvalidRequestError: the parent is not on device (nor the root), the block count does
                not fit ``num_tokens``, or the blocks are not distinct blocks owned by a request.
        """
        _require_on_device(parent)
        need = self.blocks_for(num_tokens)
        if len(blocks) != need:
            raise InvalidRequestError(f"{num_tokens} tokens need {need} blocks, got {len(blocks)}")
        if not self.owns(blocks):
            raise InvalidRequestError(f"blocks {list(blocks)} are not distinct blocks owned by a request")

    # ---- the tier protocol -------------------------------------------------------------------
    def contains(self, node: Node) -> bool:
        """True if the node's KV is in the arena."""
        return node.in_device

    def put(self, node: Node, kv: KVHandle) -> bool:
        """Copy a host copy into new blocks (swap in); False if the blocks are not free now. On a
        failed copy the blocks are freed and the error propagates.

        Raises:
            InvalidRequestError: ``kv`` holds another number of tokens than the node, the node is
                on device already, or its parent is not (it would be an orphan).
        """
        if node.device_blocks is not None:
            raise InvalidRequestError(f"{node!r} is already on device")
        _require_on_device(node.parent)
        if self.mover.kv_tokens(kv) != node.num_tokens:
            raise InvalidRequestError(f"a copy of {self.mover.kv_tokens(kv)} tokens cannot be {node!r}'s KV")
        need = self.blocks_for(node.num_tokens)
        if need > self._alloc.num_free:
            return False
        blocks = self._alloc.allocate(need)
        t0 = time.perf_counter()
        try:
            self.mover.swap_in(kv, blocks)
        except BaseException:
            self._alloc.free(blocks)
            raise
        finally:
            self.copy_s += time.perf_counter() - t0
        node.device_blocks = blocks
        self.evictor.reprice(node)
        return True

    def get(self, node: Node) -> KVHandle | None:
        """A new host copy of the node's KV (swap out; the caller owns it and frees it with the
        mover unless it hands it to another tier), or None if it is not on device."""
        if node.device_blocks is None:
            return None
        return self.mover.swap_out(node.device_blocks, node.num_tokens)

    def release(self, node: Node) -> list[int]:
        """Take the node off the device *without freeing its blocks*, which the caller hands to the
        host tier of a shared pool (:meth:`HostTier.take`); its parent may become a device leaf.

        Raises:
            InvalidRequestError: the node is not on device.
        """
        if node.device_blocks is None:
            raise InvalidRequestError(f"{node!r} is not on device")
        blocks = self._alloc.give(node.device_blocks)
        node.device_blocks = None
        self.evictor.forget(node)
        if node.parent is not None:
            self.evictor.offer(node.parent)
        return blocks

    def take(self, node: Node, blocks: Sequence[int]) -> None:
        """Make ``blocks`` of the shared pool, holding the node's KV (released by the host tier), its
        device copy: no copy is made. The caller made room (:meth:`make_room_blocks`).

        Raises:
            InvalidRequestError: the node is on device already, its parent is not, or the block
                count does not fit its tokens.
            CacheBudgetError: the tier has no room for them.
        """
        if node.device_blocks is not None:
            raise InvalidRequestError(f"{node!r} is already on device")
        _require_on_device(node.parent)
        if len(blocks) != self.blocks_for(node.num_tokens):
            raise InvalidRequestError(f"{node.num_tokens} tokens need {self.blocks_for(node.num_tokens)} blocks, got {len(blocks)}")
        self._alloc.take(blocks)
        node.device_blocks = list(blocks)
        self.evictor.reprice(node)

    def drop(self, node: Node) -> None:
        """Free the node's blocks; its parent may become a device leaf."""
        if node.device_blocks is not None:
            self._alloc.free(node.device_blocks)
            node.device_blocks = None
        self.evictor.forget(node)
        if node.parent is not None:
            self.evictor.offer(node.parent)

    def make_room(self, nbytes: int, demote: Demote) -> bool:
        """:meth:`make_room_blocks` for ``nbytes`` bytes, rounded up to whole blocks."""
        return self.make_room_blocks(-(-nbytes // self.block_bytes), demote)

    def make_room_blocks(self, num_blocks: int, demote: Demote) -> bool:
        """Evict device leaves (lowest priority first, each handed to ``demote``) until
        ``num_blocks`` blocks are free; False, evicting nothing, if locks make it impossible."""
        short = num_blocks - self._alloc.num_free
        if short <= 0:
            return True
        if short > self.evictable_blocks():
            return False  # checked first so that a failure evicts nothing
        while self._alloc.num_free < num_blocks:  # Alg. 1 line 18
            victim = self.evictor.evict(demote)  # lines 19-21 (the clock advances)
            if victim.in_device:
                raise AssertionError(f"{victim!r} was not taken off the device by its demotion")
        return True

    def evictable_blocks(self) -> int:
        """Node blocks not pinned by a lock (locked nodes and their ancestors stay)."""
        pinned: set[Node] = set()
        pinned_blocks = 0
        for n in self._locks:
            m: Node | None = n
            while m is not None and not m.is_root and m not in pinned:
                pinned.add(m)
                pinned_blocks += len(m.device_blocks or ())
                m = m.parent
        return self._alloc.num_used - len(self._request_blocks) - pinned_blocks

    def eviction_order(self) -> list[str]:
        """Path keys of the device leaves, first victim first."""
        return [n.path_key for n in self.evictor.order()]

    # ---- checks --------------------------------------------------------------------------------
    def problems(self, nodes: Sequence[Node]) -> list[str]:
        """Broken invariants of this tier given the tree's nodes (for ``check_invariants``)."""
        out: list[str] = []
        node_blocks: set[int] = set()
        for n in nodes:
            if n.device_blocks is None:
                continue
            if len(n.device_blocks) != self.blocks_for(n.num_tokens):
                out.append(f"{n!r}: {len(n.device_blocks)} blocks for {n.num_tokens} tokens")
            dup = node_blocks.intersection(n.device_blocks)
            if dup or len(set(n.device_blocks)) != len(n.device_blocks):
                out.append(f"{n!r}: blocks {sorted(dup)} shared")
            node_blocks.update(n.device_blocks)
            if n.parent is not None and not n.parent.is_root and not n.parent.in_device:
                out.append(f"{n!r}: on device but parent {n.parent!r} is not")
        if node_blocks & self._request_blocks:
            out.append(f"blocks owned by both nodes and requests: {node_blocks & self._request_blocks}")
        if node_blocks | self._request_blocks != self._alloc.used_blocks():
            out.append("allocator's used blocks differ from node + request blocks")
        return out
