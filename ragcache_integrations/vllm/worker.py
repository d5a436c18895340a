"""The connector's worker side: copies whole KV blocks between vLLM's paged KV and our tiers.

Runs in each vLLM worker process and does exactly what a
:class:`~ragcache_integrations.vllm.plan.StepPlan` says: before the forward pass it writes the
planned blocks into vLLM's KV tensors (from the host tier, an arena of block slots in this
process's memory, or the disk tier, a :class:`~ragcache_backend.cache.disk.DiskStore`, or the
remote tier, a :class:`~ragcache_backend.cache.remote.RemoteStore` in Redis); during it, as each
layer has written its KV (vLLM's ``save_kv_layer``), it copies that layer of the blocks the step
completes into their host slots; after it, it queues them for the disk and remote tiers (encoded
and written by the stores' own threads, which read the slots, off the step's critical path).

Layout: each layer is one tensor whose first dimension is the block id, in one of the layouts of
:class:`~ragcache_integrations.vllm.layout.BlockLayout` (vLLM's CPU backend, and on GPUs
FlashAttention, FlashInfer, Triton, FlexAttention and ROCm's split layout); blocks are copied whole
and byte for byte along that dimension. On disk and in Redis a block is stored in the tiers'
``(k, v)`` format ``[layers, block_size, kv_heads, head_size]``.

On a CPU the copies are memcpy's (numpy, which lets go of the GIL). Loads run on the calling
thread before the forward pass. Host saves run *after* it, on a thread of the worker's own
(:meth:`ConnectorWorker.save` hands them over and returns): vLLM samples the step's tokens and
sends them out meanwhile, so a miss's first token does not wait for its blocks' copies into the
host arena (3-10 ms a request for SmolLM2's ~27 blocks inside vLLM's worker). The copies only
read blocks the step completed, which nothing writes until a later forward pass; the connector
waits for them (:meth:`ConnectorWorker.settle`) when vLLM binds the next step's plan, before that
step's loads and forward pass. On a GPU they run on a CUDA stream of the
connector's own, layer by layer, so that they overlap the forward pass (RAGCache §5.2's pipelining
of KV transfer with computation; Cache-Craft eq. 16's loading schedule): :meth:`load` queues, per
layer, copies straight from the pinned host arena (one per run of consecutive slots; slots
scattered over more than :attr:`ConnectorWorker.MAX_RUNS` runs are gathered on the CPU into pinned
memory first) into a device buffer and a scatter into vLLM's block ids, each layer's followed by
an event; vLLM's ``wait_for_layer_load`` (:meth:`wait_layer`) makes the forward pass's stream wait
for that layer's event only, so layer ``i`` computes while layer ``i + 1`` is copied, and the CPU
does not wait for the GPU. Saves likewise: :meth:`save_layer` queues a gather of the layer's
completed blocks and their copies into the pinned arena slots behind the kernels that wrote them
(no synchronisation per layer), and :meth:`save` waits for them once, after the forward pass,
before handing slots to the writers.

A block that is missing, fails its checksum, or whose recorded token ids differ from the request's
is not written; its vLLM block id is reported, and vLLM recomputes it (the connector sets
``kv_load_failure_policy`` to ``recompute``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ragcache_backend.cache.disk import DiskStore, lower_thread_priority
from ragcache_backend.cache.policy import NodeStats
from ragcache_backend.cache.remote import RemoteStore

from ragcache_integrations.vllm.layout import BlockLayout, KVLayoutError
from ragcache_integrations.vllm.plan import BlockLoad, BlockSave, StepPlan

__all__ = ["ConnectorWorker", "KVLayoutError", "WorkerCounters"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerCounters:
    """Totals since start (blocks, bytes, microseconds)."""

    loaded_host: int = 0
    loaded_disk: int = 0
    loaded_remote: int = 0
    failed: int = 0
    saved_host: int = 0
    queued_disk: int = 0
    queued_remote: int = 0
    load_bytes: int = 0
    save_bytes: int = 0
    skipped_saves: int = 0
    load_us: int = 0
    save_us: int = 0


@dataclass(slots=True)
class StepResult:
    """What the worker reports after a step: vLLM block ids that failed to load, and their path keys."""

    failed_block_ids: set[int] = field(default_factory=set)
    failed_keys: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _HostCopies:
    """One plan's host saves as the worker copies them into their slots, layer by layer."""

    plan: StepPlan
    saves: list[BlockSave]
    block_ids: list[int]
    slots: list[int]
    layers_done: set[int] = field(default_factory=set)
    device_ids: torch.Tensor | None = None  # CUDA: block_ids on the device, made with the plan's first layer
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # CUDA: the slots as runs (see _runs)
    gathered: torch.Tensor | None = None  # CUDA, slots in many runs: pinned [layers, n, *block], scattered at the end


