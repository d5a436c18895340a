"""The knowledge-tree cache manager: one request protocol over tiered KV (RAGCache §5.1, Alg. 1).

:class:`TieredCache` is the cache core any engine drives (our step loop today; a vLLM connector
next) with token-free, tensor-free calls. It owns the knowledge tree and composes the tiers in
order (:class:`~ragcache_backend.cache.stack.TierStack`: device blocks, host buffers, the disk tier)
under one replacement policy (PGDSF by default, one clock per tier), and keeps the chunk variants
of the chunk modes (:class:`~ragcache_backend.cache.variants.VariantStore`, Cache-Craft §3).

A request uses three calls (the engine, the policy replay and the tests all go through them):

* :meth:`TieredCache.admit`: match the request's lead segments against the tree (continuing on the
  disk tier), lock the longest resident prefix and bring it to device, choose a chunk variant for
  each later document (chunk modes), and give the request blocks for everything it writes;
  ``None`` when the arena has no room *now*.
* prefill (the engine's forward pass), then :meth:`TieredCache.commit`: every segment the request
  computed becomes a tree node (its blocks change owner, no copy): exact while everything before
  it was exact, *approximate* (:func:`~ragcache_backend.cache.knowledge_tree.approximate_key`) from
  the first reused chunk on; Alg. 1 UPDATE_NODE updates the statistics; fresh documents become
  chunk variants. A prefill computed in chunks over several steps commits the segments each chunk
  completed at once (:meth:`TieredCache.commit_prefix`), then the rest with :meth:`commit`.
* :meth:`TieredCache.finish`: unlock, free what the request owns; always (success, error,
  cancellation), idempotent.

Nothing is inserted before its KV is complete (a whole segment, computed by a forward step that
succeeded), so a failed or cancelled request never leaves a poisoned or partial node.
The lower-level calls they are made of (``match``, ``acquire``, ``allocate``, ``insert``,
``record_request``, ``release``, ``free``) stay public for tests and other drivers. Not
thread-safe by design: callers serialize access (one scheduler thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from ragcache_backend.cache.blocks import BlockAllocator, blocks_for
from ragcache_backend.cache.chunk_reuse import RecomputeRule, VariantInfo, VariantStats
from ragcache_backend.cache.device import DeviceTier
from ragcache_backend.cache.disk import DiskStore
from ragcache_backend.cache.disk_tier import DiskTier
from ragcache_backend.cache.remote import RemoteStore
from ragcache_backend.cache.remote_tier import RemoteTier
from ragcache_backend.cache.host import HostTier
from ragcache_backend.cache.invariants import check_invariants
from ragcache_backend.cache.knowledge_tree import (KnowledgeTree, Node, SegmentKey, TierName, approximate_key, approximate_rule,
                                                   path_key)
from ragcache_backend.cache.lease import AcquiredPrefix, Lease, MatchResult, SegmentSpec
from ragcache_backend.cache.policy import get_policy
from ragcache_backend.cache.profile import PrefillProfile
from ragcache_backend.cache.stack import CacheStats, TierStack
from ragcache_backend.cache.tier import KVMover, NodeLocks
from ragcache_backend.cache.variants import VariantStore
from ragcache_backend.errors import CacheBudgetError, InvalidRequestError

__all__ = ["AcquiredPrefix", "CacheStats", "KVMover", "MatchResult", "TieredCache", "Lease", "SegmentSpec",
           "shared_pool_blocks"]


def shared_pool_blocks(num_device_blocks: int, host_budget_bytes: int, block_bytes: int) -> int:
    """Blocks of the arena a shared pool needs: the device tier's plus the host budget's whole blocks."""
    return num_device_blocks + host_budget_bytes // block_bytes


class TieredCache:
    """The knowledge-tree cache manager over a device block arena, a host byte budget and an
    optional disk tier.

    Args:
        num_device_blocks: device arena capacity, in blocks (>= 1).
        block_size: tokens per block (>= 1); every node owns ``ceil(num_tokens / block_size)``.
        host_budget_bytes: host tier budget in bytes; 0 disables the host tier (device only).
        mover: copies KV between tiers (the model's KV arena; a simulation in tests).
        policy: a name from ``policy.POLICIES``.
        profile: prefill profile for eq. 3's cost; required by ``pgdsf``.
        shared_pool: the device and host tiers share one pool of arena blocks (a CPU, where both
            are DRAM): the mover's arena must hold :func:`shared_pool_blocks` blocks; nodes move
            between the tiers without a copy and host hits are attended in place.

    Raises:
        InvalidRequestError: a capacity below 1 block, a negative host budget, or ``pgdsf``
            without a profile.
        UnknownPolicyError: an unknown policy.
    """

    def __init__(self, num_device_blocks: int, block_size: int, host_budget_bytes: int, mover: KVMover, *,
                 policy: str = "pgdsf", profile: PrefillProfile | None = None, shared_pool: bool = False) -> None:
        if num_device_blocks < 1:
            raise InvalidRequestError(f"num_device_blocks must be >= 1, got {num_device_blocks}")
        if block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1 token, got {block_size}")
        if host_budget_bytes < 0:
            raise InvalidRequestError(f"host_budget_bytes must be >= 0, got {host_budget_bytes}")
        fn = get_policy(policy)
        if policy == "pgdsf" and profile is None:
            raise InvalidRequestError("policy 'pgdsf' needs a PrefillProfile (eq. 3 cost estimate)")
        self.policy_name = policy
        self.block_size = block_size
        self.stats = CacheStats()
        self._profile = profile
        self._tree = KnowledgeTree()
        self._access = 0
        locks = NodeLocks()
        pool = None
        if shared_pool and host_budget_bytes > 0:
            pool = BlockAllocator(shared_pool_blocks(num_device_blocks, host_budget_bytes, mover.host_nbytes(block_size)))
        device = DeviceTier(num_device_blocks, block_size, mover, fn, locks, pool=pool)
        host = HostTier(host_budget_bytes, mover, fn, locks, pool=pool, block_size=block_size)
        self._mover = mover
        self._stack = TierStack(self._tree, device, host, locks, self.stats)
        self._variants = VariantStore(self._tree, self._stack, self.stats)

    # ----------------------------------------------------------------- read-only views
    @property
    def tree(self) -> KnowledgeTree:
        """The knowledge tree (read it; change it only through this class)."""
        return self._tree

    @property
    def tiers(self) -> TierStack:
        """The tiers in order (device, host, disk) and the moves between them."""
        return self._stack

    @property
    def num_device_blocks(self) -> int:
        """The device arena's capacity, blocks."""
        return self._stack.device.num_blocks

    @property
    def device_used_blocks(self) -> int:
        """Blocks held by nodes and by running requests."""
        return self._stack.device.num_used

    @property
    def request_blocks(self) -> int:
        """Blocks owned by running requests (not yet given to tree nodes)."""
        return self._stack.device.num_request_blocks

    @property
    def locked_nodes(self) -> int:
        """Tree nodes locked by running requests."""
        return len(self._stack.locks)

    @property
    def host_budget_bytes(self) -> int:
        """The host tier's budget, bytes (0: no host tier)."""
        return self._stack.host.budget_bytes

    @property
    def host_used_bytes(self) -> int:
        """Bytes of host copies held."""
        return self._stack.host.used_bytes

    @property
    def disk(self) -> DiskStore | None:
        """The disk tier's store, if attached."""
        return self._stack.disk.store if self._stack.disk is not None else None

    @property
    def disk_used_bytes(self) -> int:
        """Bytes of the disk tier's files (0 without one)."""
        return self._stack.disk.used_bytes if self._stack.disk is not None else 0

    def clock(self, tier: TierName) -> float:
        """The tier's logical clock (eq. 2); starts at 0."""
        name = TierName(tier)
        if name is TierName.DISK:
            return self.disk.clock if self.disk is not None else 0.0
        return (self._stack.device if name is TierName.DEVICE else self._stack.host).evictor.clock

    # ----------------------------------------------------------------- request protocol
    def admit(self, lead: Sequence[SegmentSpec], tail_tokens: int, *, exact_upto: int | None = None,
              rule: RecomputeRule | None = None, fresh_above: float = 1.0) -> Lease | None:
        """Admit one request: lock its longest cached prefix on device, choose a chunk variant for
        each later document (chunk modes), and give it blocks for every lead segment it writes and
        for ``tail_tokens`` more tokens.

        Args:
            lead: the request's cacheable segments, in prompt order.
            tail_tokens: tokens past the lead the request writes (prompt rest + ``max_tokens``).
            exact_upto: how many leading segments the tree may serve (default: all).
            rule: chunk modes (Cache-Craft §3.4.1): which tokens of a reused chunk are recomputed;
                then approximate prefix nodes may serve (unless the rule recomputes everything)
                and documents (``chunk`` specs) may come from variants. None: exact prefixes only.
            fresh_above: a chunk whose best variant's CFO is above this is computed in full instead
                (and recorded as a new variant for this context, §3.3).

        Returns:
            a :class:`Lease`, or ``None`` when the arena has no room *now* (blocks held by running
            requests): nothing is held then, and the caller retries after a request finishes.

        Raises:
            CacheBudgetError: the request can never fit: its whole prompt plus ``max_tokens``
                needs more blocks than the arena has.
            InvalidRequestError: a segment of fewer than one token, a negative ``tail_tokens`` or
                ``fresh_above``.
        """
        if tail_tokens < 0 or fresh_above < 0 or any(s.num_tokens < 1 for s in lead):
            raise InvalidRequestError(f"bad request shape: tail {tail_tokens}, fresh_above {fresh_above}, "
                                      f"lead {[s.num_tokens for s in lead]}")
        if any(s.token_ids and len(s.token_ids) != s.num_tokens for s in lead):
            raise InvalidRequestError("a segment's token ids do not number its num_tokens")
        device = self._stack.device
        need = [blocks_for(s.num_tokens, self.block_size) for s in lead]
        tail_need = blocks_for(tail_tokens, self.block_size)
        if sum(need) + tail_need > device.num_blocks:
            total = sum(need) + tail_need
            raise CacheBudgetError(
                f"the request needs {total} device blocks ({total * self.block_size} tokens of KV: prompt "
                f"+ max_tokens) but the device arena holds only {device.num_blocks}; raise the device budget or shorten it")
        upto = len(lead) if exact_upto is None else max(0, exact_upto)
        # KV built over reused chunks is never a prefix for a request that recomputes everything
        acq = self._acquire_with_disk([s.key for s in lead[:upto]], approximate=rule is not None and rule.kind != "all",
                                      tokens=[s.token_ids for s in lead[:upto]], rule=rule.key if rule is not None else "")
        prefix, sources = list(acq.nodes), []
        rest = sum(need[len(prefix):]) + tail_need
        try:
            served = self._variants.serve_pieces(lead, prefix, acq.cached_tokens, rule, fresh_above, sources)
            if sources and not self._stack.make_device_room(rest):
                # the variants' ancestors are pinned while they are held: without them, room may exist
                self.release(sources)
                sources.clear()
                served = self._variants.serve_pieces(lead, prefix, acq.cached_tokens, None, fresh_above, sources)
            if not self._stack.make_device_room(rest):
                self.release(prefix)
                return None
        except BaseException:
            self.release(prefix + sources)
            raise
        for piece in served.pieces:
            piece.blocks = self.allocate(blocks_for(piece.spec.num_tokens, self.block_size))
        self.stats.device_hits += served.device_hits
        self.stats.host_hits += served.host_hits
        self.stats.variant_hits += len(sources)
        return Lease(prefix=prefix, pieces=served.pieces, tail_blocks=self.allocate(tail_need), sources=sources,
                     rule_key=rule.key if rule is not None else "",
                     device_hits=acq.device_hits + served.device_hits, host_hits=acq.host_hits + served.host_hits,
                     disk_hits=acq.disk_hits + served.disk_hits)

    def commit(self, lease: Lease, rest_tokens: int, stats: Sequence[VariantStats | None] | None = None) -> None:
        """After a successful prefill: every piece not yet committed (:meth:`commit_prefix`) becomes
        a tree node (its blocks change owner, no copy): exact while everything before it was exact,
        approximate from the first reused chunk (or approximate prefix node) on. Every node on the
        path not yet counted gets Alg. 1's statistics; fresh documents become variants with their
        recorded statistics; reused variants gain ``f_r += 1 / CFO``; the copy sources are unlocked.

        Args:
            lease: from :meth:`admit`, not yet committed.
            rest_tokens: prompt tokens computed past the lead (eq. 3's beta counts them).
            stats: per piece, the attention statistics recorded while it was computed (None: not a
                variant); None for none at all. Those of pieces :meth:`commit_prefix` covered are
                not used (such pieces never become variants).

        Raises:
            InvalidRequestError: already committed or released, or ``stats`` of the wrong length.
        """
        if lease.committed or lease.released:
            raise InvalidRequestError("a lease is committed once, before it is released")
        stats = [None] * len(lease.pieces) if stats is None else stats
        if len(stats) != len(lease.pieces):
            raise InvalidRequestError(f"{len(stats)} statistics for {len(lease.pieces)} pieces")
        start = lease.committed_pieces
        fresh = self._insert_pieces(lease, len(lease.pieces))
        uses = [p.use for p in lease.pieces if p.use is not None]
        for use in uses:
            if use.node.variant is not None:  # (its variant role may have been evicted meanwhile)
                use.node.variant.reuse_score += 1.0 / max(use.cfo, 1e-3)
        added = [(piece.node, VariantInfo(st, piece.start, self._variants.fingerprint))
                 for piece, st in zip(lease.pieces[start:], stats[start:])
                 if st is not None and piece.node is not None and piece.use is None and piece.node.variant is None
                 and piece.spec.chunk and piece.spec.key not in piece.context]  # a repeat in the prompt is no variant
        sources, lease.sources = lease.sources, []
        self.release(sources)
        lease.committed = True
        touched = list(lease.prefix) + [u.node for u in uses] + fresh
        computed = [False] * (len(lease.prefix) + len(uses)) + [True] * len(fresh)
        if touched:  # a request that does not use the cache leaves the statistics alone
            self.record_request(touched, computed, lease.cached_tokens + lease.reused_tokens,
                                self._computed_tokens(lease, rest_tokens))
        for node, info in added:
            self._variants.add(node, info)

    def commit_prefix(self, lease: Lease, num_pieces: int, rest_tokens: int) -> list[Node]:
        """A chunked prefill (vLLM's and SGLang's chunked prefill over RAGCache's tree, §5.1) has
        computed its first ``num_pieces`` pieces whole: those not committed yet become tree nodes
        now, as :meth:`commit` makes them, so other requests (and the disk tier) can use them
        before this prefill ends; each gets Alg. 1's statistics (computed by this request) at once.
        The prefix nodes are counted, the copy sources released and the lease marked committed
        by :meth:`commit`, after the last chunk. A piece only part-computed is never inserted; if
        the request ends before its last chunk, :meth:`finish` unlocks what was committed (exact
        KV of the request's own prefix, which stays cached) and frees the rest.

        Args:
            lease: from :meth:`admit`, not committed, with no chunk variant in use (a prefill that
                reuses variants is computed whole: its quality guard and recompute selection see
                the whole prompt).
            num_pieces: leading pieces whose KV is complete, ``0 <= num_pieces <= len(pieces)``.
            rest_tokens: prompt tokens the prefill computes past the lead (eq. 3's beta).

        Returns:
            the nodes inserted by this call (held by the lease).

        Raises:
            InvalidRequestError: a committed or released lease, a lease with a chunk variant in
                use, or ``num_pieces`` out of range.
        """
        if lease.committed or lease.released:
            raise InvalidRequestError("a lease is committed once, before it is released")
        if any(p.use is not None for p in lease.pieces):
            raise InvalidRequestError("a prefill that reuses chunk variants is committed whole")
        if not 0 <= num_pieces <= len(lease.pieces):
            raise InvalidRequestError(f"{num_pieces} computed pieces of a lease of {len(lease.pieces)}")
        fresh = self._insert_pieces(lease, num_pieces)
        if fresh:
            self.record_request(fresh, [True] * len(fresh), lease.cached_tokens, self._computed_tokens(lease, rest_tokens))
        return fresh

    def _insert_pieces(self, lease: Lease, upto: int) -> list[Node]:
        """Insert ``lease.pieces[lease.committed_pieces:upto]`` under the lease's path (blocks change
        owner) and advance ``committed_pieces``; returns the nodes inserted (locked for the lease).
        A piece becomes approximate from the first reused chunk (or approximate prefix node) on;
        from the first piece that cannot hang from the tree on, none is inserted."""
        done = lease.pieces[:lease.committed_pieces]
        approx = any(n.approximate for n in lease.prefix) or any(p.use is not None for p in done)
        inserting = all(p.node is not None for p in done)
        path = lease.path
        parent = path[-1] if path else None
        fresh: list[Node] = []
        for i in range(lease.committed_pieces, upto):
            piece = lease.pieces[i]
            approx = approx or piece.use is not None
            key = approximate_key(piece.spec.key, lease.rule_key) if approx else piece.spec.key
            holder = self._tree.root if parent is None else parent
            twin = holder.children.get(key)
            if twin is not None and (approx or not twin.serves(piece.spec.token_ids)):
                # another approximation of this path is cached already, or a node of this key holds
                # other tokens (a hash collision): this request keeps its own KV (it decodes over
                # what it prefilled), and nothing below can hang from the tree
                inserting = False
            if inserting:
                node = self.insert(parent, key, piece.spec.num_tokens, piece.blocks, tokens=piece.spec.token_ids)
                piece.node, piece.blocks, parent = node, list(node.device_blocks or ()), node  # the lease holds it now
                node.approximate = approx
                if not approx:
                    self._stack.after_insert(node, len(lease.prefix) + sum(p.node is not None for p in lease.pieces))
                fresh.append(node)
            lease.committed_pieces = i + 1
        return fresh

    @staticmethod
    def _computed_tokens(lease: Lease, rest_tokens: int) -> int:
        """Eq. 3's beta for the lease's request: the tokens its prefill computes (>= 1)."""
        beta = sum(p.spec.num_tokens if p.use is None else len(p.use.recompute) for p in lease.pieces) + rest_tokens
        return max(beta, 1)

    def keep_tail(self, lease: Lease, blocks: Sequence[SegmentSpec], context_tokens: int,
                  repeat: SegmentSpec | None = None) -> int:
        """Before :meth:`finish`: the lease's first tail blocks become block nodes under its last
        lead node (vLLM keeps a finished request's full blocks the same way), so a later prompt
        that continues this one (the next turn of a chat, with this answer in it) reuses them.

        Args:
            lease: a committed lease whose whole path is exact tree nodes (otherwise nothing is kept).
            blocks: the block segments, in order, each a whole number of blocks, covering the
                first tokens the request wrote past its lead (whose KV is in its tail blocks).
            context_tokens: tokens before the first block (the lead), for the cost statistics.
            repeat: the prompt's last, shorter block (the first tokens of the tail), kept too as a
                host copy under the lead, so an exact repeat of the prompt reuses all but its final
                token (needs a host tier with room; skipped otherwise).

        Returns:
            how many block nodes now hold the request's tail KV (new or already cached).

        Raises:
            InvalidRequestError: a block segment that is not a whole number of blocks, or more
                blocks than the lease's tail holds.
        """
        if not lease.committed or lease.released or not (blocks or repeat):
            return 0
        bs = self.block_size
        if any(spec.num_tokens % bs for spec in blocks) or sum(s.num_tokens for s in blocks) > len(lease.tail_blocks) * bs:
            raise InvalidRequestError(f"tail blocks of {[s.num_tokens for s in blocks]} tokens do not fit "
                                      f"{len(lease.tail_blocks)} tail blocks of {bs} tokens")
        lead = list(lease.prefix) + [p.node for p in lease.pieces]
        if any(n is None for n in lead):
            return 0  # a piece of this request hangs nowhere (another version of its path is cached)
        parent = lead[-1] if lead else self._tree.root
        if not (parent.is_root or parent.in_device):
            return 0
        depth = len(KnowledgeTree.path_to(parent))
        if repeat is not None:
            self._keep_repeat(parent, repeat, lease.tail_blocks, depth + 1)
        if parent.approximate:
            return 0  # the answer's KV was computed over approximate KV: only the repeat is kept
        kept: list[Node] = []
        used = 0
        try:
            for spec in blocks:
                twin = parent.children.get(spec.key)
                if twin is not None and not twin.serves(spec.token_ids):
                    break
                n = spec.num_tokens // bs
                ids = lease.tail_blocks[used:used + n]
                node = self.insert(parent, spec.key, spec.num_tokens, ids, tokens=spec.token_ids)
                used += n  # the blocks are the node's now, or were freed for an existing copy
                kept.append(node)
                depth += 1
                self._stack.after_insert(node, depth)
                parent = node
        finally:
            lease.tail_blocks = lease.tail_blocks[used:]
            if kept:
                try:
                    self.record_request(kept, [True] * len(kept), context_tokens, sum(n.num_tokens for n in kept))
                finally:
                    self.release(kept)
        return len(kept)

    def _keep_repeat(self, parent: Node, spec: SegmentSpec, tail_blocks: Sequence[int], depth: int) -> None:
        """A host-only node of ``spec`` under ``parent`` (at ``depth``): a copy of the first tail tokens
        (approximate under an approximate parent: its KV was computed over approximate KV)."""
        stack = self._stack
        n = spec.num_tokens
        key = approximate_key(spec.key, approximate_rule(parent.key)) if parent.approximate else spec.key
        if (key in parent.children or not stack.host.enabled or n > len(tail_blocks) * self.block_size
                or not stack.make_host_room(stack.host.nbytes(n))):
            return
        kv = self._mover.swap_out(tail_blocks[:blocks_for(n, self.block_size)], n)
        node = None
        try:
            node = self._tree.add_child(parent, key, n, spec.token_ids)
            node.approximate = parent.approximate
            if not stack.host.put(node, kv):
                raise AssertionError(f"host room was made for {node!r} but it does not fit")
            stack.after_insert(node, depth)
        except BaseException:
            if node is not None and self._tree.contains(node):
                self._tree.remove(node)
            if node is None or node.host_kv is None:
                self._mover.free_host(kv)
            raise

    def finish(self, lease: Lease) -> None:
        """Unlock the lease's nodes and free the blocks it owns; idempotent (safe in ``finally``)."""
        if lease.released:
            return
        lease.released = True
        held = list(lease.prefix) + list(lease.sources) + [p.node for p in lease.pieces if p.node is not None]
        owned = [p.blocks for p in lease.pieces if p.node is None and p.blocks] + [lease.tail_blocks]
        lease.prefix, lease.sources, lease.tail_blocks = [], [], []
        for piece in lease.pieces:
            piece.node, piece.blocks = None, []
        try:
            for blocks in owned[:-1]:
                self.free(blocks)
        finally:  # whatever happens, the locks go and the tail is freed
            try:
                if held:
                    self.release(held)
            finally:
                if owned[-1]:
                    self.free(owned[-1])

    # ----------------------------------------------------------------- chunk variants (Cache-Craft §3.3)
    def configure_variants(self, *, fingerprint: str, per_chunk: int = 4, total: int = 1024) -> None:
        """See :meth:`VariantStore.configure` (the model fingerprint variants are served under, the caps)."""
        self._variants.configure(fingerprint=fingerprint, per_chunk=per_chunk, total=total)

    def variants(self, chunk: SegmentKey) -> list[Node]:
        """Resident variants of ``chunk`` recorded under this cache's fingerprint, oldest first."""
        return self._variants.of(chunk)

    def variants_any(self, chunk: SegmentKey) -> list[Node]:
        """Resident variants of ``chunk`` whatever their fingerprint."""
        return self._variants.any_of(chunk)

    @property
    def num_variants(self) -> int:
        """Resident chunk variants (all fingerprints)."""
        return len(self._variants)

    def add_variant(self, node: Node, info: VariantInfo) -> None:
        """See :meth:`VariantStore.add`."""
        self._variants.add(node, info)

    # ----------------------------------------------------------------- the disk tier
    def attach_disk(self, disk: DiskStore) -> None:
        """Use ``disk`` as the tier below host memory: exact nodes are written to it after they are
        inserted (:meth:`persist_pending`), and a prefix match that runs past what memory holds
        continues on disk (files read into the host tier, then swapped in as host hits are)."""
        self._stack.disk = DiskTier(disk, self._mover, keep_variant=self._variants.serves)

    def attach_remote(self, store: RemoteStore) -> None:
        """Use ``store`` (Redis shared by replicas) as the tier below the disk tier: exact nodes are
        sent to it once after they are inserted, and a prefix match that runs past memory and disk
        continues there (entries read into the host tier, token ids and checksum verified)."""
        self._stack.remote = RemoteTier(store, self._mover)

    @property
    def remote(self) -> RemoteStore | None:
        """The remote tier's store, if attached."""
        return self._stack.remote.store if self._stack.remote is not None else None

    def close_disk(self, timeout: float | None = 30.0) -> None:
        """Finish the disk and remote tiers' queued writes (up to ``timeout`` seconds) and stop their writers."""
        self._stack.close_disk(timeout)

    def persist_pending(self, max_bytes: int = 64 << 20) -> int:
        """See :meth:`TierStack.persist_pending` (called by the engine after a step's tokens went out)."""
        return self._stack.persist_pending(max_bytes)

    def _acquire_with_disk(self, keys: Sequence[SegmentKey], *, approximate: bool = False,
                           tokens: Sequence[Sequence[int]] = (), rule: str = "") -> AcquiredPrefix:
        """:meth:`acquire` of the longest prefix in memory, continued on the disk tier: the nodes
        read from disk and swapped in count as ``disk_hits``, not ``host_hits``. ``tokens``: per
        key, the segment's token ids, compared with every node's and file's before it serves."""
        match = self.match(keys, approximate=approximate, tokens=tokens, rule=rule)
        loaded = self._stack.read_back(match.nodes, keys, self._variants.restore, tokens)
        if loaded:
            nodes = match.nodes + tuple(loaded)
            match = MatchResult(nodes, tuple(n.tiers[0] for n in nodes), sum(n.num_tokens for n in nodes))
        acq = self.acquire(match)
        disk_hits = min(len(loaded), acq.host_hits)
        acq.host_hits -= disk_hits
        acq.disk_hits = disk_hits
        self.stats.host_hits -= disk_hits
        return acq

    def holds(self, keys: Sequence[SegmentKey], tokens: Sequence[Sequence[int]] = (), *, approximate: bool = False,
              rule: str = "") -> bool:
        """True if the whole path ``keys`` is cached now, in memory or (past what memory holds) on
        the disk tier; changes nothing. ``tokens``, ``approximate`` and ``rule`` as for :meth:`match`."""
        nodes = self.match(keys, approximate=approximate, tokens=tokens, rule=rule).nodes
        if len(nodes) == len(keys):
            return True
        disk, remote = self._stack.disk, self._stack.remote
        if (disk is None and remote is None) or not self._stack.host.enabled or any(n.approximate for n in nodes):
            return False
        parent = nodes[-1].path_key if nodes else ""
        rest: list[str] = []
        for i in range(len(nodes), len(keys)):
            pkey = path_key(parent, keys[i])
            entry = disk.lookup(pkey) if disk is not None and not rest else None
            if entry is None:
                if remote is None or not (i < len(tokens) and tokens[i]):
                    return False
                rest.append(pkey)  # asked of the remote tier below, in one round trip
            elif i < len(tokens) and tokens[i] and entry.tokens != tuple(tokens[i]):
                return False
            parent = pkey
        return all(remote.holds(rest)) if rest else True

    # ----------------------------------------------------------------- lower-level calls
    def match(self, keys: Sequence[SegmentKey], *, approximate: bool = False,
              tokens: Sequence[Sequence[int]] = (), rule: str = "") -> MatchResult:
        """Longest resident prefix of ``keys`` (O(depth)); changes nothing. ``approximate``: may
        follow approximate nodes made under the recompute rule whose key is ``rule`` (chunk modes only). ``tokens``: per key, the segment's token ids;
        a node whose recorded tokens differ ends the match (a key is a hash, never trusted alone)."""
        nodes = tuple(self._tree.match_prefix(keys, approximate=approximate, tokens=tokens, rule=rule))
        return MatchResult(nodes, tuple(n.tiers[0] for n in nodes), sum(n.num_tokens for n in nodes))

    def acquire(self, match: MatchResult) -> AcquiredPrefix:
        """Lock the matched prefix and bring it all to device; never raises for lack of room.

        Host-only nodes are swapped in (keeping their host copy). If one cannot get device blocks
        because locked data fills the arena, the prefix is truncated before it and the rest is
        unlocked (the caller recomputes it).
        """
        stack = self._stack
        nodes: list[Node] = []
        parent = self._tree.root
        for n in match.nodes:  # a stale match is cut where it stopped being valid
            if n.parent is not parent or parent.children.get(n.key) is not n or not n.resident:
                break
            nodes.append(n)
            parent = n
        for n in nodes:
            stack.lock(n)  # lock first: swap-in evictions must not touch the path
        device_hits = host_hits = 0
        for idx, n in enumerate(nodes):
            if n.in_device:
                device_hits += 1
                continue
            try:
                swapped = stack.swap_in(n)
            except BaseException:
                for m in nodes:
                    stack.unlock(m)
                raise
            if not swapped:
                for m in nodes[idx:]:
                    stack.unlock(m)
                del nodes[idx:]
                break
            host_hits += 1
        self.stats.device_hits += device_hits
        self.stats.host_hits += host_hits
        return AcquiredPrefix(nodes=tuple(nodes), blocks=tuple(tuple(n.device_blocks or ()) for n in nodes),
                              device_hits=device_hits, host_hits=host_hits,
                              cached_tokens=sum(n.num_tokens for n in nodes))

    def allocate(self, num_blocks: int) -> list[int]:
        """Blocks owned by the caller's request, evicting unlocked device leaves as needed.

        Raises:
            InvalidRequestError: a negative count.
            CacheBudgetError: more blocks than the arena has, or than locks leave evictable.
        """
        device = self._stack.device
        if num_blocks < 0:
            raise InvalidRequestError(f"cannot allocate a negative number of blocks ({num_blocks})")
        cap = device.num_blocks
        if num_blocks > cap:
            raise CacheBudgetError(
                f"need {num_blocks} device blocks ({num_blocks * self.block_size} tokens) but the "
                f"device arena holds only {cap} blocks; raise the device budget")
        if not self._stack.make_device_room(num_blocks):
            raise CacheBudgetError(
                f"need {num_blocks} device blocks but only {device.num_free} of {cap} are free "
                f"and {device.evictable_blocks()} more can be evicted (the rest is held by "
                f"locked nodes and running requests); raise the device budget or lower concurrency")
        return device.allocate(num_blocks)

    def free(self, blocks: Sequence[int]) -> None:
        """Return request-owned blocks (from ``allocate``, not given to ``insert``)."""
        self._stack.device.free(blocks)

    def insert(self, parent: Node | None, key: SegmentKey, num_tokens: int, blocks: Sequence[int],
               tokens: Sequence[int] = ()) -> Node:
        """Make ``blocks`` (from ``allocate``) the device KV of segment ``key`` under ``parent``.

        ``parent`` None means the root; otherwise it must be on device (acquired or just
        inserted). Returns the node locked for the caller (lock_ref += 1). If ``key`` is already
        a child on device, the given blocks are freed and the existing node is returned; if it is
        a host-only child, the blocks become its device copy (no swap-in needed). ``tokens``: the
        segment's token ids, recorded on a new node.

        Raises:
            InvalidRequestError: a parent outside the tree or off device, fewer than one token,
                blocks that are not this many request-owned blocks, or ``tokens`` that differ from
                those of the child already under ``key`` (a hash collision: nothing changes).
        """
        parent = self._tree.root if parent is None else parent
        if not self._tree.contains(parent):
            raise InvalidRequestError(f"parent {parent!r} is not in the knowledge tree")
        if num_tokens < 1:
            raise InvalidRequestError(f"a segment needs >= 1 token, got {num_tokens}")
        ids = list(blocks)
        self._stack.device.check_adoption(parent, num_tokens, ids)
        node = parent.children.get(key)
        if node is not None and not node.serves(tokens):
            raise InvalidRequestError(f"segment key {key} is cached for other tokens (a hash collision)")
        if node is not None and node.in_device:
            self.free(ids)
            self._stack.lock(node)
            return node
        if node is None:
            node = self._tree.add_child(parent, key, num_tokens, tokens)
        self._stack.lock(node)
        self._stack.device.adopt(node, ids)
        if node.in_host and self._stack.shared_pool:  # a second copy in the same memory protects nothing
            self._stack.host.drop(node)
        return node

    def release(self, nodes: Sequence[Node]) -> None:
        """Unlock ``nodes`` (lock_ref -= 1 each); all-or-nothing."""
        self._stack.release(nodes)

    def record_request(self, path: Sequence[Node], computed: Sequence[bool], alpha: int, beta: int) -> None:
        """Alg. 1 UPDATE_NODE for every node on a finished request's path.

        ``alpha``/``beta`` are the request's cached / non-cached token counts; ``computed[i]``
        says whether ``path[i]`` had to be computed (then its cost ``T(alpha, beta) / beta``
        seconds per token joins eq. 3's average).

        Raises:
            InvalidRequestError: flags and path of different lengths, or bad token counts.
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
            self._stack.reprice(node)  # Alg. 1 line 13

    def clear(self) -> None:
        """Drop every node not needed by a locked node (locked nodes and their ancestors stay)."""
        self._stack.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError describing every broken invariant (for tests)."""
        check_invariants(self._tree, self._stack)
