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

__all__ = ["BlockAllocator", "KVRun", "blocks_for"]


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