class ConnectorWorker:
    """Moves blocks for the scheduler side's plans (see the module docstring).

    The host tier is an *arena*: one tensor ``[layers, host_slots, *block_shape]`` in vLLM's block
    layout (pinned where vLLM's KV is on a GPU), allocated and paged in when the KV tensors are
    registered (a save never faults fresh pages on the step's path); the scheduler side assigns
    the slots. A slot saved for the disk or remote tier is read by their writer threads; when they
    are done with it the slot is reported (:meth:`take_written`), and only then may the scheduler
    evict it or give it to another block.

    Args:
        block_size: vLLM's tokens per block.
        disk: the disk tier (None: off).
        remote: the remote tier shared by replicas (None: off).
        host_slots: blocks the host arena holds (:func:`~ragcache_integrations.vllm.plan.host_slots`
            of the host tier's budget; 0: no host tier).
    """

    MAX_RUNS = 8  # CUDA: runs of consecutive host slots copied one by one; more: gathered on the CPU first

    def __init__(self, block_size: int, disk: DiskStore | None, remote: RemoteStore | None = None,
                 host_slots: int = 0) -> None:
        self.block_size = block_size
        self.disk = disk
        self.remote = remote
        self.host_slots = host_slots
        self.counters = WorkerCounters()
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self.layout: BlockLayout | None = None  # set by register
        self._arena: torch.Tensor | None = None  # [layers, host_slots, *block_shape]
        self._held: dict[int, tuple[str, tuple[int, ...]]] = {}  # slot -> (path key, tokens) it holds
        self._rows: list[np.ndarray] = []  # CPU: each layer as [num_blocks, block bytes] (a view, no copy)
        self._arena_rows: list[np.ndarray] = []  # CPU: each arena layer as [host_slots, block bytes]
        self._failed_reqs: set[str] = set()  # requests whose load failed in the current step
        self._copies: _HostCopies | None = None  # the current plan's host saves, layer by layer
        self._stream: torch.cuda.Stream | None = None  # CUDA: the connector's copy stream
        self._load_events: list[torch.cuda.Event | None] = []  # CUDA: per layer, its queued load copies
        self._saver: ThreadPoolExecutor | None = None  # CPU: the thread that completes a step's saves
        self._pending: Future | None = None  # CPU: the last step's saves, being completed by _saver
        self._lock = threading.Lock()  # guards the two below (writer threads call _release)
        self._reading: dict[int, int] = {}  # slot -> writers still reading it
        self._written: set[int] = set()  # slots the writers are done with

    def register(self, kv_caches: Mapping[str, torch.Tensor], layout: BlockLayout | None = None) -> None:
        """Take vLLM's per-layer KV tensors (model order); allocate the host arena (once).

        Args:
            kv_caches: layer name -> ``[num_blocks, ...]`` tensor, as vLLM registers them.
            layout: their :class:`BlockLayout` (the connector detects it against the model's heads);
                None: detected from the first tensor alone.

        Raises:
            KVLayoutError: a shape no layout has (see :meth:`BlockLayout.detect`), or the layers
                differ in shape, dtype or device.
        """
        self.settle()
        layers = list(kv_caches.values())
        if not layers:
            raise KVLayoutError("vLLM registered no KV tensors")
        shape = tuple(layers[0].shape)
        self.layout = layout or BlockLayout.detect(layers[0], self.block_size)
        if any(tuple(t.shape) != shape or t.dtype != layers[0].dtype or t.device != layers[0].device for t in layers):
            raise KVLayoutError("vLLM's KV tensors differ in shape, dtype or device between layers")
        self._layers = layers
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        arena_shape = (len(layers), self.host_slots, *shape[1:])
        if self._arena is None or tuple(self._arena.shape) != arena_shape or self._arena.dtype != layers[0].dtype:
            t0 = time.perf_counter()
            pin = layers[0].device.type == "cuda"
            self._arena = torch.zeros(arena_shape, dtype=layers[0].dtype, pin_memory=pin)  # zeroed: paged in now
            self._held.clear()
            if self.host_slots:
                log.info("ragcache connector: host arena of %d blocks (%.0f MiB%s) in %.2f s", self.host_slots,
                         self._arena.nbytes / (1 << 20), ", pinned" if pin else "", time.perf_counter() - t0)
        # On the CPU, blocks are copied as numpy rows: one memcpy per block, on the calling thread.
        # (torch's index ops open an OpenMP parallel region per call; inside vLLM's worker, whose
        # OpenMP threads are bound to the cores the forward pass uses, each such region measured
        # ~0.5-1 ms of wake-ups per layer: more than the copy itself.)
        cpu = layers[0].device.type == "cpu" and all(t.is_contiguous() for t in layers)
        self._rows = [_rows(t) for t in layers] if cpu else []
        self._arena_rows = [_rows(a) for a in self._arena] if cpu and self.host_slots else []
        cuda = layers[0].device.type == "cuda"
        self._stream = torch.cuda.Stream(layers[0].device) if cuda else None
        self._load_events = [None] * len(layers)
        if not cuda and self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="ragcache-save", initializer=_saver_setup)

    @property
    def host_keys(self) -> set[str]:
        """Path keys of the blocks the host arena holds (after the last step's saves)."""
        self.settle()
        return {pkey for pkey, _ in self._held.values()}

    @property
    def host_bytes(self) -> int:
        """Bytes of the blocks the host arena holds (after the last step's saves)."""
        self.settle()
        return len(self._held) * (self._arena[:, 0].nbytes if self._arena is not None and self.host_slots else 0)

    def settle(self) -> None:
        """Wait until the last step's saves are complete (CPU: copied into their host slots by the
        saver thread and queued for the disk and remote tiers; elsewhere they are when
        :meth:`save` returns). Call it before the next forward pass writes any KV block.

        Raises:
            Exception: whatever the saves raised (a bug: a copy of validated blocks does not fail).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def take_written(self) -> set[int]:
        """Host slots the disk and remote writers no longer read, since the last call."""
        with self._lock:
            done, self._written = self._written, set()
        return done

    # ---- before the forward pass ------------------------------------------------------------------
    def load(self, plan: StepPlan) -> StepResult:
        """Write the plan's blocks into vLLM's KV; forget the host blocks the scheduler evicted.

        Reads from the disk and remote tiers happen here, so the result (the blocks that failed)
        is final when this returns. On CUDA the copies are queued on the connector's stream and
        layer ``i`` is written for the forward pass's stream once it has called :meth:`wait_layer`
        ``(i)`` (vLLM's ``wait_for_layer_load``); elsewhere the blocks are written when it returns.
        """
        self.settle()  # the connector did already (bind); a direct caller may not have
        self._load_events = [None] * len(self._layers)  # the last plan's loads were waited for by its save()
        dropped = set(plan.host_drops)
        if dropped:
            self._held = {slot: held for slot, held in self._held.items() if held[0] not in dropped}
        result = StepResult()
        self._failed_reqs = set()
        self._copies = None
        if not plan.loads:
            return result
        t0 = time.perf_counter()
        slot_ids, slots, ids, blocks = [], [], [], []
        read = self._read_all([ld for ld in plan.loads if ld.tier != "host"])
        for load in plan.loads:
            if load.tier == "host" and load.slot is not None and self._held.get(load.slot) == (load.path_key, load.tokens):
                slot_ids.append(load.block_id)
                slots.append(load.slot)
                self.counters.loaded_host += 1
                continue
            block = read.get(load.block_id)
            if block is None:
                result.failed_block_ids.add(load.block_id)
                result.failed_keys.add(load.path_key)
                self._failed_reqs.add(load.req_id)
                self.counters.failed += 1
                continue
            ids.append(load.block_id)
            blocks.append(block)
        if self._stream is not None:
            self._load_async(slot_ids, slots, ids, blocks)
            self.counters.load_us += int((time.perf_counter() - t0) * 1e6)
            return result
        if slots:
            for i in range(len(self._layers)):
                self._copy_blocks(self._layers[i], slot_ids, self._arena[i], slots, i, from_arena=True)
            self.counters.load_bytes += len(slots) * self._arena[:, 0].nbytes
        if ids:
            stacked = torch.stack(blocks, dim=1)  # [layers, n, *block_shape]
            for i, layer in enumerate(self._layers):
                if self._rows:
                    self._rows[i][ids] = _rows(stacked[i])
                else:
                    layer.index_copy_(0, torch.tensor(ids, device=layer.device), stacked[i].to(layer.device))
            self.counters.load_bytes += stacked.nbytes
        self.counters.load_us += int((time.perf_counter() - t0) * 1e6)
        return result

    def _load_async(self, slot_ids: list[int], slots: list[int], ids: list[int], blocks: list[torch.Tensor]) -> None:
        """CUDA: per layer, the blocks copied into a device buffer, then scattered into vLLM's block
        ids, all on the connector's stream, each layer's followed by an event for :meth:`wait_layer`.
        Host-tier blocks are copied straight from the pinned arena, one copy per run of consecutive
        slots; when the slots fall in more than :attr:`MAX_RUNS` runs (copies too small and many to
        launch), they are gathered on the CPU into one pinned buffer instead, as are the blocks read
        from the disk or remote tier (already in this process's memory)."""
        first = self._layers[0]
        runs = _runs(slots)
        gather = len(runs) > self.MAX_RUNS
        n_host = len(slots) if gather else 0
        host = None  # [layers, n, *block_shape] pinned: gathered slots, then the blocks read
        if gather or blocks:
            host = torch.empty((len(self._layers), n_host + len(blocks), *first.shape[1:]), dtype=first.dtype,
                               pin_memory=True)
            if gather:
                where = torch.tensor(slots, dtype=torch.long)
                for i in range(len(self._layers)):
                    torch.index_select(self._arena[i], 0, where, out=host[i, :n_host])
            if blocks:
                torch.stack(blocks, dim=1, out=host[:, n_host:])
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(first.device))  # after the kernels already queued
        with torch.cuda.stream(stream):
            index = _device_ids(slot_ids + ids, first.device)
            staging = torch.empty((len(index), *first.shape[1:]), dtype=first.dtype, device=first.device)
            at_host = 0 if gather else len(slots)  # where host's blocks go in staging
            for i, layer in enumerate(self._layers):  # one buffer: the stream orders its reuse by layer
                if not gather:
                    for slot, at, n in runs:
                        staging[at:at + n].copy_(self._arena[i, slot:slot + n], non_blocking=True)
                if host is not None:
                    staging[at_host:].copy_(host[i], non_blocking=True)
                layer.index_copy_(0, index, staging)
                event = torch.cuda.Event()
                event.record(stream)
                self._load_events[i] = event
        self.counters.load_bytes += staging.nbytes * len(self._layers)
        # ``host`` and ``staging`` are freed here; torch's allocators keep them until the copies end

    def wait_layer(self, i: int) -> None:
        """vLLM's ``wait_for_layer_load``: the current CUDA stream waits for layer ``i``'s queued load
        copies of this plan (the CPU does not wait). No-op off CUDA, or when nothing was queued for
        the layer."""
        event = self._load_events[i] if 0 <= i < len(self._load_events) else None
        if event is not None:  # kept until the next plan: another stream may wait for it too
            torch.cuda.current_stream(self._layers[i].device).wait_event(event)

    def wait_loads(self) -> None:
        """:meth:`wait_layer` for every layer (a layer the forward pass did not wait for, say)."""
        for i in range(len(self._load_events)):
            self.wait_layer(i)

    def layer_index(self, layer_name: str) -> int | None:
        """The position of vLLM's layer ``layer_name`` among the registered KV tensors (None: not one of them)."""
        return self._layer_index.get(layer_name)

    def _read_all(self, loads: list[BlockLoad]) -> dict[int, torch.Tensor]:
        """The blocks of ``loads`` (disk and remote tier) that are there and pass their checks, by vLLM
        block id, each ``[layers, *block_shape]``: the disk tier's files read several at once
        (:meth:`DiskStore.load_many`), the remote tier's entries one after another."""
        out: dict[int, torch.Tensor] = {}
        disk = []  # (load, its entry): files that exist and record the request's tokens
        for ld in loads:
            entry = self.disk.lookup(ld.path_key) if ld.tier == "disk" and self.disk is not None else None
            if entry is not None and entry.tokens == ld.tokens:
                disk.append((ld, entry))
        if disk:
            for (ld, _), kv in zip(disk, self.disk.load_many([e for _, e in disk])):
                if kv is not None:
                    out[ld.block_id] = self.layout.from_kv(*kv)
                    self.counters.loaded_disk += 1
        for ld in loads:  # one GET each: a batched read (MGET) measured slower inside vLLM's worker
            if ld.tier == "remote" and self.remote is not None:
                kv = self.remote.get(ld.path_key, ld.tokens)
                if kv is not None:
                    out[ld.block_id] = self.layout.from_kv(*kv)
                    self.counters.loaded_remote += 1
        return out

    # ---- during and after the forward pass ------------------------------------------------------
    def save_layer(self, plan: StepPlan, layer_name: str) -> None:
        """Copy one layer's part of the plan's host saves into their slots, right after the layer
        wrote its KV (vLLM's ``save_kv_layer``); :meth:`save` copies the layers this missed."""
        i = self._layer_index.get(layer_name)
        if i is None or not self.host_slots or self._saver is not None:  # CPU: save() hands all layers to the saver
            return
        self.wait_layer(i)  # the layer's loads before its saves (vLLM waited for it already)
        copies = self._host_copies(plan)
        if i in copies.layers_done:
            return
        t0 = time.perf_counter()
        self._copy_to_slots(i, copies)
        self.counters.save_us += int((time.perf_counter() - t0) * 1e6)

    def save(self, plan: StepPlan) -> None:
        """Finish the step's saves (after the forward pass): copy the host saves' remaining layers
        into their slots, then queue blocks for the disk and remote tiers (read by their writer
        threads from the slots, or from a copy for blocks the host tier did not admit). Nothing of
        a request whose load failed in this step (its forward pass read unwritten KV) is saved.

        On a CPU this hands the work to the saver thread and returns; :meth:`settle` waits for it.
        """
        self.settle()
        self.wait_loads()  # a layer whose load the forward pass never waited for: later steps must see it
        saves = [s for s in plan.saves if s.req_id not in self._failed_reqs]
        skipped = [s for s in plan.saves if s.req_id in self._failed_reqs]
        self.counters.skipped_saves += len(skipped)
        for s in skipped:
            self._forget_slot(s)
        if not saves:
            self._copies = None
            return
        copies = self._host_copies(plan)
        self._copies = None
        if self._saver is not None:
            self._pending = self._saver.submit(self._complete_saves, copies, saves)
        else:
            self._complete_saves(copies, saves)

    def _complete_saves(self, copies: _HostCopies, saves: list[BlockSave]) -> None:
        """The rest of :meth:`save` (on the saver thread on a CPU): host copies, then writer queues."""
        t0 = time.perf_counter()
        for i in range(len(self._layers)):
            if i not in copies.layers_done:
                self._copy_to_slots(i, copies)
        self._finish_host_copies(copies)
        host = copies.saves
        in_slot = {s.path_key for s in host}
        for s in saves:
            if s.path_key in in_slot:
                self._held[s.slot] = (s.path_key, s.tokens)
                self.counters.saved_host += 1
                self.counters.save_bytes += self._arena[:, s.slot].nbytes
            elif s.slot is not None:
                self._forget_slot(s)  # a slot the arena does not have: nothing kept
        rest = [s for s in saves if s.path_key not in in_slot and self._queues(s)]
        copies = self._gather_blocks([s.block_id for s in rest]) if rest else None
        for j, s in enumerate(rest):
            self._queue_writes(s, copies[:, j], released=False)
        for s in host:
            if self._queues(s):
                self._queue_writes(s, self._arena[:, s.slot], released=True)
            elif s.to_disk or s.to_remote:
                self._release(s.slot)  # a write the scheduler expected but no tier here takes
        self.counters.save_us += int((time.perf_counter() - t0) * 1e6)

    def close(self) -> None:
        """Complete the last step's saves, finish queued disk and remote writes (bounded wait) and
        stop the writers and the saver thread."""
        self.settle()
        if self._saver is not None:
            self._saver.shutdown()
            self._saver = None
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()

    # ---- internals ----------------------------------------------------------------------------------
    def _host_copies(self, plan: StepPlan) -> _HostCopies:
        """The plan's host saves (once per plan, not once per layer): blocks with a slot the arena
        has, of requests whose loads did not fail."""
        if self._copies is None or self._copies.plan is not plan:
            saves = [s for s in plan.saves if s.slot is not None and 0 <= s.slot < self.host_slots
                     and s.req_id not in self._failed_reqs]
            self._copies = _HostCopies(plan, saves, [s.block_id for s in saves], [s.slot for s in saves])
        return self._copies

    def _copy_to_slots(self, i: int, copies: _HostCopies) -> None:
        if copies.saves and self._stream is not None:
            self._save_layer_async(i, copies)
        elif copies.saves:
            self._copy_blocks(self._layers[i], copies.block_ids, self._arena[i], copies.slots, i, from_arena=False)
        copies.layers_done.add(i)

    def _save_layer_async(self, i: int, copies: _HostCopies) -> None:
        """CUDA: layer ``i``'s saved blocks gathered on the device and copied into their pinned arena
        slots (one copy per run of consecutive slots; into one pinned buffer, scattered by
        :meth:`_finish_host_copies`, when the slots fall in more than :attr:`MAX_RUNS` runs) on the
        connector's stream, behind the kernels the forward pass has queued so far (those that
        wrote the layer's KV)."""
        layer = self._layers[i]
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(layer.device))
        with torch.cuda.stream(stream):
            if copies.device_ids is None:  # the plan's first layer
                copies.device_ids = _device_ids(copies.block_ids, layer.device)
                copies.runs = _runs(copies.slots)
                if len(copies.runs) > self.MAX_RUNS:
                    copies.gathered = torch.empty((len(self._layers), len(copies.slots), *layer.shape[1:]),
                                                  dtype=layer.dtype, pin_memory=True)
            gathered = layer.index_select(0, copies.device_ids)
            if copies.gathered is not None:
                copies.gathered[i].copy_(gathered, non_blocking=True)
                return
            for slot, at, n in copies.runs:
                self._arena[i, slot:slot + n].copy_(gathered[at:at + n], non_blocking=True)

    def _finish_host_copies(self, copies: _HostCopies) -> None:
        """CUDA: wait (once per step, after the forward pass) for the plan's queued save copies
        (then scatter gathered blocks into their slots)."""
        if self._stream is None or not copies.saves:
            return
        self._stream.synchronize()
        if copies.gathered is not None:
            self._arena.index_copy_(1, torch.tensor(copies.slots, dtype=torch.long), copies.gathered)
            copies.gathered = None

    def _copy_blocks(self, layer: torch.Tensor, block_ids: list[int], arena: torch.Tensor, slots: list[int], i: int,
                     *, from_arena: bool) -> None:
        """Layer ``i``: ``layer[block_ids] = arena[slots]`` (``from_arena``) or ``arena[slots] = layer[block_ids]``."""
        if self._rows:
            if from_arena:
                self._rows[i][block_ids] = self._arena_rows[i][slots]
            else:
                self._arena_rows[i][slots] = self._rows[i][block_ids]
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=layer.device)
        where = torch.tensor(slots, dtype=torch.long)
        if from_arena:
            layer.index_copy_(0, index, arena.index_select(0, where).to(layer.device, non_blocking=True))
        else:
            arena.index_copy_(0, where, layer.index_select(0, index).cpu())

    def _gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A fresh ``[layers, n, *block_shape]`` CPU copy of vLLM's blocks."""
        first = self._layers[0]
        out = torch.empty((len(self._layers), len(block_ids), *first.shape[1:]), dtype=first.dtype,
                          pin_memory=self._stream is not None)
        if self._stream is not None:  # CUDA: queued on the connector's stream, one wait for all layers
            self._stream.wait_stream(torch.cuda.current_stream(first.device))
            with torch.cuda.stream(self._stream):
                index = _device_ids(block_ids, first.device)
                for i, layer in enumerate(self._layers):
                    out[i].copy_(layer.index_select(0, index), non_blocking=True)
            self._stream.synchronize()
        else:
            for i, layer in enumerate(self._layers):
                if self._rows:
                    _rows(out[i])[:] = self._rows[i][block_ids]
                else:
                    out[i].copy_(layer.index_select(0, torch.tensor(block_ids, device=layer.device)))
        self.counters.save_bytes += out.nbytes
        return out

    def _queues(self, s: BlockSave) -> bool:
        return (s.to_disk and self.disk is not None) or (s.to_remote and self.remote is not None)

    def _queue_writes(self, s: BlockSave, block: torch.Tensor, *, released: bool) -> None:
        """Queue ``block`` (``[layers, *block_shape]``) for the disk and remote tiers; when it
        is the save's slot (``released``), report the slot once every writer is done reading it."""
        done = functools.partial(self._release, s.slot) if released else None
        if released:
            self._hold(s.slot)  # a guard: a fast writer must not report the slot before both are queued
        k, v = self.layout.to_kv(block)
        if s.to_disk and self.disk is not None:
            if released:
                self._hold(s.slot)
            if self.disk.put(s.path_key, s.parent, s.segment, k, v, NodeStats(1, s.avg_cost, len(s.tokens), 0),
                             tokens=s.tokens, done_reading=done):
                self.counters.queued_disk += 1
            elif released:
                self._release(s.slot)
        if s.to_remote and self.remote is not None:
            if released:
                self._hold(s.slot)
            if self.remote.put(s.path_key, s.parent, s.segment, k, v, s.tokens, s.avg_cost, done_reading=done):
                self.counters.queued_remote += 1
            elif released:
                self._release(s.slot)
        if released:
            self._release(s.slot)

    def _hold(self, slot: int) -> None:
        with self._lock:
            self._reading[slot] = self._reading.get(slot, 0) + 1

    def _release(self, slot: int) -> None:
        with self._lock:
            left = self._reading.get(slot, 0) - 1
            if left > 0:
                self._reading[slot] = left
                return
            self._reading.pop(slot, None)
            self._written.add(slot)

    def _forget_slot(self, s: BlockSave) -> None:
        """A host save that did not happen: its slot holds nothing, and a write the scheduler is
        waiting for will not come."""
        if s.slot is not None:
            self._held.pop(s.slot, None)
            if s.to_disk or s.to_remote:
                self._release(s.slot)


