"""``RAGCacheConnector``: ragcache's tiers as vLLM's KV cache, through vLLM's v1 KV connector API.

Load it into vLLM (``vllm serve``, ``LLM(...)``) with::

    --kv-transfer-config '{"kv_connector": "RAGCacheConnector",
                           "kv_connector_module_path": "ragcache_integrations.vllm",
                           "kv_role": "kv_both"}'

vLLM keeps its own device prefix cache; what it evicts or never had (after a restart) comes back
from our host tier (PGDSF-managed, in the worker's memory) and disk tier (checksummed files under
``$RAGCACHE_HOME/kv``), block by block. Settings: :mod:`ragcache_integrations.vllm.settings`.

The class adapts vLLM's objects to plain data and delegates: the scheduler side
(:class:`~ragcache_integrations.vllm.scheduler.ConnectorScheduler`, in vLLM's EngineCore process)
decides, the worker side (:class:`~ragcache_integrations.vllm.worker.ConnectorWorker`, in each
worker process) copies blocks. On a CPU, loads are written before the step's forward pass; on a
GPU they are queued on the connector's CUDA stream layer by layer and each layer's attention waits
for its own layer only (``wait_for_layer_load``). Saves go into the host tier's preallocated
slots: on a GPU queued on the same stream layer by layer as the forward pass writes them, waited
for once after it; on a CPU copied after the forward pass by a thread of the worker's own while
vLLM samples and sends the step's tokens, and waited for when the next step's plan is bound
(``bind_connector_metadata``), before that step writes any block. The disk and Redis tiers encode
and write them on background threads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ragcache_backend.cache.disk import DiskStore, store_folder
from ragcache_backend.cache.remote import RemoteStore
from ragcache_backend.config import MiB
from ragcache_integrations.vllm import SUPPORTED_VLLM
from ragcache_integrations.vllm.cost import StepSample
from ragcache_integrations.vllm.plan import StepPlan, host_slots
from ragcache_integrations.vllm.scheduler import ConnectorScheduler, RequestView, ScheduledRequest
from ragcache_integrations.vllm.settings import ConnectorSettings, check_world_size, settings_from_extra_config
from ragcache_integrations.vllm.layout import BlockLayout
from ragcache_integrations.vllm.worker import ConnectorWorker

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["RAGCacheConnector", "RAGCacheConnectorMetadata", "RAGCacheConnectorStats", "UnsupportedVllmError"]

log = logging.getLogger("ragcache_integrations.vllm")


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a version the connector supports (raised when vLLM starts it)."""


@dataclass
class RAGCacheConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> worker (pickled between the processes)."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class RAGCacheWorkerReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler: path keys of blocks that failed to load (the index forgets them), host
    slots the disk and remote writers are done reading (their blocks may be evicted), and the steps'
    timed forward passes (PGDSF's block cost)."""

    failed_keys: set[str] = field(default_factory=set)
    written_slots: set[int] = field(default_factory=set)
    steps: list[StepSample] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, RAGCacheWorkerReport):
            return RAGCacheWorkerReport(self.failed_keys | other.failed_keys, self.written_slots | other.written_slots,
                                        self.steps + other.steps)
        return self


STAT_KEYS = ("lookups", "hit_tokens_host", "hit_tokens_disk", "hit_tokens_remote", "saved_blocks", "host_evictions",
             "failed_blocks", "loaded_host", "loaded_disk", "loaded_remote", "failed", "saved_host", "queued_disk",
             "queued_remote", "skipped_saves", "load_bytes", "save_bytes", "load_us", "save_us")


