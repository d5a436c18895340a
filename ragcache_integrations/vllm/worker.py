"""The connector's worker side: copies whole KV blocks between vLLM's paged KV and our tiers.

Runs in each vLLM worker process and does exactly what a
:class:`~ragcache_integrations.vllm.plan.StepPlan` says: before the forward pass it writes the
planned blocks into vLLM's KV tensors (from the host tier, a dict in this process's memory, or
the disk tier, a :class:`~ragcache_backend.cache.disk.DiskStore`, or the remote tier, a
:class:`~ragcache_backend.cache.remote.RemoteStore` in Redis); after it, it copies the blocks the
step completed into the host tier and queues them for the disk and remote tiers (written by the
stores' own threads, off the step's critical path).

Layout: vLLM's CPU attention keeps each layer as one tensor ``[num_blocks, kv_heads, block_size,
2 * head_size]`` (K and V packed inside a block in an order that depends on the CPU's ISA), so
blocks are copied whole and byte for byte, and the ISA is part of the fingerprint that names the
disk folder. On disk a block is stored in the tier's ``(k, v)`` format ``[layers, block_size,
kv_heads, head_size]``: the first and second halves of each head's packed block.

A block that is missing, fails its checksum, or whose recorded token ids differ from the request's
is not written; its vLLM block id is reported, and vLLM recomputes it (the connector sets
``kv_load_failure_policy`` to ``recompute``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ragcache_backend.cache.disk import DiskStore
from ragcache_backend.cache.policy import NodeStats
from ragcache_backend.cache.remote import RemoteStore
from ragcache_backend.errors import RAGCacheError

from ragcache_integrations.vllm.plan import BlockLoad, StepPlan

__all__ = ["ConnectorWorker", "KVLayoutError", "WorkerCounters"]

log = logging.getLogger(__name__)


class KVLayoutError(RAGCacheError):
    """vLLM's KV tensors have a layout the connector does not copy yet."""


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


