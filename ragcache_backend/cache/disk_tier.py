"""The disk tier behind the tier protocol: a :class:`~ragcache_backend.cache.disk.DiskStore` seen as a tier.

The store deals in path keys and CPU tensors (files, an index, a writer thread); the cache deals
in tree nodes and host copies. This adapter maps one to the other: a node's file is named by its
:attr:`~ragcache_backend.cache.knowledge_tree.Node.path_key`, a host copy becomes tensors through
the :class:`~ragcache_backend.cache.tier.KVMover` on the way down and back on the way up. It also
offers what only a tier below memory needs: looking an entry up by path key before any node
exists for it (a prefix match continuing on disk after a restart), and the chunk variants it holds.
A remote tier shared by replicas is meant to be another class of this shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ragcache_backend.cache.chunk_reuse import VariantInfo
from ragcache_backend.cache.disk import DiskEntry, DiskStore
from ragcache_backend.cache.knowledge_tree import Node, TierName
from ragcache_backend.cache.tier import Demote, KVHandle, KVMover
from ragcache_backend.errors import InvalidRequestError

__all__ = ["DiskTier"]


class DiskTier:
    """``store`` as the tier below host memory.

    Args:
        store: the folder of KV files.
        mover: converts host copies to tensors and back.
        keep_variant: whether a node's chunk-variant record is written with it (the cache's
            variant store says: records of its model and dtype only); default all.

    Writes are asynchronous: :meth:`put` queues a file and returns; :meth:`contains` is true from
    then on. The store evicts by its own policy when a write lands over the budget.
    """

    name = TierName.DISK

    def __init__(self, store: DiskStore, mover: KVMover,
                 keep_variant: Callable[[VariantInfo], bool] = lambda _info: True) -> None:
        self.store = store
        self._keep_variant = keep_variant
        self._mover = mover

    @property
    def budget_bytes(self) -> int:
        """The folder's budget, bytes."""
        return self.store.budget_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the files written (queued writes not counted)."""
        return self.store.used_bytes

    # ---- the tier protocol -------------------------------------------------------------------
    def contains(self, node: Node) -> bool:
        """True if the node's file is written or queued."""
        return self.store.contains(node.path_key)

    def put(self, node: Node, kv: KVHandle) -> bool:
        """Queue the node's file (its KV, statistics and, for a variant of this fingerprint, its
        record); False when the store skips it (see :meth:`DiskStore.put`).

        Raises:
            InvalidRequestError: ``kv`` holds another number of tokens than the node.
        """
        if self._mover.kv_tokens(kv) != node.num_tokens:
            raise InvalidRequestError(f"a copy of {self._mover.kv_tokens(kv)} tokens cannot be {node!r}'s KV")
        parent = node.parent.path_key if node.parent is not None else ""
        k, v = self._mover.host_tensors(kv)
        info = node.variant if node.variant is not None and self._keep_variant(node.variant) else None
        return self.store.put(node.path_key, parent, node.key, k, v, node.stats(), variant=info, tokens=node.tokens)

    def get(self, node: Node) -> KVHandle | None:
        """The node's KV read back and verified as a new host copy (the caller owns it), or None
        (absent, another length, or damaged: a damaged file is deleted and counted)."""
        entry = self.store.lookup(node.path_key)
        if entry is None or entry.num_tokens != node.num_tokens:
            return None
        return self.read(entry)

    def drop(self, node: Node) -> None:
        """Delete the node's file (a queued write of it is discarded when it lands).

        Raises:
            InvalidRequestError: files of its children are on disk or queued (they would be orphans).
        """
        self.store.delete(node.path_key)

    def make_room(self, nbytes: int, demote: Demote) -> bool:
        """The store evicts by itself when a write lands; True if ``nbytes`` can fit at all."""
        return 0 < nbytes <= self.store.budget_bytes

    def eviction_order(self) -> list[str]:
        """Path keys of the files no other file hangs from, first victim first."""
        return self.store.eviction_order()

    # ---- a tier below memory -------------------------------------------------------------------
    def lookup(self, pkey: str) -> DiskEntry | None:
        """The entry of path key ``pkey`` (a node that may not exist in memory), or None."""
        return self.store.lookup(pkey)

    def read(self, entry: DiskEntry) -> KVHandle | None:
        """Entry ``entry``'s KV as a host copy, or None if its file is gone or damaged."""
        kv = self.store.load(entry)
        return None if kv is None else self._mover.host_from_tensors(*kv)

    def read_many(self, entries: Sequence[DiskEntry]) -> list[KVHandle | None]:
        """:meth:`read` of each entry, in order, the files read and verified several at once
        (:meth:`DiskStore.load_many`); None where a file is gone or damaged."""
        return [None if kv is None else self._mover.host_from_tensors(*kv) for kv in self.store.load_many(entries)]

    def variants(self, chunk: str, num_tokens: int) -> list[DiskEntry]:
        """Entries that are variants of ``chunk`` of ``num_tokens`` tokens (any fingerprint: the
        caller filters), oldest first."""
        return [e for e in self.store.variants(chunk) if e.num_tokens == num_tokens]

    def path_keys(self, pkey: str) -> list[str] | None:
        """Segment keys from the root to entry ``pkey`` (None if it or an ancestor is gone)."""
        return self.store.path_keys(pkey)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued writes (up to ``timeout`` seconds) and stop the writer."""
        self.store.close(timeout)
