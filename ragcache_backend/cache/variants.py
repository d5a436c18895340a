"""The chunk-variant store (Cache-Craft §3.3) and the choice of a variant for each chunk (§3.4.1).

A chunk *variant* is a knowledge-tree node whose KV may also serve its document at another
position or after other documents: a document computed in a chunk mode, with its recorded
attention statistics (:class:`~ragcache_backend.cache.chunk_reuse.VariantInfo`). The store indexes
variants by chunk, serves only those recorded under its model fingerprint (another model's or
dtype's variant is never served), and caps them per chunk (M) and in total (N x M), dropping the
lowest reuse score ``f_r`` first. Memory pressure evicts variants like any node, by the tier's
policy; the disk tier keeps variants with their records, so a variant evicted from memory (or
lost with a restart) competes again from disk.

For each document of a chunk-mode request past its exact prefix, :meth:`VariantStore.serve_pieces`
picks the variant with the lowest cache fix overhead (CFO, eq. 12) for the new context, or none
(the document is computed in full, and becomes a variant for this context). Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ragcache_backend.cache.chunk_reuse import RecomputeRule, VariantInfo, choose_with_rule, context_keys
from ragcache_backend.cache.disk import DiskEntry
from ragcache_backend.cache.knowledge_tree import KnowledgeTree, Node, SegmentKey, approximate_rule
from ragcache_backend.cache.lease import ChunkPiece, ChunkSpec, VariantUse
from ragcache_backend.cache.stack import CacheStats, TierStack
from ragcache_backend.errors import InvalidRequestError

__all__ = ["ServedPieces", "VariantStore", "part_keys"]


@dataclass(slots=True, frozen=True)
class ServedPieces:
    """A request's segments past its prefix, and where the variants serving them were found.

    Attributes:
        pieces: one per segment, in prompt order (``use`` set where a variant serves it).
        device_hits, host_hits, disk_hits: variants found on device, swapped in from host, read
            back from the disk tier.
    """

    pieces: list[ChunkPiece]
    device_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0


def part_keys(specs: Sequence[ChunkSpec]) -> tuple[tuple[str, ...], tuple[int, ...], list[int]]:
    """Every context part's id (unique within the prompt) and length, and each spec's first part."""
    keys, lengths, first = [], [], []
    for spec in specs:
        first.append(len(keys))
        for part in spec.context_parts():
            keys.append(part.key)
            lengths.append(part.num_tokens)
    return context_keys(keys), tuple(lengths), first


class VariantStore:
    """Chunk variants of one cache, by chunk key.

    Args:
        tree: the knowledge tree the variants are nodes of.
        stack: the tiers (to lock variants and bring them to device, drop them, read them back).
        stats: the cache's counters (``variants_added``, ``variant_evictions``).
    """

    def __init__(self, tree: KnowledgeTree, stack: TierStack, stats: CacheStats) -> None:
        self._tree = tree
        self._stack = stack
        self._stats = stats
        self._by_chunk: dict[SegmentKey, list[Node]] = {}  # chunk key -> variant nodes (stale ones pruned lazily)
        self.fingerprint = ""
        self.per_chunk = 4
        self.total = 1024

    def configure(self, *, fingerprint: str, per_chunk: int = 4, total: int = 1024) -> None:
        """The model fingerprint variants are recorded and served under, and the caps: ``per_chunk``
        variants of one chunk (M) and ``total`` variants (N x M), §3.3.

        Raises:
            InvalidRequestError: a cap below 1.
        """
        if per_chunk < 1 or total < 1:
            raise InvalidRequestError(f"variant caps must be >= 1, got {per_chunk} per chunk, {total} in total")
        self.fingerprint, self.per_chunk, self.total = fingerprint, per_chunk, total

    def serves(self, info: VariantInfo) -> bool:
        """True if a variant record is of this store's model and dtype (only those are served or kept)."""
        return info.fingerprint == self.fingerprint

    # ---- the index -------------------------------------------------------------------------------
    def of(self, chunk: SegmentKey) -> list[Node]:
        """Resident variants of ``chunk`` under this store's fingerprint, oldest first."""
        return [n for n in self.any_of(chunk) if self.serves(n.variant)]

    def any_of(self, chunk: SegmentKey) -> list[Node]:
        """Resident variants of ``chunk`` whatever their fingerprint (prunes stale entries)."""
        live = [n for n in self._by_chunk.get(chunk, ()) if n.variant is not None and n.resident and n.parent is not None]
        if live:
            self._by_chunk[chunk] = live
        else:
            self._by_chunk.pop(chunk, None)
        return list(live)

    def __len__(self) -> int:
        """Resident chunk variants (all fingerprints)."""
        return sum(len(self.any_of(k)) for k in list(self._by_chunk))

    def add(self, node: Node, info: VariantInfo) -> None:
        """Record ``node`` (in the tree, resident) as a variant of ``info.stats.chunk``, then apply the
        caps (the new variant itself is never the one dropped).

        Raises:
            InvalidRequestError: the node is not a resident node of the tree.
        """
        if node.is_root or not node.resident or not self._tree.contains(node):
            raise InvalidRequestError(f"{node!r} is not a resident node of the knowledge tree")
        if self._index(node, info):
            self._stats.variants_added += 1

    def restore(self, node: Node, info: VariantInfo | None) -> None:
        """Make ``node`` (read back from disk) a variant again, if ``info`` is one of this model's
        and fits it; the caps apply as to a new variant (not counted as added)."""
        if (info is None or not self.serves(info) or not info.fits(node.key, node.num_tokens)
                or node.variant is not None or node.approximate):
            return
        self._index(node, replace(info))

    def _index(self, node: Node, info: VariantInfo) -> bool:
        """Give ``node`` the record ``info``, index it by chunk if it was no variant yet, and apply
        the caps (``node`` is never the one dropped). Returns True if it was no variant yet."""
        fresh = node.variant is None
        node.variant = info
        if fresh:
            self._by_chunk.setdefault(SegmentKey(info.stats.chunk), []).append(node)
        self._enforce_caps(node)
        return fresh

    def _enforce_caps(self, keep: Node) -> None:
        """Drop the lowest-``f_r`` variants until the chunk of ``keep`` has at most M and the store
        at most N x M (§3.3); ``keep`` (just added) is never chosen. A dropped variant that is an
        unlocked leaf leaves the tree (its KV is freed); one that is still a prefix of other nodes,
        or in use, only stops being a variant (the tree and its budgets keep its KV)."""
        def lowest(nodes):
            return min((n for n in nodes if n is not keep), key=lambda n: (n.variant.reuse_score, n.serial), default=None)

        chunk = SegmentKey(keep.variant.stats.chunk)
        while len(self.any_of(chunk)) > self.per_chunk:
            self._drop(lowest(self.any_of(chunk)))
        while len(self) > self.total:
            self._drop(lowest(n for k in list(self._by_chunk) for n in self.any_of(k)))

    def _drop(self, node: Node) -> None:
        self._stats.variant_evictions += 1
        if node.lock_ref or node.children:
            node.variant = None  # pruned from the index at the next lookup
            return
        self._stack.remove(node)

    # ---- choosing variants for a request (§3.4.1) -------------------------------------------------
    def serve_pieces(self, specs: Sequence[ChunkSpec], prefix: list[Node], start: int, rule: RecomputeRule | None,
                     fresh_above: float, sources: list[Node]) -> ServedPieces:
        """The pieces after ``prefix``, each served from its lowest-CFO variant (locked, on device,
        appended to ``sources``) or computed fresh; ``rule`` None: every piece fresh."""
        if rule is None and not any(s.chunk for s in specs):  # exact mode: no context to record
            pieces = []
            for spec in specs[len(prefix):]:
                pieces.append(ChunkPiece(spec, start, (), []))
                start += spec.num_tokens
            return ServedPieces(pieces)
        keys, lengths, first_part = part_keys(specs)
        pieces, on_device, swapped, read, from_disk = [], 0, 0, 0, []
        for i in range(len(prefix), len(specs)):
            spec = specs[i]
            context = keys[: first_part[i]]
            use = None
            if rule is not None and spec.chunk and keys[first_part[i]] == spec.key:  # a document's first occurrence
                use = self._best(spec, context, lengths[: first_part[i]], start, rule, prefix + sources,
                                 fresh_above, from_disk)
            if use is not None and rule.kind == "cfo" and use.cfo > fresh_above:
                use = None
            if use is not None:
                fetched, was_on_device = use.node in from_disk, use.node.in_device
                if self._stack.acquire_node(use.node):
                    sources.append(use.node)
                    read += fetched
                    on_device += was_on_device and not fetched
                    swapped += not was_on_device and not fetched
                else:
                    use = None
            pieces.append(ChunkPiece(spec, start, context, [], use))
            start += spec.num_tokens
        return ServedPieces(pieces, on_device, swapped, read)

    def _best(self, spec: ChunkSpec, context: tuple[str, ...], lengths: Sequence[int], start: int,
              rule: RecomputeRule, held: list[Node], fresh_above: float = 1.0,
              from_disk: list[Node] | None = None) -> VariantUse | None:
        """The lowest-CFO usable variant of ``spec``'s chunk for ``context`` (not yet locked), or None.

        With a disk tier, the variants of the chunk that only the disk holds compete too; if one of
        them wins (and its CFO is at most ``fresh_above``) its path is read back and brought to
        device (appended to ``from_disk``); if that fails, the best resident variant is used."""
        shared = self._stack.shared_pool  # moving a path to device copies nothing: any resident variant may serve
        cands = [n for n in self.of(spec.key)
                 if n.num_tokens == spec.num_tokens and n not in held and n.serves(spec.token_ids)
                 and (shared or _acquirable(n))
                 and (not n.approximate or approximate_rule(n.key) == rule.key)]  # approximated under this rule only
        on_disk = self._disk_only(spec) if from_disk is not None else []
        if not cands and not on_disk:
            return None
        cands.sort(key=lambda n: n.approximate)  # on equal CFO, a variant computed exactly wins (stable sort)
        choice = choose_with_rule([n.variant.stats for n in cands] + [e.variant.stats for e in on_disk],
                                  context, rule, lengths)
        node = next((n for n in cands if n.variant.stats is choice.stats), None)
        if node is not None and not _acquirable(node):
            if rule.kind == "cfo" and choice.cfo > fresh_above:
                return None  # computed fresh anyway: nothing to move
            if not self._ancestors_to_device(node):
                return None
        if node is None:
            if rule.kind == "cfo" and choice.cfo > fresh_above:
                return None  # computed fresh anyway: nothing to read
            entry = next(e for e in on_disk if e.variant.stats is choice.stats)
            node = self._load(entry)
            if node is None or node in held:
                return self._best(spec, context, lengths, start, rule, held, fresh_above) if cands else None
            from_disk.append(node)
            choice = choose_with_rule([node.variant.stats], context, rule, lengths)
        return VariantUse(node, choice.cfo, choice.recompute, start - node.variant.start)

    def _ancestors_to_device(self, node: Node) -> bool:
        """Shared pool: move a resident variant's host-only ancestors to device (a node on device
        needs its parent there; in a shared pool a move hands blocks over, no copy), so that the
        variant itself can be acquired. The path is locked while room is made and unlocked after,
        as :meth:`_load` leaves a path read from disk. False, with nothing held, if there is no room."""
        path = []
        n = node.parent
        while n is not None and not n.is_root:
            path.append(n)
            n = n.parent
        path.reverse()
        return all(m.resident for m in path) and self._to_device(path, also_lock=(node,))

    def _to_device(self, nodes: Sequence[Node], also_lock: Sequence[Node] = ()) -> bool:
        """Bring ``nodes`` (a path, root side first) to device, locked together with ``also_lock``
        while room is made (room made for one must not evict the others) and unlocked after.
        False if one could not be placed (those before it stay on device)."""
        held = (*nodes, *also_lock)
        for n in held:
            self._stack.lock(n)
        try:
            return all(n.in_device or self._stack.swap_in(n) for n in nodes)
        finally:
            for n in held:
                self._stack.unlock(n)

    def _disk_only(self, spec: ChunkSpec) -> list[DiskEntry]:
        """Variants of ``spec``'s chunk that only the disk tier holds (this fingerprint and length;
        a variant whose node is resident is planned from memory)."""
        disk = self._stack.disk
        if disk is None or not self._stack.host.enabled:
            return []
        found = [e for e in disk.variants(spec.key, spec.num_tokens)
                 if self.serves(e.variant) and (not spec.token_ids or e.tokens == spec.token_ids)]
        if not found:
            return []
        resident = {n.path_key for n in self.any_of(spec.key)}
        return [e for e in found if e.path_key not in resident]

    def _load(self, entry: DiskEntry) -> Node | None:
        """Read a disk-only variant's path back (its ancestors too: a node's KV is only valid after
        its own prefix, and a node on device needs its parent there) and bring it all to device,
        unlocked, as a resident variant is before planning locks it. None, with nothing held, if a
        file is gone or fails its checksum (it is deleted), or there is no room."""
        disk = self._stack.disk
        keys = disk.path_keys(entry.path_key) if disk is not None else None
        if keys is None:
            return None
        path = [SegmentKey(k) for k in keys]
        nodes = self._tree.match_prefix(path)
        nodes += self._stack.read_back(nodes, path, self.restore)
        if len(nodes) != len(keys):
            return None
        placed = self._to_device(nodes)
        node = nodes[-1]
        if node.variant is None:  # resident already, computed by a request that recorded no variant
            self.restore(node, entry.variant)
        return node if placed and node.variant is not None else None


def _acquirable(node: Node) -> bool:
    """``node`` can be locked on device as it is: it is there, or its parent is (or it has none)."""
    return node.in_device or node.parent is None or node.parent.is_root or node.parent.in_device