def _saver_setup() -> None:
    """The saver thread's initializer. It may run on every core the machine has: a thread inherits
    its creator's CPU mask, and vLLM's CPU worker binds its main thread to one core (that of
    OpenMP thread 0). And it runs at nice 10 (as the disk and Redis writers): right after a step,
    vLLM's API server process still has to send the step's tokens, and on two cores an
    equal-priority copy delayed them (a miss's TTFT, after traffic with Redis on, three servers up:
    +5.4% and +5.1% against +1.7% and +4.1% with the saver niced, two runs, the order swapped;
    docs/benchmarks.md). The connector waits for the saver before the next
    forward pass anyway, so it never falls behind by more than a step."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # not Linux, or a cpuset narrower than the machine: keep the mask
        pass
    lower_thread_priority()
    log.debug("ragcache connector: host saves run on CPUs %s", sorted(os.sched_getaffinity(0))
              if hasattr(os, "sched_getaffinity") else "any")


def _device_ids(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 tensor on ``device``, copied from pinned memory without waiting (allocated
    on the current stream: call it inside the stream that uses it)."""
    return torch.tensor(ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive slots: ``(first slot, position in slots, length)`` each."""
    runs: list[tuple[int, int, int]] = []
    for at, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((slot, at, 1))
    return runs


def _rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor ``[n, ...]`` as a numpy byte array ``[n, bytes per row]`` sharing its memory."""
    if not t.is_contiguous():
        raise KVLayoutError("a block copy needs contiguous tensors")  # a reshape would copy: writes would be lost
    return t.view(torch.uint8).numpy().reshape(t.shape[0], -1)
