"""The remote tier behind the cache: a :class:`~ragcache_backend.cache.remote.RemoteStore` (Redis
shared by replicas) seen by the tier stack, as :class:`~ragcache_backend.cache.disk_tier.DiskTier`
adapts the disk store.

It sits below the disk tier: a prefix match that runs past memory and disk continues here (an
entry read back becomes a host copy, token ids and checksum verified by the store), and exact nodes
a commit inserted are sent here as to the disk tier, each once. Entries are independent values in
Redis (Redis may evict any of them), so there is no parent rule on writes: a lookup stops at the
first block it does not find.
"""

from __future__ import annotations

from collections.abc import Sequence

from ragcache_backend.cache.knowledge_tree import Node
from ragcache_backend.cache.remote import RemoteStore
from ragcache_backend.cache.tier import KVHandle, KVMover
from ragcache_backend.errors import InvalidRequestError

__all__ = ["RemoteTier"]


class RemoteTier:
    """``store`` as the tier below the disk tier.

    Args:
        store: the Redis-backed store of entries.
        mover: converts host copies to tensors and back.
        max_sent: path keys remembered as sent (a key forgotten is sent again; Redis keeps the first).
    """

    def __init__(self, store: RemoteStore, mover: KVMover, max_sent: int = 1 << 20) -> None:
        self.store = store
        self._mover = mover
        self._sent: dict[str, None] = {}
        self._max_sent = max_sent

    def sent(self, node: Node) -> bool:
        """True if this process already sent ``node`` (or read it from here)."""
        return node.path_key in self._sent

    def put(self, node: Node, kv: KVHandle) -> bool:
        """Queue the node's entry (its host copy's tensors, shared: host copies are never changed);
        False when skipped (Redis down, writer behind).

        Raises:
            InvalidRequestError: ``kv`` holds another number of tokens than the node, or the node
                records no token ids (an entry is never served without them).
        """
        if self._mover.kv_tokens(kv) != node.num_tokens or len(node.tokens) != node.num_tokens:
            raise InvalidRequestError(f"{node!r} cannot be sent to the remote tier (KV or token ids missing)")
        parent = node.parent.path_key if node.parent is not None else ""
        k, v = self._mover.host_tensors(kv)
        ok = self.store.put(node.path_key, parent, node.key, k, v, tuple(node.tokens), node.stats().avg_cost)
        if ok:
            self._remember(node.path_key)
        return ok

    def read(self, pkey: str, tokens: Sequence[int]) -> KVHandle | None:
        """Entry ``pkey`` as a new host copy (the caller owns it) if it is there and records exactly
        ``tokens``; else None."""
        kv = self.store.get(pkey, tuple(tokens))
        if kv is None:
            return None
        self._remember(pkey)
        return self._mover.host_from_tensors(*kv)

    def holds(self, pkeys: Sequence[str]) -> list[bool]:
        """Whether each entry is there (one round trip; all False while Redis is unreachable)."""
        return self.store.exists(pkeys)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (bounded wait) and stop the writer."""
        self.store.close(timeout)

    def _remember(self, pkey: str) -> None:
        self._sent[pkey] = None
        if len(self._sent) > self._max_sent:
            self._sent.pop(next(iter(self._sent)))
