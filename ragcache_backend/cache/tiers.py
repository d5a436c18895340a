"""Tiered KV cache manager over the knowledge tree (RAGCache §5.1, Alg. 1, Fig. 8).

Two tiers: ``device`` (a bounded arena of KV blocks, see :mod:`ragcache_backend.cache.blocks`) and
``host`` (a byte budget of host buffers). Which node lives where is decided by a replacement
policy (:mod:`ragcache_backend.cache.policy`, PGDSF by default) with one logical clock per tier:

* Eviction from a tier (Alg. 1 EVICT_IN_GPU) pops the lowest-priority *leaf of that tier* (an
  unlocked node with no child resident in the tier), sets ``clock = max(clock, priority)``
  (eq. 2), and adds the parent to the candidates once it becomes such a leaf.
* Swap out only once: the first device eviction of a node copies its KV to host; later device
  evictions just free the blocks, since the host copy lives until evicted from host. If the host
  cannot take the node (tier disabled, or full of locked data) the node and its host-only subtree
  are dropped. A host eviction frees the host copy; a node resident nowhere leaves the tree.
* Candidates live in one lazy min-heap per tier: an entry is pushed whenever a node may have
  become a candidate or changed priority, and stale entries are skipped when popped, so an
  eviction costs O(log n) per victim instead of a scan of the tree.
* Invariants: a node's parent is in the same or a faster tier (device nodes are parents of host
  nodes); no tier ever exceeds its budget; locked nodes (used by running requests) are never
  evicted and always sit on device.

This module never touches tensors: a :class:`KVMover` supplied by the runner copies KV between
tiers. Not thread-safe by design: callers serialize access (one scheduler thread).

Chunk-cache mode (Cache-Craft §3) uses the same tiers and budgets: a chunk *variant* is a tree node
with :class:`~ragcache_backend.cache.chunk_reuse.VariantInfo` (a document computed in chunk mode).
``admit_chunks`` serves a request's longest prefix from the tree and picks, for each later
document, the variant with the lowest CFO; ``commit_chunks`` inserts every segment the request
computed or fixed: as exact nodes while everything before it was exact, then as *approximate*
nodes (:func:`~ragcache_backend.cache.knowledge_tree.approximate_key`), which only chunk-mode
requests may match (an exact repeat of the prompt then reuses all of it, as the first answer did)
and exact requests never see; ``finish`` releases either kind of lease. Variants are capped per
chunk (M) and in total (N x M), evicting the lowest reuse score ``f_r`` (§3.3); memory pressure
evicts them like any node, by the tier's policy.

A request uses three calls (the engine, the policy replay and the tests all go through them):
``admit`` (match, lock, swap in, allocate; ``None`` when the arena has no room *now*) ->
prefill -> ``commit`` (insert the computed segments, Alg. 1 UPDATE_NODE) -> ``finish`` (unlock,
free what the request owns; always, on success, error or cancellation). The lower-level calls
they are made of (``match``, ``acquire``, ``allocate``, ``insert``, ``record_request``,
``release``, ``free``) stay public for tests.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeAlias

from ragcache_backend.cache.blocks import BlockAllocator, blocks_for
from ragcache_backend.cache.chunk_reuse import RecomputeRule, VariantInfo, VariantStats, choose_with_rule, context_keys
from ragcache_backend.cache.disk import DiskEntry, DiskStore, path_key
from ragcache_backend.cache.knowledge_tree import KnowledgeTree, Node, SegmentKey, TierName, approximate_key
from ragcache_backend.cache.lease import ChunkLease, ChunkPiece, ChunkSpec, Lease, PendingSegment, SegmentSpec, VariantUse
from ragcache_backend.errors import CacheBudgetError, InvalidRequestError
from ragcache_backend.cache.policy import get_policy
from ragcache_backend.cache.profile import PrefillProfile

__all__ = ["HostKV", "KVMover", "MatchResult", "AcquiredPrefix", "CacheStats", "TieredCache", "Lease", "SegmentSpec"]

HostKV: TypeAlias = object
"""Opaque handle to a node's KV in host memory, owned by the KVMover."""

DEVICE, HOST = TierName.DEVICE, TierName.HOST


class KVMover(Protocol):
    """Copies KV between the device arena and host buffers (implemented by the runner)."""

    def swap_out(self, blocks: Sequence[int], num_tokens: int) -> HostKV:
        """Copy ``num_tokens`` tokens of KV from device ``blocks`` into a new host buffer."""
        ...

    def swap_in(self, host_kv: HostKV, blocks: Sequence[int]) -> None:
        """Copy a host buffer back into the given device ``blocks``."""
        ...

    def host_nbytes(self, num_tokens: int) -> int:
        """Bytes of host memory a buffer of ``num_tokens`` tokens of KV takes."""
        ...

    def free_host(self, host_kv: HostKV) -> None:
        """Release a host buffer."""
        ...

    def host_tensors(self, host_kv: HostKV) -> tuple:
        """``(k, v)`` CPU tensors of a host buffer (for the disk tier only)."""
        ...

    def host_from_tensors(self, k, v) -> HostKV:
        """A host buffer made of ``(k, v)`` read from the disk tier (for the disk tier only)."""
        ...


@dataclass(slots=True, frozen=True)
class MatchResult:
    """Longest cached prefix of a request; read-only, pass it to ``acquire`` straight away."""

    nodes: tuple[Node, ...]
    tiers: tuple[TierName, ...]  # fastest tier each node was found in
    cached_tokens: int


@dataclass(slots=True)
class AcquiredPrefix:
    """A locked prefix, all on device. ``blocks[i]`` are the device block ids of ``nodes[i]``."""

    nodes: tuple[Node, ...]
    blocks: tuple[tuple[int, ...], ...]
    device_hits: int  # nodes already on device
    host_hits: int  # nodes swapped in from host
    cached_tokens: int
    disk_hits: int = 0  # nodes read back from the disk tier, then swapped in (not in host_hits)


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
    copy_s: float = 0.0  # seconds spent in KV copies between tiers (swap out + swap in)
    variant_hits: int = 0  # chunks served from a cached variant (approximate hits)
    variants_added: int = 0  # chunk variants recorded
    variant_evictions: int = 0  # variants dropped by the per-chunk or total cap (lowest f_r)
    disk_hits: int = 0  # nodes read back from the disk tier (then served as host hits are)
    disk_queued: int = 0  # nodes handed to the disk tier's writer
    host_replicas: int = 0  # upper nodes given a host copy at insertion (fault tolerance, RAGCache §6)


