"""Cache replacement policies for the knowledge tree, as pure functions.

A policy maps a node's statistics and its tier's logical clock to a priority; the node with the
*lowest* priority is evicted first (RAGCache §5.1, Alg. 1 line 19). The clock is advanced by the
cache manager on eviction (eq. 2), not here. ``pgdsf`` is the paper's policy; ``gdsf``, ``lru`` and
``lfu`` are the baselines of the ablation (RAGCache §7, Table 2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ragcache_backend.errors import UnknownPolicyError

__all__ = ["NodeStats", "PolicyFn", "POLICIES", "get_policy", "pgdsf", "gdsf", "lru", "lfu"]


@dataclass(slots=True, frozen=True)
class NodeStats:
    """What a policy may look at for one knowledge-tree node.

    Attributes:
        frequency: number of requests that referenced the node (Alg. 1 line 3).
        avg_cost: mean prefill time per non-cached token, in seconds per token, over the requests
            that had to compute the node (eq. 3, Alg. 1 line 12); 0.0 if never computed.
        num_tokens: size of the node's segment, in tokens.
        last_access: value of the cache's logical access counter at the node's last reference
            (0 = never referenced).
    """

    frequency: int
    avg_cost: float
    num_tokens: int
    last_access: int


PolicyFn = Callable[[NodeStats, float], float]
"""``(stats, clock) -> priority``; lower is evicted first."""


def pgdsf(stats: NodeStats, clock: float) -> float:
    """PGDSF: eq. 1 with Cost/Size replaced by eq. 3's AvgCost (Alg. 1 line 13)."""
    return clock + stats.frequency * stats.avg_cost


def gdsf(stats: NodeStats, clock: float) -> float:
    """GDSF, eq. 1 with cost proportional to size (RAGCache §7), so Cost/Size = 1."""
    return clock + stats.frequency


def lru(stats: NodeStats, clock: float) -> float:
    """LRU: the least recently referenced node goes first (the clock is ignored)."""
    return float(stats.last_access)


def lfu(stats: NodeStats, clock: float) -> float:
    """LFU: the least frequently referenced node goes first (the clock is ignored)."""
    return float(stats.frequency)


POLICIES: Mapping[str, PolicyFn] = MappingProxyType(
    {"pgdsf": pgdsf, "gdsf": gdsf, "lru": lru, "lfu": lfu}
)


def get_policy(name: str) -> PolicyFn:
    """Return the registered policy called ``name``; raise UnknownPolicyError otherwise."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(POLICIES))
        raise UnknownPolicyError(
            f"unknown replacement policy {name!r}; valid policies: {valid}"
        ) from None
