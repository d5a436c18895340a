"""The tier protocol: what every level of KV storage offers the cache, and what moves KV between them.

RAGCache keeps a knowledge tree's node KV in GPU and host memory (§5.1, Fig. 8); we add a disk tier
below, and a remote tier (shared by replicas) is meant to be one more class. Each tier is one
class behind :class:`Tier` (as LMCache v1's storage backends sit behind one interface):

* :class:`~ragcache_backend.cache.device.DeviceTier`: the device arena's blocks (where attention reads);
* :class:`~ragcache_backend.cache.host.HostTier`: host buffers under a byte budget;
* :class:`~ragcache_backend.cache.disk_tier.DiskTier`: checksummed files that survive restarts.

A tier stores *copies* of a node's KV and accounts for them in bytes. It knows nothing of the
others: which copy moves where, and what happens to a victim of eviction (swapped out to the
tier below once, or dropped with its subtree), is decided by the
:class:`~ragcache_backend.cache.stack.TierStack` that composes them. Eviction order comes from
the replacement policy (a pure function, :mod:`ragcache_backend.cache.policy`) through one
:class:`~ragcache_backend.cache.evictor.Evictor` per tier.

KV copies outside the device arena are opaque :data:`KVHandle` objects made and read by a
:class:`KVMover` (the model's KV arena implements it; tests use a tensor-free simulation), so the
cache core never touches a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeAlias

from ragcache_backend.cache.knowledge_tree import Node, TierName

__all__ = ["Demote", "KVHandle", "KVMover", "NodeLocks", "Tier"]

KVHandle: TypeAlias = object
"""An opaque host-side copy of one node's KV, made and read only by the :class:`KVMover`."""

Demote = Callable[[Node], None]
"""Called by a tier with each eviction victim; it must leave the node out of that tier (copy it to
the tier below, then drop it, or remove the node)."""


class KVMover(Protocol):
    """Copies KV between the device arena and host buffers (implemented by the model's KV arena)."""

    def swap_out(self, blocks: Sequence[int], num_tokens: int) -> KVHandle:
        """Copy ``num_tokens`` tokens of KV from device ``blocks`` into a new host buffer."""
        ...

    def swap_in(self, host_kv: KVHandle, blocks: Sequence[int]) -> None:
        """Copy a host buffer back into the given device ``blocks``."""
        ...

    def host_nbytes(self, num_tokens: int) -> int:
        """Bytes of host memory a buffer of ``num_tokens`` tokens of KV takes."""
        ...

    def kv_tokens(self, host_kv: KVHandle) -> int:
        """Tokens of KV a host buffer holds (a tier refuses a buffer that does not fit its node)."""
        ...

    def free_host(self, host_kv: KVHandle) -> None:
        """Release a host buffer."""
        ...

    def host_tensors(self, host_kv: KVHandle) -> tuple:
        """``(k, v)`` CPU tensors ``[layers, tokens, kv_heads, head_dim]`` of a host buffer (the disk tier)."""
        ...

    def host_from_tensors(self, k, v) -> KVHandle:
        """A host buffer made of ``(k, v)`` read back from a lower tier (the disk tier)."""
        ...


class Tier(Protocol):
    """One level of KV storage (device, host, disk; a remote store next).

    Keys are knowledge-tree nodes: a tier reads what it records from the node (its length, its
    :attr:`~ragcache_backend.cache.knowledge_tree.Node.path_key`, its statistics). Every tier
    keeps three promises, checked for each class by ``tests/cache/test_tier_contract.py``:
    ``used_bytes <= budget_bytes`` (a tier that writes asynchronously may exceed it until its
    pending writes land: the disk tier never evicts a parent whose child is still queued);
    victims leave in the policy's order (lowest priority first, among nodes no stored child
    depends on); a node is never stored without its parent's KV being reachable, and data that
    fails a check is never served.
    """

    name: TierName

    @property
    def budget_bytes(self) -> int:
        """Capacity, in bytes."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes held now (<= ``budget_bytes``)."""
        ...

    def contains(self, node: Node) -> bool:
        """True if the tier holds (or, for an asynchronous tier, is writing) a copy of ``node``'s KV."""
        ...

    def put(self, node: Node, kv: KVHandle) -> bool:
        """Store a copy of ``node``'s KV given as a host copy ``kv`` (the tier takes ownership of it
        when it keeps host copies); False (nothing stored) when there is no room now (the caller
        makes room first with :meth:`make_room`) or the tier declines (the disk tier: its writer is
        behind, or the parent's file is neither written nor queued).

        Raises:
            InvalidRequestError: ``kv`` does not fit the node (another length), or (memory tiers)
                the node's parent is not reachable from this tier (it would be an orphan).
        """
        ...

    def get(self, node: Node) -> KVHandle | None:
        """A host copy of ``node``'s KV, or None when the tier does not hold it or its copy fails a
        check (then it is dropped and counted). The host tier returns the copy it keeps; the other
        tiers make a new one, which the caller frees with the mover unless it hands it on."""
        ...

    def drop(self, node: Node) -> None:
        """Release this tier's copy of ``node`` (no-op when it holds none).

        Raises:
            InvalidRequestError: (the disk tier) copies of its children are stored below it.
        """
        ...

    def make_room(self, nbytes: int, demote: Demote) -> bool:
        """Evict victims, lowest priority first, until ``nbytes`` more fit; each goes to ``demote``.
        False, with nothing evicted, when locked data makes it impossible."""
        ...

    def eviction_order(self) -> list[str]:
        """Path keys of the current eviction candidates, first victim first (a view; changes nothing)."""
        ...


class NodeLocks:
    """Nodes in use by running requests (``lock_ref > 0``): never evicted, always on device.

    Shared by the tiers (a locked node is no eviction candidate anywhere) and the cache, which
    locks a request's path at admission and releases it when the request finishes.
    """

    __slots__ = ("_locked", "_on_unlock")

    def __init__(self) -> None:
        self._locked: set[Node] = set()
        self._on_unlock: Callable[[Node], None] = lambda _n: None

    def on_unlock(self, hook: Callable[[Node], None]) -> None:
        """Call ``hook(node)`` whenever a node's last lock goes (it may become an eviction candidate);
        replaces the previous hook (the one owner is the cache's tier stack)."""
        self._on_unlock = hook

    def lock(self, node: Node) -> None:
        """One more running request uses ``node``."""
        node.lock_ref += 1
        self._locked.add(node)

    def unlock(self, node: Node) -> None:
        """One request fewer uses ``node``; the hook runs when none is left."""
        node.lock_ref -= 1
        if node.lock_ref == 0:
            self._locked.discard(node)
            self._on_unlock(node)

    def __len__(self) -> int:
        return len(self._locked)

    def __iter__(self) -> Iterator[Node]:
        return iter(self._locked)

    def __contains__(self, node: object) -> bool:
        return node in self._locked

    def as_set(self) -> frozenset[Node]:
        return frozenset(self._locked)
