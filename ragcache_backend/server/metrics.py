"""Prometheus metrics of one server (one :class:`CollectorRegistry` per app, never the global one).

Per request (updated as requests finish): requests by endpoint and status, time to first token and
end-to-end latency histograms, prompt tokens cached / computed / recomputed, generated tokens.
Read from the engine at scrape time (:class:`EngineCollector`): hits, bytes and evictions per tier
(device, host, disk, remote), swap-outs, queue length, running batch size, requests in flight, engine
outcomes. The disk tier's figures read as 0 until the engine has one.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.engine.request import GenerationResult

__all__ = ["CONTENT_TYPE", "EngineCollector", "ServerMetrics", "engine_load"]

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def engine_load(engine: RAGCacheEngine) -> tuple[int, int]:
    """``(waiting, running)`` requests of the engine's scheduler, read from another thread."""
    for _ in range(3):  # the loop thread may change the scheduler's dicts while they are copied
        try:
            return len(engine.scheduler.pending), len(engine.scheduler.running)
        except RuntimeError:
            continue
    return 0, 0


class EngineCollector(Collector):
    """Cache-tier and scheduler figures of ``engine``, read when Prometheus scrapes."""

    def __init__(self, engine: RAGCacheEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        cache = engine.cache
        stats = cache.stats

        def stat(name: str) -> float:
            return float(getattr(stats, name, 0) or 0)

        hits = CounterMetricFamily("ragcache_cache_hits", "Reused cache nodes by the tier they were found in",
                                   labels=["tier"])
        for tier in ("device", "host"):
            hits.add_metric([tier], stat(f"{tier}_hits"))
        hits.add_metric(["disk"], stat("disk_hits") - stat("remote_hits"))  # disk_hits counts every node read below memory
        hits.add_metric(["remote"], stat("remote_hits"))
        yield hits
        used = GaugeMetricFamily("ragcache_cache_bytes", "KV bytes held per tier", labels=["tier"])
        used.add_metric(["device"], float(cache.device_used_blocks * engine.runner.block_bytes))
        used.add_metric(["host"], float(cache.host_used_bytes))
        used.add_metric(["disk"], float(getattr(cache, "disk_used_bytes", 0) or 0))
        yield used
        disk = cache.disk
        disk_stats = disk.stats if disk is not None else None

        def dstat(name: str) -> float:
            return float(getattr(disk_stats, name, 0) or 0)

        budget = GaugeMetricFamily("ragcache_cache_budget_bytes", "Byte budget per tier", labels=["tier"])
        budget.add_metric(["device"], float(cache.num_device_blocks * engine.runner.block_bytes))
        budget.add_metric(["host"], float(cache.host_budget_bytes))
        budget.add_metric(["disk"], float(disk.budget_bytes if disk is not None else 0))
        yield budget
        evictions = CounterMetricFamily("ragcache_cache_evictions", "Nodes (disk: files) evicted per tier", labels=["tier"])
        evictions.add_metric(["device"], stat("device_evictions"))
        evictions.add_metric(["host"], stat("host_evictions"))
        evictions.add_metric(["disk"], dstat("evictions"))
        yield evictions
        yield CounterMetricFamily("ragcache_cache_swap_outs", "Device-to-host KV copies", value=stat("swap_outs"))
        yield CounterMetricFamily("ragcache_cache_swap_ins", "Host-to-device KV copies", value=stat("swap_ins"))
        yield CounterMetricFamily("ragcache_cache_moves_out", "Device-to-host moves in a shared pool (no copy)",
                                  value=stat("moved_out"))
        yield CounterMetricFamily("ragcache_cache_moves_in", "Host-to-device moves in a shared pool: host hits attended "
                                  "in place (no copy)", value=stat("moved_in"))
        yield CounterMetricFamily("ragcache_cache_disk_writes", "KV files written to the disk tier", value=dstat("writes"))
        yield CounterMetricFamily("ragcache_cache_disk_write_failures", "Disk-tier writes that failed (full disk, I/O)",
                                  value=dstat("write_failures"))
        yield CounterMetricFamily("ragcache_cache_disk_skipped", "Nodes not written (writer behind, or over the budget)",
                                  value=dstat("skipped"))
        yield CounterMetricFamily("ragcache_cache_disk_corrupt", "Disk-tier files found damaged or foreign, deleted",
                                  value=dstat("corrupt"))
        yield GaugeMetricFamily("ragcache_cache_disk_files", "Files in the disk tier",
                                value=float(len(disk) if disk is not None else 0))
        remote = getattr(cache, "remote", None)
        remote_stats = remote.stats if remote is not None else None

        def rstat(name: str) -> float:
            return float(getattr(remote_stats, name, 0) or 0)

        yield CounterMetricFamily("ragcache_cache_remote_writes", "Entries sent to the remote tier (Redis)",
                                  value=rstat("puts"))
        yield CounterMetricFamily("ragcache_cache_remote_errors", "Remote-tier calls that failed (Redis down or "
                                  "slow): served by recomputation", value=rstat("errors"))
        yield CounterMetricFamily("ragcache_cache_remote_corrupt", "Remote-tier entries found damaged or foreign, "
                                  "deleted", value=rstat("corrupt"))
        yield CounterMetricFamily("ragcache_engine_retries", "Requests retried by recomputation after a failure "
                                  "before their first token", value=float(engine.stats.retried))
        yield CounterMetricFamily("ragcache_cache_chunk_hits", "Documents served from chunk-cache variants",
                                  value=stat("variant_hits"))
        waiting, running = engine_load(engine)
        yield GaugeMetricFamily("ragcache_queue_length", "Requests waiting for admission", value=waiting)
        yield GaugeMetricFamily("ragcache_running_batch_size", "Requests admitted (prefilling or decoding)",
                                value=running)
        yield GaugeMetricFamily("ragcache_requests_in_flight", "Requests submitted to the engine and not finished",
                                value=engine.in_flight)
        outcomes = CounterMetricFamily("ragcache_engine_requests", "Engine requests by outcome", labels=["outcome"])
        for outcome in ("finished", "failed", "cancelled"):
            outcomes.add_metric([outcome], float(getattr(engine.stats, outcome)))
        yield outcomes


class ServerMetrics:
    """The server's metrics in their own registry.

    Args:
        engine: read at scrape time by an :class:`EngineCollector`.
    """

    def __init__(self, engine: RAGCacheEngine) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("ragcache_http_requests", "API requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=reg)
        self.ttft = Histogram("ragcache_time_to_first_token_seconds", "Seconds from submission to the first token",
                              ["endpoint"], buckets=_LATENCY_BUCKETS, registry=reg)
        self.latency = Histogram("ragcache_request_latency_seconds", "Seconds from arrival to the last byte",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=reg)
        self.prompt_cached = Counter("ragcache_prompt_tokens_cached", "Prompt tokens served from the cache",
                                     registry=reg)
        self.prompt_computed = Counter("ragcache_prompt_tokens_computed", "Prompt tokens run through the model",
                                       registry=reg)
        self.prompt_recomputed = Counter("ragcache_prompt_tokens_recomputed",
                                         "Tokens of reused chunks recomputed (chunk modes)", registry=reg)
        self.generated = Counter("ragcache_generation_tokens", "Tokens generated", registry=reg)
        reg.register(EngineCollector(engine))

    def finished(self, endpoint: str, result: GenerationResult, latency_s: float) -> None:
        """Record a request that generated to the end (status 200)."""
        self.requests.labels(endpoint, "200").inc()
        self.ttft.labels(endpoint).observe(result.ttft_s)
        self.latency.labels(endpoint).observe(latency_s)
        self.prompt_cached.inc(result.cached_tokens)
        self.prompt_computed.inc(result.computed_tokens)
        self.prompt_recomputed.inc(result.recomputed_tokens)
        self.generated.inc(len(result.token_ids))

    def failed(self, endpoint: str, status: int) -> None:
        """Record a request answered with an error ``status`` (499: the client went away)."""
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