@dataclass
class RAGCacheConnectorStats(KVConnectorStats):
    """Counter deltas since the last report (tokens, blocks, bytes, microseconds), summed across processes.

    Keys: ``lookups``, ``hit_tokens_host``, ``hit_tokens_disk``, ``hit_tokens_remote`` (tokens our
    tiers served), ``saved_blocks``, ``host_evictions``, ``failed_blocks`` (scheduler side);
    ``loaded_host``, ``loaded_disk``, ``loaded_remote``, ``failed``, ``saved_host``, ``queued_disk``,
    ``queued_remote``, ``skipped_saves`` (blocks), ``load_bytes``,
    ``save_bytes``, ``load_us``, ``save_us`` (worker side; microseconds)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class RAGCachePromMetrics(KVConnectorPromMetrics):
    """Prometheus counters ``vllm:ragcache_<key>_total`` for every key of :class:`RAGCacheConnectorStats`."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: {idx: self._counter_cls(name=f"vllm:ragcache_{key}", documentation=f"ragcache connector: {key}",
                                         labelnames=labelnames).labels(*values)
                  for idx, values in per_engine_labelvalues.items()}
            for key in STAT_KEYS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and engine_idx in per_engine and value:
                per_engine[engine_idx].inc(value)


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedVllmError` unless ``version``'s major.minor is supported."""
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise UnsupportedVllmError(f"RAGCacheConnector supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}; "
                                   f"this is vLLM {version}. Install a supported vLLM or remove --kv-transfer-config.")


def model_fingerprint(vllm_config: VllmConfig, block_size: int) -> str:
    """What a block's KV depends on besides its tokens: model, its config and weight files, KV dtype,
    block size, device kind and CPU ISA (vLLM packs CPU blocks per ISA), vLLM's version."""
    mc = vllm_config.model_config
    digest = hashlib.sha256()
    parts: dict[str, Any] = {
        "model": str(mc.model), "revision": mc.revision, "dtype": str(mc.dtype),
        "kv_dtype": str(vllm_config.cache_config.cache_dtype), "block_size": block_size,
        "vllm": vllm.__version__, "device": str(vllm_config.device_config.device_type),
        "isa": torch.backends.cpu.get_cpu_capability(), "amx": _has_amx(),
    }
    try:
        parts["hf_config"] = mc.hf_config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - a config that does not serialise is identified by name only
        parts["hf_config"] = ""
    folder = Path(str(mc.model))
    if folder.is_dir():
        parts["weights"] = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime))
                                  for p in folder.glob("*.safetensors"))
    digest.update(json.dumps(parts, sort_keys=True, default=str).encode())
    name = Path(str(mc.model)).name or "model"
    return f"vllm-{name}-{digest.hexdigest()[:16]}"


def share_vllm_logging() -> None:
    """Send ragcache's log lines (the connector's, the tiers') through vLLM's handlers, at vLLM's
    level: vLLM configures only its own ``vllm`` logger, so they would otherwise go unseen below
    WARNING. Loggers that already have handlers (set up by the user) are left alone."""
    source = logging.getLogger("vllm")
    for name in ("ragcache_integrations", "ragcache_backend"):
        logger = logging.getLogger(name)
        if not logger.handlers and source.handlers:
            logger.handlers = list(source.handlers)
            logger.setLevel(source.level)
            logger.propagate = False


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


class RAGCacheConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over ragcache's host and disk tiers (see the module docstring).

    Raises (when vLLM creates it):
        UnsupportedVllmError: an unsupported vLLM version.
        InvalidRequestError: a bad ``kv_connector_extra_config`` key or value, or more than one
            worker (tensor or pipeline parallelism).
        KVLayoutError: (worker) vLLM's KV tensors are in none of the layouts of
            :class:`~ragcache_integrations.vllm.layout.BlockLayout`, or not of the model's heads.
    """

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        check_version(vllm.__version__)
        share_vllm_logging()
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings: ConnectorSettings = settings_from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.fingerprint = model_fingerprint(vllm_config, self.block_size)
        mc = vllm_config.model_config
        pc = vllm_config.parallel_config
        check_world_size(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self._layout = (mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size())  # as the disk tier's
        self._kv_dtype = mc.dtype if vllm_config.cache_config.cache_dtype == "auto" else torch.uint8
        layers, kv_heads, head_size = self._layout
        self.block_bytes = 2 * kv_heads * head_size * self.block_size * self._kv_dtype.itemsize * layers
        disk_folder = store_folder(self.settings.disk_dir, self.fingerprint) if self.settings.disk_enabled else None
        self._sched: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._remote: RemoteStore | None = None
        self._last: dict[str, float] = {}
        self._failed: set[int] = set()
        self._forward_t0: float | None = None
        self._report = RAGCacheWorkerReport()
        self._requests: dict[str, Request] = {}
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.info("ragcache connector: kv_load_failure_policy set to 'recompute' (a block that fails its "
                         "checks is recomputed, never an error to the client)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self._remote = self._open_remote()
            self._sched = ConnectorScheduler(self.block_size, self.block_bytes, self.settings.host_bytes,
                                             disk_folder, self.settings.policy,
                                             self._remote.exists if self._remote is not None else None)
            log.info("ragcache connector (scheduler): block %d tokens, %d bytes; host tier %d MiB; disk tier %s; "
                     "remote tier %s", self.block_size, self.block_bytes, self.settings.host_mib,
                     f"{self.settings.disk_budget_mib} MiB in {disk_folder}" if disk_folder else "off",
                     self.settings.remote_url or "off")

    def _open_remote(self) -> RemoteStore | None:
        if not self.settings.remote_url:
            return None
        return RemoteStore(self.settings.remote_url, self.fingerprint, self._layout, self._kv_dtype)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: nothing waits for a hand-off

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        _, kv_heads, head_size = self._layout
        layout = BlockLayout.detect(first, self.block_size, kv_heads=kv_heads, head_size=head_size)
        disk = None
        if self.settings.disk_enabled:
            disk = DiskStore(self.settings.disk_dir, self.fingerprint, layout.disk_layout(len(kv_caches)),
                             first.dtype, self.settings.disk_budget_mib * MiB, policy=self.settings.policy)
        self._remote = self._open_remote()
        self._worker = ConnectorWorker(self.block_size, disk, self._remote,
                                       host_slots(self.settings.host_bytes, self.block_bytes))
        self._worker.register(kv_caches, layout)
        log.info("ragcache connector (worker): %d layers of %s %s on %s (%s layout); disk tier %s", len(kv_caches),
                 tuple(first.shape), first.dtype, first.device, layout.kind, disk.directory if disk else "off")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds each step's plan before the step's forward pass (start_load_kv comes after the
        # forward pass in steps without synchronous loads): the last step's saves complete here,
        # before this step writes any KV block, and the forward pass is timed from here
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.settle()
        self._forward_t0 = time.perf_counter()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RAGCacheConnectorMetadata)
        result = self._worker.load(meta.plan)
        self._failed |= result.failed_block_ids
        self._report.failed_keys |= result.failed_keys
        if meta.plan.loads:  # a step with loads is one with synchronous loads: its forward pass starts now
            self._forward_t0 = time.perf_counter()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # CPU: the loads were written by start_load_kv; GPU: this layer's copies, queued on the
        # connector's stream, come before the layer's attention (the CPU does not wait)
        if self._worker is not None:
            i = self._worker.layer_index(layer_name)
            if i is not None:
                self._worker.wait_layer(i)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RAGCacheConnectorMetadata)
        if meta.plan.saves:
            self._worker.save_layer(meta.plan, layer_name)

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RAGCacheConnectorMetadata)
        if self._forward_t0 is not None and meta.plan.new_tokens:
            self._report.steps.append(StepSample(time.perf_counter() - self._forward_t0, meta.plan.new_tokens,
                                                 meta.plan.attended))
        self._forward_t0 = None
        self._worker.save(meta.plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is not None:
            self._report.written_slots |= self._worker.take_written()
        if not (self._report.failed_keys or self._report.written_slots or self._report.steps):
            return None
        report, self._report = self._report, RAGCacheWorkerReport()
        return report

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        part = self._sched if self._sched is not None else self._worker
        if part is None:
            return None
        now = asdict(part.counters)
        delta = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        stats = RAGCacheConnectorStats(data={k: v for k, v in delta.items() if v})
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.match(_view(request), num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        scheduled = []
        manager = self._kv_cache_manager
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or manager is None or n <= 0:
                continue
            (block_ids,) = manager.get_block_ids(req_id)[:1]
            scheduled.append(ScheduledRequest(_view(request), request.num_computed_tokens, n, block_ids))
        return RAGCacheConnectorMetadata(self._sched.plan(scheduled))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if self._sched is not None and isinstance(report, RAGCacheWorkerReport):
            self._sched.failed(report.failed_keys)
            self._sched.written(report.written_slots)
            self._sched.timed(report.steps)

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        if self._sched is not None:
            self._sched.finished(request.request_id)
        return False, None

    # ---- stats and metrics -----------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return RAGCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return RAGCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _view(request: Request) -> RequestView:
    salt = request.cache_salt or ""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        salt = f"{salt}\x00lora:{lora.lora_name}"
    cacheable = request.prompt_token_ids is not None and not getattr(request, "mm_features", None)
    return RequestView(request.request_id, request.all_token_ids, salt, cacheable)
