"""The connector's scheduler side: which blocks of a request our tiers hold, and what to save.

Runs in vLLM's EngineCore process with plain data only (token ids, block ids, path keys); it never
touches a tensor. It owns the *index* of the host tier (which lives in the worker's memory; the
worker stores and drops exactly what a :class:`~ragcache_integrations.vllm.plan.StepPlan` says) and
prices it with the replacement policy (PGDSF by default: RAGCache §5.1, eq. 1-3, Alg. 1, with the
tier's clock, through the same :class:`~ragcache_backend.cache.evictor.Evictor` as every tier of
ours). Each host entry owns one *slot* of the worker's host arena (a KV tensor preallocated with
the tier's budget, in vLLM's block layout): this side hands out slots and puts them in the plan,
so a save is a copy into slots that are already paged in, and a load a copy out of them. A
slot whose block is still being written to the disk or remote tier (the writers read it there)
is not evicted until the worker reports the write done. The disk tier is a folder of checksummed files (:class:`~ragcache_backend.cache.disk.DiskStore`
in the worker); this side checks whether a block's file exists, which also finds blocks written
before a restart. The remote tier (:class:`~ragcache_backend.cache.remote.RemoteStore`, Redis shared
by replicas) is asked once per lookup for the blocks past what host and disk hold. A block found here may still fail the worker's checks (a file evicted or damaged
meanwhile, tokens that differ): the worker reports it, vLLM recomputes it, and the key leaves the
index.

Block cost for PGDSF: the prefill time per token of a block grows with the tokens before it
(attention reads them all). It comes from vLLM's own steps, timed by the worker and fitted here
(:class:`~ragcache_integrations.vllm.cost.BlockCostModel`), in units of a first-block token's
cost; until enough steps are measured a block at position ``p`` is priced ``1 + p / 2048``, a
prior, so that of two blocks used as often the later one, costlier to recompute, stays.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ragcache_backend.cache.disk import entry_file
from ragcache_backend.cache.evictor import Evictor
from ragcache_backend.cache.policy import NodeStats, get_policy

from ragcache_integrations.vllm.cost import BlockCostModel, StepSample, attended_pairs
from ragcache_integrations.vllm.plan import BlockLoad, BlockSave, StepPlan, block_path_keys, block_segment_key, host_slots

__all__ = ["ConnectorScheduler", "HostEntry", "RequestView", "ScheduledRequest", "SchedulerCounters"]

HOST = "host"
DISK = "disk"
REMOTE = "remote"

RemoteExists = Callable[[Sequence[str]], list[bool]]
"""Which of these path keys the remote tier holds (one round trip; all False when it is down)."""


@dataclass(slots=True, eq=False)
class HostEntry:
    """One block in the host tier's index (what PGDSF prices).

    Attributes:
        path_key, parent: the block's path key and its parent's ("" for a first block).
        num_tokens: tokens of KV (the block size).
        frequency: requests that referenced the block (Alg. 1 line 3).
        avg_cost: estimated prefill cost per token (see the module docstring).
        last_access: the index's access counter at the last reference.
        children: blocks in the host tier whose parent this is (a block with children is never evicted).
        pinned: a load of it is planned this step (never evicted before the worker has read it), or
            it was admitted in this step (never evicted to make room for its own children).
        slot: its slot in the worker's host arena.
        writing: its disk or remote write is queued in the worker, reading the slot (never evicted
            before the worker reports it written).
    """

    path_key: str
    parent: str
    num_tokens: int
    frequency: int = 1
    avg_cost: float = 1.0
    last_access: int = 0
    serial: int = 0
    children: int = 0
    pinned: bool = False
    slot: int = 0
    writing: bool = False
    priority: dict[str, float] = field(default_factory=dict)

    def stats(self) -> NodeStats:
        return NodeStats(self.frequency, self.avg_cost, self.num_tokens, self.last_access)


@dataclass(slots=True, frozen=True)
class RequestView:
    """What the scheduler side reads of a vLLM request.

    Attributes:
        req_id: vLLM's request id.
        tokens: prompt then output token ids so far.
        salt: isolation salt (``cache_salt``, LoRA name), "" for none.
        cacheable: False for requests whose token ids do not identify their KV (multimodal inputs,
            prompt embeddings): nothing is loaded or saved for them.
    """

    req_id: str
    tokens: Sequence[int]
    salt: str
    cacheable: bool = True


@dataclass(slots=True, frozen=True)
class ScheduledRequest:
    """A request scheduled this step.

    Attributes:
        view: the request.
        num_computed: tokens whose KV is in vLLM's blocks before this step (vLLM's prefix hit,
            our loads, earlier steps).
        num_scheduled: tokens computed in this step.
        block_ids: the request's vLLM KV block ids, in order.
    """

    view: RequestView
    num_computed: int
    num_scheduled: int
    block_ids: Sequence[int]


@dataclass(slots=True)
class SchedulerCounters:
    """Totals since start (tokens, blocks)."""

    lookups: int = 0
    hit_tokens_host: int = 0
    hit_tokens_disk: int = 0
    hit_tokens_remote: int = 0
    saved_blocks: int = 0
    host_evictions: int = 0
    failed_blocks: int = 0


@dataclass(slots=True)
class _Tracked:
    view: RequestView
    keys: list[str]
    saved_blocks: int = 0  # blocks [0, saved_blocks) are saved or known to be stored
    load_from: int = 0  # first block to load (vLLM's own hit ends there)
    load_blocks: int = 0  # blocks to load after it
    load_tiers: list[str] = field(default_factory=list)


class ConnectorScheduler:
    """Lookup, admission and eviction of blocks in our tiers (see the module docstring).

    Args:
        block_size: vLLM's tokens per block.
        block_bytes: bytes of one block's KV over all layers (host tier accounting).
        host_budget_bytes: host tier budget (0: no host tier).
        disk_folder: the disk tier's folder (:func:`~ragcache_backend.cache.disk.store_folder`), None: off.
        policy: replacement policy name.
        remote_exists: the remote tier's lookup (:meth:`~ragcache_backend.cache.remote.RemoteStore.exists`),
            None: no remote tier.
    """

    def __init__(self, block_size: int, block_bytes: int, host_budget_bytes: int, disk_folder: Path | None,
                 policy: str = "pgdsf", remote_exists: RemoteExists | None = None) -> None:
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.host_budget_bytes = host_budget_bytes
        self.num_slots = host_slots(host_budget_bytes, block_bytes)
        self._free_slots: list[int] = []  # slots given back (taken first), then never-used ones from _next_slot
        self._next_slot = 0
        self._draining: set[int] = set()  # slots of removed entries whose writes still read them
        self._by_slot: dict[int, HostEntry] = {}
        self.disk_folder = disk_folder
        self.remote_exists = remote_exists
        self.counters = SchedulerCounters()
        self.cost = BlockCostModel(block_size)
        self._host: dict[str, HostEntry] = {}
        self._evictor: Evictor[HostEntry] = Evictor(HOST, get_policy(policy), self._is_candidate)
        self._access = 0
        self._serial = itertools.count(1)
        self._requests: dict[str, _Tracked] = {}
        self._drops: list[str] = []
        self._pinned: list[HostEntry] = []  # entries pinned by the plan being built (unpinned at its end)

    # ---- views ---------------------------------------------------------------------------------
    @property
    def host_used_bytes(self) -> int:
        return len(self._host) * self.block_bytes

    def host_keys(self) -> set[str]:
        return set(self._host)

    def tier_of(self, pkey: str) -> str | None:
        """Where a block is: ``"host"``, ``"disk"`` (its file exists) or None."""
        if pkey in self._host:
            return HOST
        if self.disk_folder is not None and entry_file(self.disk_folder, pkey).exists():
            return DISK
        return None

    # ---- vLLM's scheduler hooks, as plain data ---------------------------------------------------
    def match(self, view: RequestView, num_computed: int) -> int:
        """Tokens beyond ``num_computed`` (vLLM's own block-aligned hit) whose KV our tiers hold: a
        multiple of the block size, never the last token. Side-effect free apart from remembering
        the request (vLLM may ask again)."""
        tracked = self._track(view)
        tracked.load_from, tracked.load_blocks, tracked.load_tiers = 0, 0, []
        if not view.cacheable:
            return 0
        self.counters.lookups += 1
        usable = (len(view.tokens) - 1) // self.block_size
        first = num_computed // self.block_size
        tiers: list[str] = []
        last = min(usable, len(tracked.keys))
        for i in range(first, last):
            tier = self.tier_of(tracked.keys[i])
            if tier is None:
                break
            tiers.append(tier)
        rest = tracked.keys[first + len(tiers):last]
        if rest and self.remote_exists is not None:  # one round trip for the rest of the prefix
            for found in self.remote_exists(rest):
                if not found:
                    break
                tiers.append(REMOTE)
        tracked.load_from, tracked.load_tiers = first, tiers
        return len(tiers) * self.block_size

    def after_alloc(self, req_id: str, num_external_tokens: int) -> None:
        """vLLM allocated blocks for the request; ``num_external_tokens`` of them are ours to load."""
        tracked = self._requests.get(req_id)
        if tracked is None:
            return
        tracked.load_blocks = num_external_tokens // self.block_size

    def plan(self, scheduled: Iterable[ScheduledRequest]) -> StepPlan:
        """This step's loads (for requests :meth:`after_alloc` gave external tokens) and saves (blocks
        fully computed by the end of the step and not yet stored), with the host tier's evictions."""
        plan = StepPlan()
        scheduled = list(scheduled)
        plan.new_tokens = sum(s.num_scheduled for s in scheduled)
        plan.attended = sum(attended_pairs(s.num_computed, s.num_scheduled) for s in scheduled)
        steps = [(s, self._track(s.view)) for s in scheduled if s.view.cacheable]
        for s, tracked in steps:  # loads first: they pin their host blocks against this step's evictions
            if tracked.load_blocks:
                self._plan_loads(s, tracked, plan)
        for s, tracked in steps:
            done = (s.num_computed + s.num_scheduled) // self.block_size
            self._plan_saves(s, tracked, min(done, len(tracked.keys), len(s.block_ids)), plan)
        for e in self._pinned:  # not a walk over the whole host index: once per step, decodes included
            if e.pinned:
                e.pinned = False
                self._evictor.offer(e)
        self._pinned.clear()
        # a block admitted and evicted again within this plan is not kept (the worker drops, then saves)
        plan.saves = [s if s.slot is None or self._slot_of(s.path_key) == s.slot else replace(s, to_host=False, slot=None)
                      for s in plan.saves]
        if self.remote_exists is not None and plan.saves:  # one round trip: send only what the remote tier lacks
            there = self.remote_exists([s.path_key for s in plan.saves])
            plan.saves = [replace(s, to_remote=not found) for s, found in zip(plan.saves, there)]
        plan.saves = [s for s in plan.saves if s.to_host or s.to_disk or s.to_remote]
        for s in plan.saves:  # the writers read these slots: keep them until the worker reports them written
            if s.slot is not None and (s.to_disk or s.to_remote):
                self._host[s.path_key].writing = True
        plan.host_drops, self._drops = self._drops, []
        return plan

    def written(self, slots: Iterable[int]) -> None:
        """The worker's disk and remote writers are done reading these host slots (written or given
        up): their blocks may be evicted, and the slots of blocks already removed reused."""
        for slot in slots:
            if slot in self._draining:
                self._draining.discard(slot)
                self._free_slots.append(slot)
                continue
            e = self._by_slot.get(slot)
            if e is not None and e.writing:
                e.writing = False
                self._evictor.offer(e)

    def timed(self, samples: list[StepSample]) -> None:
        """The worker timed these steps' forward passes: they refine the block cost (PGDSF)."""
        self.cost.observe(samples)

    def finished(self, req_id: str) -> None:
        """The request is done (its blocks' saves were planned in the steps that computed them)."""
        self._requests.pop(req_id, None)

    def failed(self, path_keys: Iterable[str]) -> None:
        """The worker could not serve these blocks (missing, damaged, other tokens): forget them, and
        save them again when vLLM recomputes them (the worker deleted a damaged file)."""
        failed = set(path_keys)
        self.counters.failed_blocks += len(failed)
        gone = {k for k in failed if k in self._host}
        if gone:  # the failed blocks and every block below them leave the host tier, leaves first
            grew = True
            while grew:
                below = {k for k, e in self._host.items() if e.parent in gone} - gone
                grew = bool(below)
                gone |= below
            while gone:
                leaves = [k for k in gone if self._host[k].children == 0]
                if not leaves:
                    break
                for k in leaves:
                    self._remove(self._host[k])
                    self._drops.append(k)
                    gone.discard(k)
        for tracked in self._requests.values():
            for i, pkey in enumerate(tracked.keys[:tracked.saved_blocks]):
                if pkey in failed:
                    tracked.saved_blocks = i
                    break

    # ---- internals ---------------------------------------------------------------------------------
    def _track(self, view: RequestView) -> _Tracked:
        tracked = self._requests.get(view.req_id)
        if tracked is None:
            tracked = self._requests[view.req_id] = _Tracked(view, [])
        tracked.view = view
        tracked.keys = block_path_keys(view.tokens, self.block_size, view.salt, tracked.keys)
        return tracked

    def _plan_loads(self, s: ScheduledRequest, tracked: _Tracked, plan: StepPlan) -> None:
        first, n = tracked.load_from, min(tracked.load_blocks, len(tracked.load_tiers))
        for j in range(n):
            i = first + j
            pkey, tier = tracked.keys[i], tracked.load_tiers[j]
            tokens = tuple(s.view.tokens[i * self.block_size:(i + 1) * self.block_size])
            plan.loads.append(BlockLoad(pkey, tokens, int(s.block_ids[i]), tier, s.view.req_id,
                                        self._slot_of(pkey) if tier == HOST else None))
            if tier == HOST:
                self.counters.hit_tokens_host += self.block_size
            elif tier == DISK:
                self.counters.hit_tokens_disk += self.block_size
            else:
                self.counters.hit_tokens_remote += self.block_size
            e = self._host.get(pkey)
            if e is not None:
                e.pinned = True
                self._pinned.append(e)
                self._touch(e)
        tracked.saved_blocks = max(tracked.saved_blocks, first + n)
        tracked.load_blocks = 0

    def _plan_saves(self, s: ScheduledRequest, tracked: _Tracked, done: int, plan: StepPlan) -> None:
        for i in range(tracked.saved_blocks, done):
            pkey = tracked.keys[i]
            parent = tracked.keys[i - 1] if i else ""
            tokens = tuple(s.view.tokens[i * self.block_size:(i + 1) * self.block_size])
            cost = self.cost.relative_cost(i * self.block_size)
            in_host = pkey in self._host
            if in_host:
                self._touch(self._host[pkey])
            to_host = not in_host and self._admit(pkey, parent, cost)
            to_disk = self.disk_folder is not None and not entry_file(self.disk_folder, pkey).exists()
            if to_host or to_disk or self.remote_exists is not None:
                segment = block_segment_key(tokens, s.view.salt if i == 0 else "")
                plan.saves.append(BlockSave(pkey, parent, segment, tokens, int(s.block_ids[i]), to_host, to_disk, cost,
                                            s.view.req_id, slot=self._host[pkey].slot if to_host else None))
                self.counters.saved_blocks += 1
        tracked.saved_blocks = max(tracked.saved_blocks, done)

    def _admit(self, pkey: str, parent: str, cost: float) -> bool:
        if self.num_slots == 0:
            return False
        while not self._free_slots and self._next_slot >= self.num_slots:
            try:
                victim = self._evictor.pop()
            except LookupError:
                return False  # everything left is pinned, being written or has children
            self._remove(victim)
            self._drops.append(victim.path_key)
            self.counters.host_evictions += 1
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        # pinned for the rest of this plan: a block's own children admitted after it must not evict it
        e = HostEntry(pkey, parent, self.block_size, avg_cost=cost, serial=next(self._serial), slot=slot, pinned=True)
        self._host[pkey] = e
        self._pinned.append(e)
        self._by_slot[slot] = e
        p = self._host.get(parent)
        if p is not None:
            p.children += 1
        self._touch(e, count=False)
        return True

    def _touch(self, e: HostEntry, count: bool = True) -> None:
        if count:
            e.frequency += 1
        self._access += 1
        e.last_access = self._access
        self._evictor.reprice(e)

    def _slot_of(self, pkey: str) -> int | None:
        e = self._host.get(pkey)
        return e.slot if e is not None else None

    def _remove(self, e: HostEntry) -> None:
        del self._host[e.path_key]
        del self._by_slot[e.slot]
        self._evictor.forget(e)
        if e.writing:  # a writer still reads the slot: reused once the worker reports it
            self._draining.add(e.slot)
        else:
            self._free_slots.append(e.slot)
        p = self._host.get(e.parent)
        if p is not None:
            p.children -= 1
            self._evictor.offer(p)

    def _is_candidate(self, e: HostEntry) -> bool:
        return e.children == 0 and not e.pinned and not e.writing and self._host.get(e.path_key) is e
