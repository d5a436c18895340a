"""Free-list allocator of fixed-size KV blocks in the device arena.

Following vLLM (RAGCache §5.1), KV tensors live in non-contiguous blocks of ``block_size`` tokens.
This module only hands out block *ids* (plain ints ``0 .. num_blocks - 1``) and names a run of
tokens stored in them (:class:`KVRun`); the model's KV arena owns the tensors indexed by them.
Not thread-safe: callers serialize access.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ragcache_backend.errors import CacheBudgetError, InvalidRequestError

__all__ = ["BlockAllocator", "BlockQuota", "KVRun", "blocks_for"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Number of blocks needed to hold ``num_tokens`` tokens, ``ceil(num_tokens / block_size)``."""
    if num_tokens < 0:
        raise InvalidRequestError(f"num_tokens must be >= 0, got {num_tokens}")
    if block_size < 1:
        raise InvalidRequestError(f"block_size must be >= 1 token, got {block_size}")
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Hands out and takes back block ids of an arena of ``num_blocks`` blocks.

    ``allocate`` returns the lowest free ids first after construction (then LIFO), which keeps
    tests deterministic. Every id is either free or used, never both.
    """

    __slots__ = ("_num_blocks", "_free", "_used")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise InvalidRequestError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields 0 first
        self._used: set[int] = set()

    @property
    def num_blocks(self) -> int:
        """Arena capacity, in blocks."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks available to ``allocate``."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks handed out and not yet freed."""
        return len(self._used)

    def used_blocks(self) -> frozenset[int]:
        """Ids currently handed out (for invariant checks)."""
        return frozenset(self._used)

    def is_used(self, block: int) -> bool:
        """True if ``block`` is handed out."""
        return block in self._used

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks; raise CacheBudgetError if fewer than ``n`` are free."""
        if n < 0:
            raise InvalidRequestError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise CacheBudgetError(
                f"need {n} KV blocks but only {len(self._free)} of {self._num_blocks} are free"
            )
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Return ``blocks`` to the free list; all-or-nothing.

        Raises ValueError (changing nothing) on an id outside the arena, an id that is not
        allocated (double free), or an id repeated in ``blocks``.
        """
        ids = list(blocks)
        seen: set[int] = set()
        for b in ids:
            if not isinstance(b, int) or not 0 <= b < self._num_blocks:
                raise ValueError(f"block id {b!r} is not in this arena (0..{self._num_blocks - 1})")
            if b in seen:
                raise ValueError(f"block {b} appears twice in one free() call")
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free?)")
            seen.add(b)
        self._used.difference_update(ids)
        self._free.extend(reversed(ids))


class BlockQuota:
    """One tier's share of a block pool: at most ``cap`` of the pool's blocks held at once.

    On a CPU the device arena and the host tier are the same DRAM, so both tiers draw their blocks
    from one pool (:class:`BlockAllocator` over the whole arena) under two budgets, and a node moves
    between them by handing its blocks over (:meth:`give` then :meth:`take`), with no copy. With a
    pool of its own (``cap == pool.num_blocks``) it behaves exactly as the pool.

    Args:
        pool: the arena's allocator (shared, or this tier's own).
        cap: most blocks held at once (<= ``pool.num_blocks``).

    Raises:
        InvalidRequestError: ``cap`` negative or above the pool's size.
    """

    __slots__ = ("pool", "_cap", "_held")

    def __init__(self, pool: BlockAllocator, cap: int) -> None:
        if not 0 <= cap <= pool.num_blocks:
            raise InvalidRequestError(f"a quota of {cap} blocks does not fit a pool of {pool.num_blocks}")
        self.pool = pool
        self._cap = cap
        self._held: set[int] = set()

    @property
    def num_blocks(self) -> int:
        """The quota, in blocks."""
        return self._cap

    @property
    def num_free(self) -> int:
        """Blocks this quota may still take (bounded by what the pool has free)."""
        return min(self._cap - len(self._held), self.pool.num_free)

    @property
    def num_used(self) -> int:
        """Blocks held under this quota."""
        return len(self._held)

    def used_blocks(self) -> frozenset[int]:
        """Ids held under this quota (for invariant checks)."""
        return frozenset(self._held)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks of the pool; raise CacheBudgetError beyond the quota or the pool."""
        if n < 0:
            raise InvalidRequestError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise CacheBudgetError(f"need {n} KV blocks but only {self.num_free} of {self._cap} are free")
        out = self.pool.allocate(n)
        self._held.update(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Return held ``blocks`` to the pool; all-or-nothing (ValueError on a block not held)."""
        ids = list(blocks)
        foreign = [b for b in ids if b not in self._held]
        if foreign:
            raise ValueError(f"blocks {foreign} are not held under this quota")
        self.pool.free(ids)  # also rejects repeats
        self._held.difference_update(ids)

    def give(self, blocks: Iterable[int]) -> list[int]:
        """Stop holding ``blocks`` without freeing them (another quota takes them); all-or-nothing.

        Raises:
            ValueError: a block not held, or repeated.
        """
        ids = list(blocks)
        if len(set(ids)) != len(ids) or not self._held.issuperset(ids):
            raise ValueError(f"blocks {ids} are not distinct blocks held under this quota")
        self._held.difference_update(ids)
        return ids

    def take(self, blocks: Iterable[int]) -> None:
        """Hold ``blocks`` another quota gave away (allocated in the pool, held by none); all-or-nothing.

        Raises:
            CacheBudgetError: the quota has no room for them.
            ValueError: a block is not allocated in the pool, already held here, or repeated.
        """
        ids = list(blocks)
        if len(set(ids)) != len(ids) or self._held.intersection(ids) or not all(self.pool.is_used(b) for b in ids):
            raise ValueError(f"blocks {ids} cannot be taken (not allocated, held already, or repeated)")
        if len(self._held) + len(ids) > self._cap:
            raise CacheBudgetError(f"a quota of {self._cap} blocks cannot take {len(ids)} more ({len(self._held)} held)")
        self._held.update(ids)


@dataclass(slots=True, frozen=True)
class KVRun:
    """A run of consecutive tokens stored in device blocks.

    Attributes:
        blocks: block ids; token ``i`` of the run lives at slot
            ``blocks[(start + i) // block_size] * block_size + (start + i) % block_size``.
        start: index of the run's first token within its blocks, in tokens.
        length: number of tokens, >= 0.
    """

    blocks: tuple[int, ...]
    start: int
    length: int
