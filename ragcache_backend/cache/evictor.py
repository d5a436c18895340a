"""One tier's eviction order: a lazy min-heap of candidates under the policy, and the tier's clock.

RAGCache Alg. 1 EVICT pops the lowest-priority *leaf* of a tier (a node no resident child in that
tier depends on), advances the tier's logical clock to its priority (eq. 2) and lets its parent
join the candidates. Every tier (device, host, disk) uses one :class:`Evictor`; what makes an
item a candidate is the tier's predicate, and its priority is the policy's pure function of the
item's statistics and the clock (:mod:`ragcache_backend.cache.policy`).

Candidates live in a lazy heap: an entry is pushed whenever an item may have become a candidate
or changed priority, and stale entries are skipped when popped (an entry is live while its item
is a candidate with the same priority and last access), so a victim costs O(log n) instead of a
scan. Not thread-safe: the owner serializes access.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from ragcache_backend.cache.policy import NodeStats, PolicyFn

__all__ = ["Evictable", "Evictor"]


class Evictable(Protocol):
    """What the evictor reads of an item (a tree node, a disk entry)."""

    priority: dict[Any, float]  # per tier (name) the item is priced in
    last_access: int
    serial: int  # creation order: the last tie-breaker

    def stats(self) -> NodeStats: ...


T = TypeVar("T", bound=Evictable)


class Evictor(Generic[T]):
    """Eviction candidates of one tier, lowest priority first.

    Args:
        tier: the tier's name; an item's priority in this tier is ``item.priority[tier]``.
        policy: ``(stats, clock) -> priority``; lower is evicted first.
        is_candidate: whether an item may be evicted now (unlocked, nothing depends on it here).
    """

    __slots__ = ("tier", "clock", "_policy", "_is_candidate", "_heap", "_priced")

    def __init__(self, tier: str, policy: PolicyFn, is_candidate: Callable[[T], bool]) -> None:
        self.tier = tier
        self.clock = 0.0
        self._policy = policy
        self._is_candidate = is_candidate
        self._heap: list[tuple[float, int, int, T]] = []
        self._priced = 0

    def reprice(self, item: T) -> float:
        """Set the item's priority under the current clock (Alg. 1 line 13) and offer it."""
        if self.tier not in item.priority:
            self._priced += 1
        prio = item.priority[self.tier] = self._policy(item.stats(), self.clock)
        self.offer(item)
        return prio

    def offer(self, item: T) -> None:
        """Push the item if it is a candidate now (after it was unlocked or lost a child)."""
        if self.tier in item.priority and self._is_candidate(item):
            heap = self._heap
            heapq.heappush(heap, (item.priority[self.tier], item.last_access, item.serial, item))
            if len(heap) > 2 * self._priced + 64:  # too many stale entries: compact
                live = {e[3]: e for e in heap if self._is_live(e)}
                self._heap = heap = list(live.values())
                heapq.heapify(heap)

    def forget(self, item: T) -> None:
        """The item left the tier: drop its priority (its heap entries go stale)."""
        if item.priority.pop(self.tier, None) is not None:
            self._priced -= 1

    def pop(self) -> T:
        """The lowest-priority candidate; the clock becomes ``max(clock, its priority)`` (eq. 2).
        The item stays priced until the tier :meth:`forget` s it.

        Raises:
            LookupError: no candidate (the caller's room pre-check was wrong).
        """
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            if self._is_live(entry):
                self.clock = max(self.clock, entry[0])
                return entry[3]
        raise LookupError(f"{self.tier} eviction ran out of candidates")

    def is_candidate(self, item: T) -> bool:
        """Whether the tier may evict ``item`` now (its predicate; the item need not be in the heap)."""
        return self._is_candidate(item)

    def evict(self, demote: Callable[[T], None]) -> T:
        """:meth:`pop` the next victim and hand it to ``demote`` (which takes it out of the tier);
        if ``demote`` raises, the victim is still there and is offered again before the error goes on.

        Raises:
            LookupError: no candidate. Whatever ``demote`` raises.
        """
        victim = self.pop()
        try:
            demote(victim)
        except BaseException:
            self.offer(victim)
            raise
        return victim

    def candidates(self) -> set[T]:
        """Items with a live heap entry (for invariant checks)."""
        return {e[3] for e in self._heap if self._is_live(e)}

    def order(self) -> list[T]:
        """Live candidates in the order they would be evicted (a view; nothing changes)."""
        seen: set[int] = set()
        out: list[T] = []
        for e in sorted(self._heap, key=lambda e: e[:3]):
            if id(e[3]) not in seen and self._is_live(e):
                seen.add(id(e[3]))
                out.append(e[3])
        return out

    def _is_live(self, entry: tuple[float, int, int, T]) -> bool:
        prio, last, _, item = entry
        return self._is_candidate(item) and item.priority.get(self.tier) == prio and item.last_access == last
