"""The tiers in order, and every move of KV between them (RAGCache §5.1, Alg. 1, Fig. 8).

:class:`TierStack` composes the device tier, the host tier and, when attached, the disk tier
(:mod:`ragcache_backend.cache.tier`). Each tier keeps its own budget and eviction order; the stack
decides what eviction *means* across them:

* **Device eviction** (Alg. 1 EVICT_IN_GPU): the victim's KV is swapped out to host *once*: the
  first device eviction of a node copies it, later ones just free its blocks, since the host copy
  lives until the host evicts it. If the host cannot take it (tier off, or full of locked data)
  the node and its host-only subtree leave the tree.
* **Host eviction** frees the host copy; a node then resident nowhere leaves the tree.
* Invariants: a node's parent is in the same or a faster tier (device nodes are parents of host
  nodes); no tier exceeds its budget; locked nodes (used by running requests) are never evicted
  and always sit on device.
* **The disk tier** below: nodes inserted by a commit are queued for it (with their missing
  ancestors) off the critical path, and a prefix match that runs past what memory holds
  continues there, reading files back into the host tier.
* **The remote tier** below that (Redis shared by replicas, when attached): the same nodes are
  sent to it once, and a match that runs past the disk tier continues there (entries with their
  token ids only; read back into the host tier; counted as disk hits, and as ``remote_hits``).
* **Replicas** (RAGCache §6): nodes at the top of the tree (the system prompt) get a host copy
  when inserted, so a device failure loses no hot prefix and their later eviction costs no copy.
* **A shared pool** (a CPU: the arena and the host tier are the same DRAM, one pool of blocks
  under two budgets): a device victim's blocks are handed to the host tier and a host hit's
  blocks handed back, with no copy (``moved_out`` / ``moved_in``); a node is in one of the two at
  a time, so there are no replicas (a copy in the same memory protects nothing).

The stack moves KV only through the tiers and the :class:`~ragcache_backend.cache.tier.KVMover`;
it never touches tensors. Not thread-safe: callers serialize access.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ragcache_backend.cache.chunk_reuse import VariantInfo
from ragcache_backend.cache.device import DeviceTier
from ragcache_backend.cache.disk import DiskEntry
from ragcache_backend.cache.disk_tier import DiskTier
from ragcache_backend.cache.host import HostTier
from ragcache_backend.cache.remote_tier import RemoteTier
from ragcache_backend.cache.knowledge_tree import KnowledgeTree, Node, SegmentKey, TierName, path_key
from ragcache_backend.cache.tier import KVHandle, NodeLocks
from ragcache_backend.errors import InvalidRequestError

__all__ = ["CacheStats", "TierStack"]


@dataclass(slots=True, frozen=True)
class _DiskRead:
    """A file of the disk tier read back for a prefix match: its entry and its KV as a host copy
    (None: the file was gone or failed verification)."""

    entry: DiskEntry
    kv: KVHandle | None


@dataclass(slots=True)
class CacheStats:
    """Counters since construction (nodes unless stated)."""

    device_hits: int = 0
    host_hits: int = 0
    misses: int = 0  # nodes computed (record_request)
    swap_outs: int = 0  # device -> host copies
    device_frees_without_copy: int = 0  # device evictions of nodes already on host
    device_evictions: int = 0
    host_evictions: int = 0
    dropped_nodes: int = 0  # removed from the cache because the host could not take them
    swap_ins: int = 0  # host -> device copies
    moved_out: int = 0  # device -> host moves in a shared pool (blocks handed over, no copy)
    moved_in: int = 0  # host -> device moves in a shared pool (a host hit attended in place, no copy)
    copy_s: float = 0.0  # seconds spent in KV copies between tiers (swap out + swap in)
    variant_hits: int = 0  # chunks served from a cached variant (approximate hits)
    variants_added: int = 0  # chunk variants recorded
    variant_evictions: int = 0  # variants dropped by the per-chunk or total cap (lowest f_r)
    disk_hits: int = 0  # nodes read back from the disk tier (then served as host hits are)
    disk_queued: int = 0  # nodes handed to the disk tier's writer
    remote_hits: int = 0  # nodes read back from the remote tier (counted in disk_hits too: below memory)
    remote_queued: int = 0  # nodes handed to the remote tier's writer
    host_replicas: int = 0  # upper nodes given a host copy at insertion (fault tolerance, RAGCache §6)


class TierStack:
    """Device, host and (optionally) disk tiers over one knowledge tree.

    Args:
        tree: the knowledge tree whose nodes the tiers hold.
        device, host: the memory tiers (sharing ``locks``).
        locks: the nodes running requests hold.
        stats: the cache's counters, updated here for every move.
    """

    def __init__(self, tree: KnowledgeTree, device: DeviceTier, host: HostTier, locks: NodeLocks,
                 stats: CacheStats) -> None:
        self.tree = tree
        self.device = device
        self.host = host
        self.locks = locks
        self.stats = stats
        self.disk: DiskTier | None = None
        self.remote: RemoteTier | None = None
        #: nodes at this depth or above (1 = the system-prompt level) get a host copy when inserted
        self.replica_depth = 1
        self._to_persist: list[Node] = []  # exact nodes inserted since the last persist_pending
        locks.on_unlock(self.refresh)

    # ---- locks and eviction candidates --------------------------------------------------------
    def lock(self, node: Node) -> None:
        """One more running request uses ``node`` (never evicted while locked)."""
        self.locks.lock(node)

    def unlock(self, node: Node) -> None:
        """One request fewer uses ``node``; at zero it may become an eviction candidate."""
        self.locks.unlock(node)

    def release(self, nodes: Sequence[Node]) -> None:
        """Unlock ``nodes`` (lock_ref -= 1 each); all-or-nothing.

        Raises:
            InvalidRequestError: a node would be released more often than it was locked.
        """
        for node, times in Counter(nodes).items():
            if node.lock_ref < times:
                raise InvalidRequestError(f"{node!r} released more often than it was locked")
        for node in nodes:
            self.locks.unlock(node)

    def refresh(self, node: Node) -> None:
        """``node`` may have become an eviction candidate (unlocked, lost a child)."""
        for name in node.tiers:
            self._memory(name).evictor.offer(node)

    def reprice(self, node: Node) -> None:
        """The node's statistics changed: its priority in every tier it is in (Alg. 1 line 13)."""
        for name in node.tiers:
            self._memory(name).evictor.reprice(node)

    def _memory(self, name: TierName) -> DeviceTier | HostTier:
        return self.device if name is TierName.DEVICE else self.host

    # ---- eviction (Alg. 1) --------------------------------------------------------------------
    def make_device_room(self, num_blocks: int) -> bool:
        """Evict device leaves until ``num_blocks`` blocks are free; False (nothing evicted) if locks forbid."""
        return self.device.make_room_blocks(num_blocks, self._demote_from_device)

    def make_host_room(self, nbytes: int) -> bool:
        """Evict host copies until ``nbytes`` more fit; False (nothing evicted) if impossible."""
        return self.host.make_room(nbytes, self._demote_from_host)

    def _demote_from_device(self, n: Node) -> None:
        parent = n.parent
        self.stats.device_evictions += 1
        if n.in_host:
            self.stats.device_frees_without_copy += 1  # swap out only once
            self.device.drop(n)
        elif self.swap_out(n):
            self.device.drop(n)
        else:
            removed = self.tree.remove(n)
            for m in removed:
                assert m.lock_ref == 0, f"dropping locked {m!r}"
                self.free_kv(m)
            self.stats.dropped_nodes += len(removed)
        if parent is not None:
            self.refresh(parent)  # lines 22-23: a parent that became a leaf joins

    def _demote_from_host(self, m: Node) -> None:
        parent = m.parent
        self.host.drop(m)
        self.stats.host_evictions += 1
        if not m.in_device:
            self.tree.remove(m)  # resident nowhere; a candidate has no resident child
        if parent is not None:
            self.refresh(parent)

    def remove(self, node: Node) -> None:
        """Take ``node`` and its subtree out of the tree, freeing their KV in every tier."""
        parent = node.parent
        for m in self.tree.remove(node):
            self.free_kv(m)
        if parent is not None and not parent.is_root:
            self.refresh(parent)

    def free_kv(self, m: Node) -> None:
        """Free ``m``'s copies in the memory tiers (it has left, or is leaving, the tree)."""
        if m.device_blocks is not None:
            self.device.drop(m)
        if m.host_kv is not None:
            self.host.drop(m)
        m.priority.clear()

    def clear(self) -> None:
        """Drop every node not needed by a locked node (locked nodes and their ancestors stay)."""
        order = list(self.tree)
        keep: set[Node] = set()
        for n in reversed(order):
            if n.lock_ref > 0 or any(c in keep for c in n.children.values()):
                keep.add(n)
        for n in order:  # parents first; descendants of a dropped node have parent None
            if n not in keep and n.parent is not None:
                self.remove(n)

    # ---- copies between memory tiers ---------------------------------------------------------
    @property
    def shared_pool(self) -> bool:
        """The device and host tiers share one pool of arena blocks (moves between them copy nothing)."""
        return self.host.shared

    def swap_out(self, n: Node) -> bool:
        """Copy device node ``n``'s KV to host, making room there; False if the host cannot take it.
        In a shared pool the node *moves*: its blocks are handed to the host tier, no copy."""
        if not self.make_host_room(self.host.nbytes(n.num_tokens)):
            return False
        if self.shared_pool:
            if not self.host.take(n, self.device.release(n)):
                raise AssertionError(f"host room was made for {n!r} but it does not fit")
            self.stats.moved_out += 1
            return True
        t0 = time.perf_counter()
        try:
            kv = self.device.get(n)
        finally:
            self.stats.copy_s += time.perf_counter() - t0
        try:
            placed = self.host.put(n, kv)
        except BaseException:
            self.device.mover.free_host(kv)
            raise
        if not placed:
            self.device.mover.free_host(kv)
            raise AssertionError(f"host room was made for {n!r} but it does not fit")
        self.stats.swap_outs += 1
        return True

    def swap_in(self, node: Node) -> bool:
        """Copy a locked host-only ``node`` into new device blocks; False (nothing changed) if no
        room can be made. On a failed copy the blocks are freed and the error propagates. In a
        shared pool the node moves: its host blocks become its device blocks, no copy."""
        if not self.make_device_room(self.device.blocks_for(node.num_tokens)):
            return False
        if self.shared_pool:
            self.device.take(node, self.host.release(node))
            self.stats.moved_in += 1
            return True
        c0 = self.device.copy_s
        try:
            placed = self.device.put(node, node.host_kv)
        finally:
            self.stats.copy_s += self.device.copy_s - c0
        if not placed:
            raise AssertionError(f"device room was made for {node!r} but it does not fit")
        self.stats.swap_ins += 1
        return True

    def acquire_node(self, node: Node) -> bool:
        """Lock ``node`` and make sure it is on device (its parent already is, and stays there while
        room is made: it is held for the swap-in); False, unlocked, if there is no room."""
        self.lock(node)
        if node.in_device:
            return True
        parent = node.parent if node.parent is not None and not node.parent.is_root else None
        if parent is not None:
            self.lock(parent)
        try:
            if not self.swap_in(node):
                self.unlock(node)
                return False
        except BaseException:
            self.unlock(node)
            raise
        finally:
            if parent is not None:
                self.unlock(parent)
        return True

    # ---- the disk tier and replicas -----------------------------------------------------------
    def read_back(self, nodes: Sequence[Node], keys: Sequence[SegmentKey],
                  restore: Callable[[Node, VariantInfo | None], None],
                  tokens: Sequence[Sequence[int]] = ()) -> list[Node]:
        """Continue a prefix match on the disk tier: after the resident path ``nodes``, each further
        key whose file exists is read (checksum verified) into the host tier as a new node;
        ``restore`` gives it back its chunk-variant record. Returns the new nodes (unlocked).
        Stops at the first key not on disk, a file whose recorded tokens differ from ``tokens``
        (per key; empty: not compared), a file that fails verification (deleted, to be
        recomputed), or a host tier with no room. The run of files on disk is read several at
        once (:meth:`_disk_run`); where it ends short of the host tier's budget, the remote tier is
        asked key by key."""
        disk, remote = self.disk, self.remote
        if ((disk is None and remote is None) or len(nodes) >= len(keys) or any(n.approximate for n in nodes)
                or not self.host.enabled):
            return []
        for n in nodes:
            self.lock(n)  # room made in host below must not evict the path being extended
        loaded: list[Node] = []
        parent = nodes[-1] if nodes else self.tree.root
        run: list[_DiskRead] = []
        try:
            run, at_budget = self._disk_run(parent, keys, tokens, len(nodes))
            for i in range(len(nodes), len(keys)):
                key, want = keys[i], tuple(tokens[i]) if i < len(tokens) else ()
                if key in parent.children:
                    break
                pkey = path_key(parent.path_key, key)
                if run and run[0].entry.path_key == pkey:
                    read = run[0]  # stays in the run (freed below) until a node takes its copy
                    if not self.make_host_room(self.host.nbytes(read.entry.num_tokens)):
                        break
                    node = self.tree.add_child(parent, key, read.entry.num_tokens, read.entry.tokens)
                    run.pop(0)
                    if not self._fill_from_disk(node, read.entry, read.kv):
                        break
                    restore(node, read.entry.variant)
                elif at_budget:  # on disk past what the host tier holds: not a key to ask Redis for
                    break
                elif remote is not None and want:  # an entry is never served without its token ids
                    node = self._read_remote(parent, key, pkey, want)
                    if node is None:
                        break
                else:
                    break
                self.lock(node)
                loaded.append(node)
                parent = node
        finally:
            for r in run:  # read but not used: no room, or the path ended first
                if r.kv is not None:
                    self.device.mover.free_host(r.kv)
            for n in list(nodes) + loaded:
                self.unlock(n)
        self.stats.disk_hits += len(loaded)
        return loaded

    def _disk_run(self, parent: Node, keys: Sequence[SegmentKey], tokens: Sequence[Sequence[int]],
                  start: int) -> tuple[list[_DiskRead], bool]:
        """The files of ``keys[start:]`` under ``parent`` that are on disk with the wanted tokens,
        up to the first that is not (or up to the host tier's budget in bytes), read and verified
        several at once; each with its KV as a host copy (None: gone or damaged). With it, whether
        the run stopped at the budget (the next key is on disk too)."""
        if self.disk is None:
            return [], False
        entries, pkey, nbytes, at_budget = [], parent.path_key, 0, False
        for i in range(start, len(keys)):
            key, want = keys[i], tuple(tokens[i]) if i < len(tokens) else ()
            if i == start and key in parent.children:
                break
            pkey = path_key(pkey, key)
            entry = self.disk.lookup(pkey)
            if entry is None or (want and entry.tokens != want):
                break
            nbytes += self.host.nbytes(entry.num_tokens)
            if entries and nbytes > self.host.budget_bytes:
                at_budget = True
                break
            entries.append(entry)
        return [_DiskRead(e, kv) for e, kv in zip(entries, self.disk.read_many(entries))], at_budget  # one file: inline

    def _read_remote(self, parent: Node, key: SegmentKey, pkey: str, tokens: tuple[int, ...]) -> Node | None:
        """A new host node for ``key`` under ``parent`` from the remote tier, or None (absent,
        damaged, Redis down, or no host room)."""
        kv = self.remote.read(pkey, tokens)
        if kv is None:
            return None
        if not self.make_host_room(self.host.nbytes(len(tokens))):
            self.device.mover.free_host(kv)
            return None
        node = self.tree.add_child(parent, key, len(tokens), tokens)
        try:
            node.num_computed = 1
            if not self.host.put(node, kv):
                raise AssertionError(f"host room was made for {node!r} but it does not fit")
        except BaseException:
            if node.host_kv is None:
                self.device.mover.free_host(kv)
            if self.tree.contains(node):
                self.tree.remove(node)
            self.host.drop(node)
            raise
        self.stats.remote_hits += 1
        return node

    def _fill_from_disk(self, node: Node, entry: DiskEntry, kv: KVHandle | None) -> bool:
        """Give a new, empty ``node`` its KV read back from the disk tier (``kv``, a host copy the
        stack now owns; None: the file was gone or damaged) with the file's statistics; False, the
        node removed from the tree, if there is none.
        Raises what the host tier raises, the node removed and its copy freed."""
        try:
            if kv is None:
                self.tree.remove(node)
                return False
            node.frequency, node.total_cost, node.num_computed = entry.frequency, entry.avg_cost, 1
            if not self.host.put(node, kv):
                raise AssertionError(f"host room was made for {node!r} but it does not fit")
            return True
        except BaseException:
            if kv is not None and node.host_kv is None:
                self.device.mover.free_host(kv)
            if self.tree.contains(node):
                self.tree.remove(node)
            self.host.drop(node)
            raise

    def after_insert(self, node: Node, depth: int) -> None:
        """A commit inserted ``node`` at ``depth`` (1 = a child of the root): queue it for the disk
        tier; an upper node also gets a host copy now (RAGCache §6 replica)."""
        if (self.disk is not None or self.remote is not None) and not node.approximate:
            self._to_persist.append(node)
        if (depth <= self.replica_depth and not node.in_host and self.host.enabled and node.lock_ref
                and not self.shared_pool):
            if self.swap_out(node):
                self.stats.host_replicas += 1

    def persist_pending(self, max_bytes: int = 64 << 20) -> int:
        """Hand nodes inserted since the last call to the disk tier (their missing ancestors first),
        copying device-only KV to host memory for it; at most ``max_bytes`` of KV are copied per
        call (the rest waits). Returns the nodes queued."""
        disk, remote = self.disk, self.remote
        if (disk is None and remote is None) or not self._to_persist:
            return 0
        todo, self._to_persist = self._to_persist, []
        queued = copied = 0
        for i, node in enumerate(todo):
            if copied >= max_bytes:
                self._to_persist = todo[i:] + self._to_persist
                break
            if node.parent is None or not node.resident or node.approximate:
                continue  # evicted meanwhile, or removed
            disk_ok = disk is not None  # False once a disk write is skipped: descendants would be orphans
            for n in KnowledgeTree.path_to(node):
                to_disk = disk_ok and not disk.contains(n)
                to_remote = remote is not None and len(n.tokens) == n.num_tokens and not remote.sent(n)
                if not (to_disk or to_remote):
                    continue
                if not n.resident:
                    break
                # the host tier's own copy, or a temporary one (from device, or from a shared pool)
                borrowed = n.in_host and self.host.borrows
                kv = self.host.get(n) if n.in_host else self.device.get(n)
                try:
                    if to_disk:
                        disk_ok = disk.put(n, kv)
                        queued += disk_ok
                    if to_remote and remote.put(n, kv):
                        self.stats.remote_queued += 1
                finally:
                    if not borrowed:
                        copied += self.host.nbytes(n.num_tokens)
                        self.device.mover.free_host(kv)  # the writers keep its tensors
        self.stats.disk_queued += queued
        return queued

    def close_disk(self, timeout: float | None = 30.0) -> None:
        """Finish the disk and remote tiers' queued writes (up to ``timeout`` seconds each) and stop
        their writers."""
        if self.disk is not None:
            self.disk.close(timeout)
        if self.remote is not None:
            self.remote.close(10.0 if timeout is None else timeout)