def _part_keys(specs: Sequence[ChunkSpec]) -> tuple[tuple[str, ...], tuple[int, ...], list[int]]:
    """Every context part's id (unique within the prompt) and length, and each spec's first part."""
    keys, lengths, first = [], [], []
    for spec in specs:
        first.append(len(keys))
        for part in spec.context_parts():
            keys.append(part.key)
            lengths.append(part.num_tokens)
    return context_keys(keys), tuple(lengths), first


class TieredCache:
    """The knowledge-tree cache manager over a device block arena and a host byte budget.

    Args:
        num_device_blocks: device arena capacity, in blocks (>= 1).
        block_size: tokens per block (>= 1); every node owns ``ceil(num_tokens / block_size)``.
        host_budget_bytes: host tier budget in bytes; 0 disables the host tier (device only).
        mover: copies KV between tiers.
        policy: a name from ``policy.POLICIES``.
        profile: prefill profile for eq. 3's cost; required by ``pgdsf``.

    Not thread-safe: callers serialize access.
    """

    def __init__(
        self,
        num_device_blocks: int,
        block_size: int,
        host_budget_bytes: int,
        mover: KVMover,
        *,
        policy: str = "pgdsf",
        profile: PrefillProfile | None = None,
    ) -> None:
        if num_device_blocks < 1:
            raise InvalidRequestError(f"num_device_blocks must be >= 1, got {num_device_blocks}")
        if block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1 token, got {block_size}")
        if host_budget_bytes < 0:
            raise InvalidRequestError(f"host_budget_bytes must be >= 0, got {host_budget_bytes}")
        self._policy = get_policy(policy)
        if policy == "pgdsf" and profile is None:
            raise InvalidRequestError("policy 'pgdsf' needs a PrefillProfile (eq. 3 cost estimate)")
        self.policy_name = policy
        self.block_size = block_size
        self.host_budget_bytes = host_budget_bytes
        self.stats = CacheStats()
        self._mover = mover
        self._profile = profile
        self._tree = KnowledgeTree()
        self._alloc = BlockAllocator(num_device_blocks)
        self._host_used = 0
        self._clock: dict[TierName, float] = {DEVICE: 0.0, HOST: 0.0}
        self._access = 0
        self._request_blocks: set[int] = set()
        self._locked: set[Node] = set()  # nodes with lock_ref > 0
        self._heaps: dict[TierName, list[tuple[float, int, int, Node]]] = {DEVICE: [], HOST: []}
        self._variants: dict[SegmentKey, list[Node]] = {}  # chunk key -> variant nodes (stale ones pruned lazily)
        self.variant_fingerprint = ""
        self.variants_per_chunk = 4
        self.max_variants = 1024
        self._disk: DiskStore | None = None
        self._to_persist: list[Node] = []  # exact nodes inserted since the last persist_pending
        #: nodes at this depth or above (1 = the system-prompt level) get a host copy when inserted
        self.replica_depth = 1

    # ----------------------------------------------------------------- read-only views
    @property
    def tree(self) -> KnowledgeTree:
        return self._tree

    @property
    def num_device_blocks(self) -> int:
        return self._alloc.num_blocks

    @property
    def device_used_blocks(self) -> int:
        """Blocks held by nodes and by running requests."""
        return self._alloc.num_used

    @property
    def request_blocks(self) -> int:
        """Blocks owned by running requests (not yet given to tree nodes)."""
        return len(self._request_blocks)

    @property
    def locked_nodes(self) -> int:
        """Tree nodes locked by running requests."""
        return len(self._locked)

    @property
    def host_used_bytes(self) -> int:
        return self._host_used

    @property
    def disk(self) -> DiskStore | None:
        """The disk tier, if attached."""
        return self._disk

    @property
    def disk_used_bytes(self) -> int:
        return self._disk.used_bytes if self._disk is not None else 0

    def clock(self, tier: TierName) -> float:
        """The tier's logical clock (eq. 2); starts at 0."""
        return self._clock[TierName(tier)]

    # ----------------------------------------------------------------- request protocol
    def admit(self, lead: Sequence[SegmentSpec], tail_tokens: int) -> Lease | None:
        """Admit one request: lock its longest cached prefix on device and give it blocks for
        every lead segment it must compute and for ``tail_tokens`` more tokens.

        Args:
            lead: the request's cacheable segments, in prompt order.
            tail_tokens: tokens past the lead the request writes (prompt rest + ``max_tokens``).

        Returns:
            a :class:`Lease`, or ``None`` when the arena has no room *now* (blocks held by running
            requests): nothing is held then, and the caller retries after a request finishes.

        Raises:
            CacheBudgetError: the request can never fit: its whole prompt plus ``max_tokens``
                needs more blocks than the arena has.
            InvalidRequestError: a segment of fewer than one token, negative ``tail_tokens``.
        """
        if tail_tokens < 0 or any(s.num_tokens < 1 for s in lead):
            raise InvalidRequestError(f"bad request shape: tail {tail_tokens}, lead {[s.num_tokens for s in lead]}")
        total = sum(blocks_for(s.num_tokens, self.block_size) for s in lead) + blocks_for(tail_tokens, self.block_size)
        cap = self._alloc.num_blocks
        if total > cap:
            raise CacheBudgetError(
                f"the request needs {total} device blocks ({total * self.block_size} tokens of KV: prompt "
                f"+ max_tokens) but the device arena holds only {cap}; raise the device budget or shorten it"
            )
        acq = self._acquire_with_disk([s.key for s in lead])
        path = list(acq.nodes)
        todo = lead[len(path):]
        need = [blocks_for(s.num_tokens, self.block_size) for s in todo]
        tail_need = blocks_for(tail_tokens, self.block_size)
        if not self._make_device_room(sum(need) + tail_need):
            self.release(path)
            return None
        pending = [PendingSegment(s, self.allocate(n)) for s, n in zip(todo, need)]
        return Lease(path=path, reused=len(path), pending=pending, tail_blocks=self.allocate(tail_need),
                     device_hits=acq.device_hits, host_hits=acq.host_hits, disk_hits=acq.disk_hits)

    def commit(self, lease: Lease, rest_tokens: int) -> None:
        """After a successful prefill: insert the lease's computed segments as tree nodes (their
        blocks change owner, no copy) and update every path node's statistics (Alg. 1).

        Args:
            lease: from :meth:`admit`, not yet committed.
            rest_tokens: prompt tokens computed past the lead (eq. 3's beta counts them).

        Raises:
            InvalidRequestError: the lease was already committed or released.
        """
        if lease.committed or lease.released:
            raise InvalidRequestError("a lease is committed once, before it is released")
        alpha = lease.cached_tokens
        beta = lease.pending_tokens + rest_tokens
        parent = lease.path[-1] if lease.path else None
        while lease.pending:
            p = lease.pending.pop(0)
            parent = self.insert(parent, p.spec.key, p.spec.num_tokens, p.blocks)
            lease.path.append(parent)
            self._after_insert(parent, len(lease.path))
        lease.committed = True
        if lease.path:  # a request that does not use the cache leaves the statistics alone
            computed = [False] * lease.reused + [True] * (len(lease.path) - lease.reused)
            self.record_request(lease.path, computed, alpha, beta)

    def finish(self, lease: Lease | ChunkLease) -> None:
        """Unlock the lease's path and free the blocks it owns; idempotent (safe in ``finally``)."""
        if lease.released:
            return
        if isinstance(lease, ChunkLease):
            self._finish_chunks(lease)
            return
        lease.released = True
        path, lease.path = lease.path, []
        pending, lease.pending = lease.pending, []
        tail, lease.tail_blocks = lease.tail_blocks, []
        if path:
            self.release(path)
        for p in pending:
            self.free(p.blocks)
        if tail:
            self.free(tail)

    # ----------------------------------------------------------------- chunk-cache mode (Cache-Craft §3)
    def configure_variants(self, *, fingerprint: str, per_chunk: int = 4, total: int = 1024) -> None:
        """Set the model fingerprint variants are recorded and served under, and the variant store's
        caps: ``per_chunk`` variants of one chunk (M) and ``total`` variants (N x M), §3.3.

        Raises:
            InvalidRequestError: a cap below 1.
        """
        if per_chunk < 1 or total < 1:
            raise InvalidRequestError(f"variant caps must be >= 1, got {per_chunk} per chunk, {total} in total")
        self.variant_fingerprint, self.variants_per_chunk, self.max_variants = fingerprint, per_chunk, total

    def variants(self, chunk: SegmentKey) -> list[Node]:
        """Resident variants of ``chunk`` recorded under this cache's fingerprint (a variant of another
        model or dtype is never served), oldest first."""
        live = [n for n in self._variants.get(chunk, ()) if n.variant is not None and n.resident and n.parent is not None]
        if live:
            self._variants[chunk] = live
        else:
            self._variants.pop(chunk, None)
        return [n for n in live if n.variant.fingerprint == self.variant_fingerprint]

    @property
    def num_variants(self) -> int:
        """Resident chunk variants (all fingerprints)."""
        return sum(len(self.variants_any(k)) for k in list(self._variants))

    def variants_any(self, chunk: SegmentKey) -> list[Node]:
        """Resident variants of ``chunk`` whatever their fingerprint."""
        self.variants(chunk)
        return list(self._variants.get(chunk, ()))

    def add_variant(self, node: Node, info: VariantInfo) -> None:
        """Record ``node`` (in the tree, resident) as a variant of ``info.stats.chunk``, then apply the
        caps (the new variant itself is never the one evicted).

        Raises:
            InvalidRequestError: the node is not a resident node of the tree.
        """
        if node.is_root or not node.resident or not self._tree.contains(node):
            raise InvalidRequestError(f"{node!r} is not a resident node of the knowledge tree")
        if self._index_variant(node, info):
            self.stats.variants_added += 1

    def _index_variant(self, node: Node, info: VariantInfo) -> bool:
        """Give ``node`` the record ``info``, index it by chunk if it was no variant yet, and apply
        the caps (``node`` is never the one evicted). Returns True if it was no variant yet."""
        fresh = node.variant is None
        node.variant = info
        if fresh:
            self._variants.setdefault(SegmentKey(info.stats.chunk), []).append(node)
        self._enforce_variant_caps(node)
        return fresh

    def admit_chunks(self, specs: Sequence[ChunkSpec], tail_tokens: int, *, exact_upto: int,
                     rule: RecomputeRule, fresh_above: float = 1.0) -> ChunkLease | None:
        """Admit a chunk-mode request (Cache-Craft §3.4.1's recomputation planning).

        The first ``exact_upto`` segments may be served from the knowledge tree (the longest
        resident prefix, approximate nodes included); every later segment gets its own blocks, and
        each later document whose chunk has variants is served from the one with the lowest CFO for
        this context (eq. 12), locked and brought to device to be copied from.

        Args:
            specs: the request's lead segments, in prompt order.
            tail_tokens: tokens past the lead the request writes (prompt rest + ``max_tokens``).
            exact_upto: how many leading segments the tree may serve (``auto``: all; ``chunk``: up
                to the first document).
            rule: which tokens of a reused chunk are recomputed (Cache-Craft's CFO by default).
            fresh_above: a chunk whose best variant's CFO is above this is computed in full instead
                (and recorded as a new variant for this context, §3.3): fixing most of a chunk costs
                nearly what computing it does.

        Returns:
            a :class:`ChunkLease`, or ``None`` when the arena has no room now (nothing is held).

        Raises:
            CacheBudgetError: the request can never fit in the arena.
            InvalidRequestError: a segment of fewer than one token, negative ``tail_tokens`` or ``alpha``.
        """
        if tail_tokens < 0 or fresh_above < 0 or any(s.num_tokens < 1 for s in specs):
            raise InvalidRequestError(f"bad request shape: tail {tail_tokens}, fresh_above {fresh_above}, "
                                      f"lead {[s.num_tokens for s in specs]}")
        need = sum(blocks_for(s.num_tokens, self.block_size) for s in specs) + blocks_for(tail_tokens, self.block_size)
        if need > self._alloc.num_blocks:
            raise CacheBudgetError(
                f"the request needs {need} device blocks ({need * self.block_size} tokens of KV: prompt + max_tokens) "
                f"but the device arena holds only {self._alloc.num_blocks}; raise the device budget or shorten it")
        # KV built over reused chunks is never a prefix for a request that recomputes everything
        acq = self._acquire_with_disk([s.key for s in specs[: max(0, exact_upto)]], approximate=rule.kind != "all")
        prefix, sources = list(acq.nodes), []
        rest = sum(blocks_for(s.num_tokens, self.block_size) for s in specs[len(prefix):]) + blocks_for(tail_tokens, self.block_size)
        try:
            pieces, hits = self._plan_pieces(specs, prefix, acq.cached_tokens, rule, fresh_above, sources)
            if sources and not self._make_device_room(rest):
                # the variants' ancestors are pinned while they are held: without them, room may exist
                self.release(sources)
                sources.clear()
                pieces, hits = self._plan_pieces(specs, prefix, acq.cached_tokens, None, fresh_above, sources)
            if not self._make_device_room(rest):
                self.release(prefix)
                return None
        except BaseException:
            self.release(prefix + sources)
            raise
        for piece in pieces:
            piece.blocks = self.allocate(blocks_for(piece.spec.num_tokens, self.block_size))
        device_hits, host_hits = acq.device_hits + hits[0], acq.host_hits + hits[1]
        self.stats.device_hits += hits[0]
        self.stats.host_hits += hits[1]
        self.stats.variant_hits += len(sources)
        return ChunkLease(prefix=prefix, pieces=pieces, tail_blocks=self.allocate(blocks_for(tail_tokens, self.block_size)),
                          sources=sources, device_hits=device_hits, host_hits=host_hits,
                          disk_hits=acq.disk_hits + hits[2])

    def _plan_pieces(self, specs: Sequence[ChunkSpec], prefix: list[Node], start: int, rule: RecomputeRule | None,
                     fresh_above: float, sources: list[Node]) -> tuple[list[ChunkPiece], tuple[int, int, int]]:
        """The pieces after ``prefix``, each served from its lowest-CFO variant (locked, on device,
        appended to ``sources``) or computed fresh; ``rule`` None: every piece fresh. Also returns
        how many variants were found on device, swapped in from host, and read from the disk tier."""
        keys, lengths, first_part = _part_keys(specs)
        pieces, on_device, swapped, read, from_disk = [], 0, 0, 0, []
        for i in range(len(prefix), len(specs)):
            spec = specs[i]
            context = keys[: first_part[i]]
            use = None
            if rule is not None and spec.chunk and keys[first_part[i]] == spec.key:  # a document's first occurrence
                use = self._plan_variant(spec, context, lengths[: first_part[i]], start, rule, prefix + sources,
                                         fresh_above, from_disk)
            if use is not None and rule.kind == "cfo" and use.cfo > fresh_above:
                use = None
            if use is not None:
                fetched, was_on_device = use.node in from_disk, use.node.in_device
                if self._acquire_node(use.node):
                    sources.append(use.node)
                    read += fetched
                    on_device += was_on_device and not fetched
                    swapped += not was_on_device and not fetched
                else:
                    use = None
            pieces.append(ChunkPiece(spec, start, context, [], use))
            start += spec.num_tokens
        return pieces, (on_device, swapped, read)

    def _plan_variant(self, spec: ChunkSpec, context: tuple[str, ...], lengths: Sequence[int], start: int,
                      rule: RecomputeRule, held: list[Node], fresh_above: float = 1.0,
                      from_disk: list[Node] | None = None) -> VariantUse | None:
        """The lowest-CFO usable variant of ``spec``'s chunk for ``context`` (not yet locked), or None.

        With a disk tier, the variants of the chunk that only the disk holds compete too; if one of
        them wins (and its CFO is at most ``fresh_above``) its path is read back and brought to
        device (appended to ``from_disk``); if that fails, the best resident variant is used."""
        cands = [n for n in self.variants(spec.key)
                 if n.num_tokens == spec.num_tokens and n not in held
                 and (n.in_device or n.parent is None or n.parent.is_root or n.parent.in_device)]
        on_disk = self._disk_variants(spec) if from_disk is not None else []
        if not cands and not on_disk:
            return None
        cands.sort(key=lambda n: n.approximate)  # on equal CFO, a variant computed exactly wins (stable sort)
        choice = choose_with_rule([n.variant.stats for n in cands] + [e.variant.stats for e in on_disk],
                                  context, rule, lengths)
        node = next((n for n in cands if n.variant.stats is choice.stats), None)
        if node is None:
            if rule.kind == "cfo" and choice.cfo > fresh_above:
                return None  # computed fresh anyway: nothing to read
            entry = next(e for e in on_disk if e.variant.stats is choice.stats)
            node = self._load_variant(entry)
            if node is None or node in held:
                return self._plan_variant(spec, context, lengths, start, rule, held, fresh_above) if cands else None
            from_disk.append(node)
            choice = choose_with_rule([node.variant.stats], context, rule, lengths)
        return VariantUse(node, choice.cfo, choice.recompute, start - node.variant.start)

    def _disk_variants(self, spec: ChunkSpec) -> list[DiskEntry]:
        """Variants of ``spec``'s chunk that only the disk tier holds (this fingerprint and length;
        a variant whose node is resident is planned from memory)."""
        disk = self._disk
        if disk is None or self.host_budget_bytes == 0:
            return []
        found = [e for e in disk.variants(spec.key)
                 if e.variant.fingerprint == self.variant_fingerprint and e.num_tokens == spec.num_tokens]
        if not found:
            return []
        resident = {self._path_key(n) for n in self.variants_any(spec.key)}
        return [e for e in found if e.path_key not in resident]

    def _load_variant(self, entry: DiskEntry) -> Node | None:
        """Read a disk-only variant's path back (its ancestors too: a node's KV is only valid after
        its own prefix, and a node on device needs its parent there) and bring it all to device,
        unlocked, as a resident variant is before planning locks it. None, with nothing held, if a
        file is gone or fails its checksum (it is deleted), or there is no room."""
        keys = self._disk.path_keys(entry.path_key) if self._disk is not None else None
        if keys is None:
            return None
        match, _ = self._match_with_disk([SegmentKey(k) for k in keys])
        if len(match.nodes) != len(keys):
            return None
        nodes = list(match.nodes)
        for n in nodes:
            self._lock(n)  # room made for one must not evict the others
        try:
            placed = all(n.in_device or self._swap_in(n) for n in nodes)
        finally:
            for n in nodes:
                self._unlock(n)
        node = nodes[-1]
        if node.variant is None:  # resident already, computed by a request that recorded no variant
            self._restore_variant(node, entry.variant)
        return node if placed and node.variant is not None else None

    def _restore_variant(self, node: Node, info: VariantInfo | None) -> None:
        """Make ``node`` (read back from disk) a variant again, if ``info`` is one of this model's
        and fits it; the caps apply as to a new variant."""
        if (info is None or info.fingerprint != self.variant_fingerprint or not info.fits(node.key, node.num_tokens)
                or node.variant is not None or node.approximate):
            return
        self._index_variant(node, replace(info))  # restored, not added: variants_added is not counted

    def _acquire_node(self, node: Node) -> bool:
        """Lock ``node`` and make sure it is on device (its parent already is, and stays there while
        room is made: it is held for the swap-in); False if no room."""
        self._lock(node)
        if node.in_device:
            return True
        parent = node.parent if node.parent is not None and not node.parent.is_root else None
        if parent is not None:
            self._lock(parent)
        try:
            if not self._swap_in(node):
                self._unlock(node)
                return False
        except BaseException:
            self._unlock(node)
            raise
        finally:
            if parent is not None:
                self._unlock(parent)
        return True

    def _swap_in(self, node: Node) -> bool:
        """Copy a locked host-only ``node`` into new device blocks; False (nothing changed) if no
        room can be made. On a failed copy the blocks are freed and the error propagates."""
        need = blocks_for(node.num_tokens, self.block_size)
        if not self._make_device_room(need):
            return False
        blocks = self._alloc.allocate(need)
        t0 = time.perf_counter()
        try:
            self._mover.swap_in(node.host_kv, blocks)
        except BaseException:
            self._alloc.free(blocks)
            raise
        finally:
            self.stats.copy_s += time.perf_counter() - t0
        node.device_blocks = blocks
        self.stats.swap_ins += 1
        self._set_priority(node, DEVICE)
        return True

    def commit_chunks(self, lease: ChunkLease, rest_tokens: int, stats: Sequence[VariantStats | None]) -> None:
        """After a successful prefill: every piece becomes a tree node (its blocks change owner):
        exact while everything before it was exact, approximate from the first reused chunk (or
        approximate prefix node) on. Fresh documents become variants with their recorded
        statistics; reused variants gain ``f_r += 1 / CFO``; the copy sources are unlocked.

        Args:
            lease: from :meth:`admit_chunks`, not yet committed.
            rest_tokens: prompt tokens computed past the lead.
            stats: per piece, the statistics recorded while it was computed (None: not a variant).

        Raises:
            InvalidRequestError: already committed or released, or ``stats`` of the wrong length.
        """
        if lease.committed or lease.released:
            raise InvalidRequestError("a lease is committed once, before it is released")
        if len(stats) != len(lease.pieces):
            raise InvalidRequestError(f"{len(stats)} statistics for {len(lease.pieces)} pieces")
        approx = any(n.approximate for n in lease.prefix)
        parent = lease.prefix[-1] if lease.prefix else None
        touched = list(lease.prefix)
        computed = [False] * len(touched)
        added: list[tuple[Node, VariantInfo]] = []
        inserting = True
        for piece, st in zip(lease.pieces, stats):
            if piece.use is not None:
                approx = True
                if piece.use.node.variant is not None:  # (its variant role may have been evicted meanwhile)
                    piece.use.node.variant.reuse_score += 1.0 / max(piece.use.cfo, 1e-3)
                touched.append(piece.use.node)
                computed.append(False)
            key = approximate_key(piece.spec.key) if approx else piece.spec.key
            holder = self._tree.root if parent is None else parent
            if approx and key in holder.children:
                # another approximation of this path is cached already: this request keeps its own KV
                # (it decodes over what it prefilled), and nothing below can hang from the tree
                inserting = False
            if not inserting:
                continue
            node = self.insert(parent, key, piece.spec.num_tokens, piece.blocks)
            node.approximate = approx
            if not approx:
                self._after_insert(node, len(KnowledgeTree.path_to(node)))
            piece.node, piece.blocks, parent = node, list(node.device_blocks or ()), node
            touched.append(node)
            computed.append(True)
            first = piece.spec.chunk and piece.spec.key not in piece.context  # a repeat in the prompt is no variant
            if st is not None and first and piece.use is None and node.variant is None:
                added.append((node, VariantInfo(st, piece.start, self.variant_fingerprint)))
        sources, lease.sources = lease.sources, []
        self.release(sources)
        lease.committed = True
        beta = sum(p.spec.num_tokens if p.use is None else len(p.use.recompute) for p in lease.pieces) + rest_tokens
        if touched:
            self.record_request(touched, computed, lease.cached_tokens + lease.reused_tokens, max(beta, 1))
        for node, info in added:
            self.add_variant(node, info)

    def _enforce_variant_caps(self, keep: Node) -> None:
        """Evict the lowest-``f_r`` variants until the chunk of ``keep`` has at most M and the store
        at most N x M (§3.3); ``keep`` (just added) is never chosen. An evicted variant that is an
        unlocked leaf leaves the tree (its KV is freed); one that is still a prefix of other nodes,
        or in use, only stops being a variant (the tree and its budgets keep its KV)."""
        def lowest(nodes):
            return min((n for n in nodes if n is not keep), key=lambda n: (n.variant.reuse_score, n.serial), default=None)

        chunk = SegmentKey(keep.variant.stats.chunk)
        while len(self.variants_any(chunk)) > self.variants_per_chunk:
            self._drop_variant(lowest(self.variants_any(chunk)))
        while self.num_variants > self.max_variants:
            self._drop_variant(lowest(n for k in list(self._variants) for n in self.variants_any(k)))

    def _drop_variant(self, node: Node) -> None:
        self.stats.variant_evictions += 1
        if node.lock_ref or node.children:
            node.variant = None  # pruned from the index at the next lookup
            return
        parent = node.parent
        for m in self._tree.remove(node):
            self._free_kv(m)
        if parent is not None and not parent.is_root:
            self._refresh(parent)

    def _finish_chunks(self, lease: ChunkLease) -> None:
        lease.released = True
        held = list(lease.prefix) + list(lease.sources)
        lease.prefix, lease.sources = [], []
        for piece in lease.pieces:
            if piece.node is not None:
                held.append(piece.node)
            elif piece.blocks:
                self.free(piece.blocks)
            piece.node, piece.blocks = None, []
        if held:
            self.release(held)
        tail, lease.tail_blocks = lease.tail_blocks, []
        if tail:
            self.free(tail)

    # ----------------------------------------------------------------- disk tier and replicas
    def attach_disk(self, disk: DiskStore) -> None:
        """Use ``disk`` as the tier below host memory: exact nodes are written to it after they are
        inserted (:meth:`persist_pending`), and a prefix match that runs past what memory holds
        continues on disk (files read into the host tier, then swapped in as host hits are)."""
        self._disk = disk

    def close_disk(self, timeout: float | None = 30.0) -> None:
        """Finish the disk tier's queued writes (up to ``timeout`` seconds) and stop its writer."""
        if self._disk is not None:
            self._disk.close(timeout)

    def _acquire_with_disk(self, keys: Sequence[SegmentKey], *, approximate: bool = False) -> AcquiredPrefix:
        """:meth:`acquire` of :meth:`_match_with_disk`: the nodes read from disk and swapped in count
        as ``disk_hits``, not ``host_hits`` (in the result and in :attr:`stats`)."""
        match, from_disk = self._match_with_disk(keys, approximate=approximate)
        acq = self.acquire(match)
        disk_hits = min(from_disk, acq.host_hits)
        acq.host_hits -= disk_hits
        acq.disk_hits = disk_hits
        self.stats.host_hits -= disk_hits
        return acq

    def _match_with_disk(self, keys: Sequence[SegmentKey], *, approximate: bool = False) -> tuple[MatchResult, int]:
        """:meth:`match`, continued on the disk tier: each further segment whose file exists is read
        (checksum verified) into the host tier as a new node. Returns the match and how many of its
        nodes came from disk. Stops at the first segment not on disk, a file that fails
        verification (deleted and recomputed), or a host tier with no room."""
        match = self.match(keys, approximate=approximate)
        nodes = list(match.nodes)
        disk = self._disk
        if disk is None or len(nodes) >= len(keys) or any(n.approximate for n in nodes) or self.host_budget_bytes == 0:
            return match, 0
        for n in nodes:
            self._lock(n)  # room made in host below must not evict the path being extended
        loaded: list[Node] = []
        try:
            parent = nodes[-1] if nodes else self._tree.root
            pkey = self._path_key(parent)
            for key in keys[len(nodes):]:
                pkey = path_key(pkey, key)
                entry = disk.lookup(pkey)
                if entry is None or key in parent.children:
                    break
                nbytes = self._mover.host_nbytes(entry.num_tokens)
                if not self._make_host_room(nbytes):
                    break
                kv = disk.load(entry)
                if kv is None:
                    break
                node = self._tree.add_child(parent, key, entry.num_tokens)
                node.host_kv = self._mover.host_from_tensors(*kv)
                self._host_used += nbytes
                node.frequency, node.total_cost, node.num_computed = entry.frequency, entry.avg_cost, 1
                self._lock(node)
                loaded.append(node)
                self._restore_variant(node, entry.variant)
                self._set_priority(node, HOST)
                parent = node
        finally:
            for n in nodes + loaded:
                self._unlock(n)
        self.stats.disk_hits += len(loaded)
        if not loaded:
            return match, 0
        nodes += loaded
        return MatchResult(tuple(nodes), tuple(n.tiers[0] for n in nodes), sum(n.num_tokens for n in nodes)), len(loaded)

    def _path_key(self, node: Node) -> str:
        pkey = ""
        for n in KnowledgeTree.path_to(node):
            pkey = path_key(pkey, n.key)
        return pkey

    def _after_insert(self, node: Node, depth: int) -> None:
        """A node was inserted by a commit: queue it for the disk tier; an upper node (the system
        prompt) also gets a host copy now (RAGCache §6: a failure of the device tier loses no hot
        prefix, and a later device eviction frees it without a copy)."""
        if self._disk is not None and not node.approximate:
            self._to_persist.append(node)
        if depth <= self.replica_depth and not node.in_host and self.host_budget_bytes > 0 and node.lock_ref:
            if self._swap_out(node):
                self.stats.host_replicas += 1

    def persist_pending(self, max_bytes: int = 64 << 20) -> int:
        """Hand nodes inserted since the last call to the disk tier's writer (their missing ancestors
        first), copying device-only KV to host memory for it; called by the engine after a step's
        tokens went out. At most ``max_bytes`` of KV are copied per call (the rest waits). Returns
        the nodes queued."""
        disk = self._disk
        if disk is None or not self._to_persist:
            return 0
        todo, self._to_persist = self._to_persist, []
        queued = copied = 0
        for i, node in enumerate(todo):
            if copied >= max_bytes:
                self._to_persist = todo[i:] + self._to_persist
                break
            if node.parent is None or not node.resident or node.approximate:
                continue  # evicted meanwhile, or removed
            pkey = ""
            for n in KnowledgeTree.path_to(node):
                parent, pkey = pkey, path_key(pkey, n.key)
                if disk.contains(pkey):
                    continue
                if not n.resident:
                    break
                if n.in_host:
                    k, v = self._mover.host_tensors(n.host_kv)
                else:
                    k, v = self._mover.host_tensors(self._mover.swap_out(n.device_blocks or (), n.num_tokens))
                    copied += self._mover.host_nbytes(n.num_tokens)
                info = n.variant if n.variant is not None and n.variant.fingerprint == self.variant_fingerprint else None
                if not disk.put(pkey, parent, n.key, k, v, n.stats(), variant=info):
                    break  # skipped (writer behind, or too large): its descendants would be orphans
                queued += 1
        self.stats.disk_queued += queued
        return queued

    def _make_host_room(self, nbytes: int) -> bool:
        """Evict host copies until ``nbytes`` more fit the host budget; False (nothing evicted) if
        locked data makes that impossible."""
        if self.host_budget_bytes == 0 or nbytes > self.host_budget_bytes:
            return False
        short = nbytes - (self.host_budget_bytes - self._host_used)
        if short > 0:
            locked = sum(self._mover.host_nbytes(m.num_tokens) for m in self._locked if m.in_host)
            if short > self._host_used - locked:
                return False
            self._evict_host(nbytes)
        return True

    # ----------------------------------------------------------------- lower-level calls
    def match(self, keys: Sequence[SegmentKey], *, approximate: bool = False) -> MatchResult:
        """Longest resident prefix of ``keys`` (O(depth)); changes nothing. ``approximate``: may
        follow approximate nodes (chunk modes only)."""
        nodes = tuple(self._tree.match_prefix(keys, approximate=approximate))
        return MatchResult(nodes, tuple(n.tiers[0] for n in nodes), sum(n.num_tokens for n in nodes))

    def acquire(self, match: MatchResult) -> AcquiredPrefix:
        """Lock the matched prefix and bring it all to device; never raises for lack of room.

        Host-only nodes are swapped in (keeping their host copy). If one cannot get device blocks
        because locked data fills the arena, the prefix is truncated before it and the rest is
        unlocked (the caller recomputes it).
        """
        nodes: list[Node] = []
        parent = self._tree.root
        for n in match.nodes:  # a stale match is cut where it stopped being valid
            if n.parent is not parent or parent.children.get(n.key) is not n or not n.resident:
                break
            nodes.append(n)
            parent = n
        for n in nodes:
            self._lock(n)  # lock first: swap-in evictions must not touch the path
        device_hits = host_hits = 0
        for idx, n in enumerate(nodes):
            if n.in_device:
                device_hits += 1
                continue
            try:
                swapped = self._swap_in(n)
            except BaseException:
                for m in nodes:
                    self._unlock(m)
                raise
            if not swapped:
                for m in nodes[idx:]:
                    self._unlock(m)
                del nodes[idx:]
                break
            host_hits += 1
        self.stats.device_hits += device_hits
        self.stats.host_hits += host_hits
        return AcquiredPrefix(
            nodes=tuple(nodes),
            blocks=tuple(tuple(n.device_blocks or ()) for n in nodes),
            device_hits=device_hits,
            host_hits=host_hits,
            cached_tokens=sum(n.num_tokens for n in nodes),
        )

    def allocate(self, num_blocks: int) -> list[int]:
        """Blocks owned by the caller's request, evicting unlocked device leaves as needed."""
        if num_blocks < 0:
            raise InvalidRequestError(f"cannot allocate a negative number of blocks ({num_blocks})")
        cap = self._alloc.num_blocks
        if num_blocks > cap:
            raise CacheBudgetError(
                f"need {num_blocks} device blocks ({num_blocks * self.block_size} tokens) but the "
                f"device arena holds only {cap} blocks; raise the device budget"
            )
        if not self._make_device_room(num_blocks):
            raise CacheBudgetError(
                f"need {num_blocks} device blocks but only {self._alloc.num_free} of {cap} are free "
                f"and {self._evictable_device_blocks()} more can be evicted (the rest is held by "
                f"locked nodes and running requests); raise the device budget or lower concurrency"
            )
        blocks = self._alloc.allocate(num_blocks)
        self._request_blocks.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Return request-owned blocks (from ``allocate``, not given to ``insert``)."""
        ids = list(blocks)
        foreign = [b for b in ids if b not in self._request_blocks]
        if foreign:
            raise InvalidRequestError(f"blocks {foreign} are not owned by a request")
        self._alloc.free(ids)  # also rejects duplicates
        self._request_blocks.difference_update(ids)

    def insert(
        self, parent: Node | None, key: SegmentKey, num_tokens: int, blocks: Sequence[int]
    ) -> Node:
        """Make ``blocks`` (from ``allocate``) the device KV of segment ``key`` under ``parent``.

        ``parent`` None means the root; otherwise it must be on device (acquired or just
        inserted). Returns the node locked for the caller (lock_ref += 1). If ``key`` is already
        a child on device, the given blocks are freed and the existing node is returned; if it is
        a host-only child, the blocks become its device copy (no swap-in needed).
        """
        parent = self._tree.root if parent is None else parent
        if not self._tree.contains(parent):
            raise InvalidRequestError(f"parent {parent!r} is not in the knowledge tree")
        if not parent.is_root and not parent.in_device:
            raise InvalidRequestError(f"parent {parent!r} is not on device; acquire it first")
        if num_tokens < 1:
            raise InvalidRequestError(f"a segment needs >= 1 token, got {num_tokens}")
        ids = list(blocks)
        need = blocks_for(num_tokens, self.block_size)
        if len(ids) != need:
            raise InvalidRequestError(f"{num_tokens} tokens need {need} blocks, got {len(ids)}")
        if len(set(ids)) != len(ids) or not self._request_blocks.issuperset(ids):
            raise InvalidRequestError(f"blocks {ids} are not distinct blocks owned by a request")
        node = parent.children.get(key)
        if node is not None and node.in_device:
            self.free(ids)
            self._lock(node)
            return node
        if node is None:
            node = self._tree.add_child(parent, key, num_tokens)
        self._lock(node)
        self._request_blocks.difference_update(ids)
        node.device_blocks = ids
        self._set_priority(node, DEVICE)
        return node

    def release(self, nodes: Sequence[Node]) -> None:
        """Unlock ``nodes`` (lock_ref -= 1 each); all-or-nothing."""
        for node, times in Counter(nodes).items():
            if node.lock_ref < times:
                raise InvalidRequestError(f"{node!r} released more often than it was locked")
        for node in nodes:
            self._unlock(node)

    def record_request(
        self, path: Sequence[Node], computed: Sequence[bool], alpha: int, beta: int
    ) -> None:
        """Alg. 1 UPDATE_NODE for every node on a finished request's path.

        ``alpha``/``beta`` are the request's cached / non-cached token counts; ``computed[i]``
        says whether ``path[i]`` had to be computed (then its cost ``T(alpha, beta) / beta``
        seconds per token joins eq. 3's average).
        """
        if len(path) != len(computed):
            raise InvalidRequestError(f"{len(path)} nodes but {len(computed)} computed flags")
        if alpha < 0 or beta < 0 or (any(computed) and beta < 1):
            raise InvalidRequestError(f"bad token counts alpha={alpha}, beta={beta}")
        self._access += 1
        per_token = None
        if any(computed) and self._profile is not None:
            per_token = self._profile.estimate(alpha, beta) / beta  # Alg. 1 lines 6-10
        for node, was_computed in zip(path, computed):
            node.frequency += 1
            node.last_access = self._access
            if was_computed:
                node.num_computed += 1
                self.stats.misses += 1
                if per_token is not None:
                    node.total_cost += per_token
            for tier in node.tiers:
                self._set_priority(node, tier)  # Alg. 1 line 13

    def clear(self) -> None:
        """Drop every node not needed by a locked node (locked nodes and their ancestors stay)."""
        order = list(self._tree)
        keep: set[Node] = set()
        for n in reversed(order):
            if n.lock_ref > 0 or any(c in keep for c in n.children.values()):
                keep.add(n)
        for n in order:  # parents first; descendants of a dropped node have parent None
            if n not in keep and n.parent is not None:
                parent = n.parent
                for m in self._tree.remove(n):
                    self._free_kv(m)
                self._refresh(parent)

    # ----------------------------------------------------------------- eviction (Alg. 1)
    def _lock(self, n: Node) -> None:
        n.lock_ref += 1
        self._locked.add(n)

    def _unlock(self, n: Node) -> None:
        n.lock_ref -= 1
        if n.lock_ref == 0:
            self._locked.discard(n)
            self._refresh(n)

    def _set_priority(self, node: Node, tier: TierName) -> None:
        node.priority[tier] = self._policy(node.stats(), self._clock[tier])
        self._push_if_candidate(node, tier)

    @staticmethod
    def _is_candidate(n: Node, tier: TierName) -> bool:
        """Alg. 1 line 17: an unlocked node of the tier with no child in that tier (a host copy
        of a node also on device can always go; a host-only node needs no resident child)."""
        if n.lock_ref or n.is_root:
            return False
        if tier is DEVICE:
            return n.in_device and not any(c.in_device for c in n.children.values())
        return n.in_host and (n.in_device or not any(c.resident for c in n.children.values()))

    def _push_if_candidate(self, n: Node, tier: TierName) -> None:
        if self._is_candidate(n, tier):
            heap = self._heaps[tier]
            heapq.heappush(heap, (n.priority[tier], n.last_access, n.serial, n))
            if len(heap) > 2 * len(self._tree) + 64:  # too many stale entries: compact
                live = {e[3]: e for e in heap if self._is_live(e, tier)}
                self._heaps[tier] = heap = list(live.values())
                heapq.heapify(heap)

    def _refresh(self, n: Node) -> None:
        """Called when ``n`` may have become a candidate (unlocked, lost a child)."""
        for tier in n.tiers:
            self._push_if_candidate(n, tier)

    def _is_live(self, entry: tuple[float, int, int, Node], tier: TierName) -> bool:
        prio, last, _, n = entry
        return self._is_candidate(n, tier) and n.priority[tier] == prio and n.last_access == last

    def _pop_victim(self, tier: TierName) -> Node:
        heap = self._heaps[tier]
        while heap:
            entry = heapq.heappop(heap)
            if self._is_live(entry, tier):
                return entry[3]
        raise AssertionError(f"{tier} eviction ran out of candidates (budget pre-check is wrong)")

    def _evictable_device_blocks(self) -> int:
        """Node blocks not pinned by a lock (locked nodes and their ancestors stay)."""
        pinned: set[Node] = set()
        pinned_blocks = 0
        for n in self._locked:
            m: Node | None = n
            while m is not None and not m.is_root and m not in pinned:
                pinned.add(m)
                pinned_blocks += len(m.device_blocks or ())
                m = m.parent
        return self._alloc.num_used - len(self._request_blocks) - pinned_blocks

    def _make_device_room(self, num_blocks: int) -> bool:
        short = num_blocks - self._alloc.num_free
        if short <= 0:
            return True
        if short > self._evictable_device_blocks():
            return False  # checked first so that a failure evicts nothing
        while self._alloc.num_free < num_blocks:  # Alg. 1 line 18
            n = self._pop_victim(DEVICE)  # line 19
            self._clock[DEVICE] = max(self._clock[DEVICE], n.priority[DEVICE])  # eq. 2, line 21
            parent = n.parent
            self._evict_from_device(n)
            if parent is not None:
                self._refresh(parent)  # lines 22-23: a parent that became a leaf joins
        return True

    def _evict_from_device(self, n: Node) -> None:
        self.stats.device_evictions += 1
        if n.in_host:
            self.stats.device_frees_without_copy += 1  # swap out only once
        elif not self._swap_out(n):
            removed = self._tree.remove(n)
            for m in removed:
                assert m.lock_ref == 0, f"dropping locked {m!r}"
                self._free_kv(m)
            self.stats.dropped_nodes += len(removed)
            return
        self._alloc.free(n.device_blocks or ())
        n.device_blocks = None
        del n.priority[DEVICE]

    def _swap_out(self, n: Node) -> bool:
        """Copy ``n``'s KV to host, making room there; False if the host cannot take it."""
        nbytes = self._mover.host_nbytes(n.num_tokens)
        if not self._make_host_room(nbytes):
            return False
        t0 = time.perf_counter()
        try:
            n.host_kv = self._mover.swap_out(n.device_blocks or (), n.num_tokens)
        finally:
            self.stats.copy_s += time.perf_counter() - t0
        self._host_used += nbytes
        self.stats.swap_outs += 1
        self._set_priority(n, HOST)
        return True

    def _evict_host(self, nbytes: int) -> None:
        """Host-tier eviction until ``nbytes`` are free (caller checked it is possible)."""
        while self.host_budget_bytes - self._host_used < nbytes:
            m = self._pop_victim(HOST)
            self._clock[HOST] = max(self._clock[HOST], m.priority[HOST])  # eq. 2
            parent = m.parent
            self._free_host_copy(m)
            self.stats.host_evictions += 1
            if not m.in_device:
                self._tree.remove(m)  # resident nowhere; a candidate has no resident child
            if parent is not None:
                self._refresh(parent)

    def _free_host_copy(self, m: Node) -> None:
        self._mover.free_host(m.host_kv)
        self._host_used -= self._mover.host_nbytes(m.num_tokens)
        m.host_kv = None
        m.priority.pop(HOST, None)

    def _free_kv(self, m: Node) -> None:
        if m.device_blocks is not None:
            self._alloc.free(m.device_blocks)
            m.device_blocks = None
        if m.host_kv is not None:
            self._free_host_copy(m)
        m.priority.clear()

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Raise AssertionError describing every broken invariant (for tests)."""
        problems: list[str] = []
        node_blocks: set[int] = set()
        host_bytes = count = 0
        candidates: dict[TierName, set[Node]] = {DEVICE: set(), HOST: set()}
        root = self._tree.root
        if root.resident or root.lock_ref or root.parent is not None:
            problems.append("root holds KV, a lock or a parent")
        for n in self._tree:
            count += 1
            p = n.parent
            if p is None or p.children.get(n.key) is not n:  # type: ignore[arg-type]
                problems.append(f"{n!r}: broken parent link")
                continue
            if not n.resident:
                problems.append(f"{n!r}: in the tree but resident nowhere")
            if n.lock_ref < 0 or (n.lock_ref and not n.in_device):
                problems.append(f"{n!r}: bad lock (locked nodes must be on device)")
            if n.in_device and not p.is_root and not p.in_device:
                problems.append(f"{n!r}: on device but parent {p!r} is not")
            if n.resident and not p.is_root and not p.resident:
                problems.append(f"{n!r}: resident but parent {p!r} is not")
            if set(n.priority) != set(n.tiers):
                problems.append(f"{n!r}: priorities for {sorted(n.priority)} but tiers {n.tiers}")
            if n.device_blocks is not None:
                if len(n.device_blocks) != blocks_for(n.num_tokens, self.block_size):
                    problems.append(f"{n!r}: {len(n.device_blocks)} blocks for {n.num_tokens} tokens")
                dup = node_blocks.intersection(n.device_blocks)
                if dup or len(set(n.device_blocks)) != len(n.device_blocks):
                    problems.append(f"{n!r}: blocks {sorted(dup)} shared")
                node_blocks.update(n.device_blocks)
            if n.host_kv is not None:
                host_bytes += self._mover.host_nbytes(n.num_tokens)
            for tier in n.tiers:
                if self._is_candidate(n, tier):
                    candidates[tier].add(n)
        for tier, nodes in candidates.items():
            live = {e[3] for e in self._heaps[tier] if self._is_live(e, tier)}
            if nodes - live:
                problems.append(f"{tier} candidates missing from the heap: {nodes - live}")
        if self._locked != {n for n in self._tree if n.lock_ref}:
            problems.append("locked-node set out of sync with lock_ref")
        if count != len(self._tree):
            problems.append(f"tree counts {len(self._tree)} nodes, iteration finds {count}")
        if node_blocks & self._request_blocks:
            problems.append(f"blocks owned by both nodes and requests: {node_blocks & self._request_blocks}")
        if node_blocks | self._request_blocks != self._alloc.used_blocks():
            problems.append("allocator's used blocks differ from node + request blocks")
        if host_bytes != self._host_used:
            problems.append(f"host bytes counted {self._host_used}, nodes hold {host_bytes}")
        if self._host_used > self.host_budget_bytes:
            problems.append(f"host over budget: {self._host_used} > {self.host_budget_bytes} bytes")
        if problems:
            raise AssertionError("; ".join(problems))