class ConnectorWorker:
    """Moves blocks for the scheduler side's plans (see the module docstring).

    Args:
        block_size: vLLM's tokens per block.
        disk: the disk tier (None: off).
        remote: the remote tier shared by replicas (None: off).
    """

    def __init__(self, block_size: int, disk: DiskStore | None, remote: RemoteStore | None = None) -> None:
        self.block_size = block_size
        self.disk = disk
        self.remote = remote
        self.counters = WorkerCounters()
        self._layers: list[torch.Tensor] = []
        self._host: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._failed_reqs: set[str] = set()  # requests whose load failed in the current step

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer KV tensors (model order).

        Raises:
            KVLayoutError: a tensor is not ``[num_blocks, kv_heads, block_size, 2 * head_size]``
                (the CPU layout; GPU layouts are not copied yet), or the layers differ in shape.
        """
        layers = list(kv_caches.values())
        if not layers:
            raise KVLayoutError("vLLM registered no KV tensors")
        shape = tuple(layers[0].shape)
        if len(shape) != 4 or shape[2] != self.block_size or shape[3] % 2:
            raise KVLayoutError(f"KV tensor of shape {shape}: the ragcache connector copies the CPU layout "
                                f"[num_blocks, kv_heads, block_size={self.block_size}, 2*head_size] only so far")
        if any(tuple(t.shape) != shape or t.dtype != layers[0].dtype for t in layers):
            raise KVLayoutError("vLLM's KV tensors differ in shape or dtype between layers")
        self._layers = layers

    @property
    def host_keys(self) -> set[str]:
        return set(self._host)

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for _, t in self._host.values())

    # ---- before the forward pass ------------------------------------------------------------------
    def load(self, plan: StepPlan) -> StepResult:
        """Write the plan's blocks into vLLM's KV; drop the host blocks the scheduler evicted."""
        for pkey in plan.host_drops:
            self._host.pop(pkey, None)
        result = StepResult()
        self._failed_reqs = set()
        if not plan.loads:
            return result
        t0 = time.perf_counter()
        ids, blocks = [], []
        for load in plan.loads:
            block = self._read(load)
            if block is None:
                result.failed_block_ids.add(load.block_id)
                result.failed_keys.add(load.path_key)
                self._failed_reqs.add(load.req_id)
                self.counters.failed += 1
                continue
            ids.append(load.block_id)
            blocks.append(block)
        if ids:
            index = torch.tensor(ids, dtype=torch.long, device=self._layers[0].device)
            stacked = torch.stack(blocks, dim=1)  # [layers, n, kv_heads, block_size, 2*head_size]
            for layer, kv in zip(self._layers, stacked):
                layer.index_copy_(0, index, kv.to(layer.device, non_blocking=True))
            self.counters.load_bytes += stacked.nbytes
        self.counters.load_us += int((time.perf_counter() - t0) * 1e6)
        return result

    def _read(self, load: BlockLoad) -> torch.Tensor | None:
        if load.tier == "host":
            held = self._host.get(load.path_key)
            if held is not None and held[0] == load.tokens:
                self.counters.loaded_host += 1
                return held[1]
        if load.tier == "remote":
            if self.remote is None:
                return None
            kv = self.remote.get(load.path_key, load.tokens)
            if kv is None:
                return None
            self.counters.loaded_remote += 1
            return _from_disk(*kv)
        if self.disk is None:
            return None
        entry = self.disk.lookup(load.path_key)
        if entry is None or entry.tokens != load.tokens:
            return None
        kv = self.disk.load(entry)
        if kv is None:
            return None
        self.counters.loaded_disk += 1
        return _from_disk(*kv)

    # ---- after the forward pass -------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        """Copy the blocks the step completed into the host tier and queue them for the disk tier;
        nothing of a request whose load failed in this step (its forward pass read unwritten KV)."""
        saves = [s for s in plan.saves if s.req_id not in self._failed_reqs]
        self.counters.skipped_saves += len(plan.saves) - len(saves)
        plan = StepPlan(saves=saves)
        if not plan.saves:
            return
        t0 = time.perf_counter()
        index = torch.tensor([s.block_id for s in plan.saves], dtype=torch.long, device=self._layers[0].device)
        first = self._layers[0]
        stacked = torch.empty((len(self._layers), len(index), *first.shape[1:]), dtype=first.dtype)
        for i, layer in enumerate(self._layers):  # the one copy on the step's path
            if layer.device.type == "cpu":
                torch.index_select(layer, 0, index, out=stacked[i])
            else:
                stacked[i].copy_(layer.index_select(0, index))
        shared = all(s.to_host for s in plan.saves)  # every block is kept: views of one buffer
        for j, s in enumerate(plan.saves):
            block = stacked[:, j] if shared else stacked[:, j].clone()  # [layers, kv_heads, block_size, 2*head_size]
            if s.to_host:
                self._host[s.path_key] = (s.tokens, block)
                self.counters.saved_host += 1
            if (s.to_disk and self.disk is not None) or (s.to_remote and self.remote is not None):
                k, v = _to_disk(block)
                if s.to_disk and self.disk is not None and self.disk.put(
                        s.path_key, s.parent, s.segment, k, v, NodeStats(1, s.avg_cost, len(s.tokens), 0),
                        tokens=s.tokens):
                    self.counters.queued_disk += 1
                if s.to_remote and self.remote is not None and self.remote.put(
                        s.path_key, s.parent, s.segment, k, v, s.tokens, s.avg_cost):
                    self.counters.queued_remote += 1
        self.counters.save_bytes += stacked.nbytes
        self.counters.save_us += int((time.perf_counter() - t0) * 1e6)

    def close(self) -> None:
        """Finish queued disk and remote writes (bounded wait) and stop the writers."""
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()


def _to_disk(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, kv_heads, bs, 2*hs]`` -> ``(k, v)`` ``[layers, bs, kv_heads, hs]`` (byte-exact halves),
    as views: the disk and remote writers make them contiguous in their own threads."""
    layers, heads, bs, two_hs = block.shape
    halves = block.reshape(layers, heads, 2, bs, two_hs // 2)  # a view: each head's block is contiguous
    return halves[:, :, 0].permute(0, 2, 1, 3), halves[:, :, 1].permute(0, 2, 1, 3)


def _from_disk(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_disk`."""
    layers, bs, heads, hs = k.shape
    both = torch.stack([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)], dim=2)  # [layers, heads, 2, bs, hs]
    return both.reshape(layers, heads, bs, 2 * hs)


def disk_layout(block_shape: tuple[int, ...], num_layers: int) -> tuple[int, int, int]:
    """The disk tier's ``(layers, kv_heads, head_dim)`` for vLLM blocks ``[kv_heads, bs, 2*hs]``."""
    return (num_layers, int(block_shape[0]), int(block_shape[2]) // 2)
