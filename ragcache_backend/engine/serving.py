"""The former serving engine, kept as a thin alias: :class:`RAGCacheEngine` itself now runs the
one continuous-batching step loop (cache-aware reordering, cancellation) for every caller.

``ServingEngine(engine, config)`` sets the engine's scheduler knobs and forwards ``submit*``,
``generate``, ``agenerate`` and ``astream`` to it; closing it waits for (or cancels) the requests
in flight without closing the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from ragcache_backend.engine.engine import EngineClosedError, EngineStats, RAGCacheEngine
from ragcache_backend.engine.request import GenerationResult, RequestHandle, RequestMetrics, StreamChunk
from ragcache_backend.engine.scheduler import SchedulerConfig
from ragcache_backend.model.sampling import SamplingParams

__all__ = ["EngineClosedError", "RequestHandle", "RequestMetrics", "ServingEngine"]


class ServingEngine:
    """Alias of the engine's own step loop with given scheduler knobs (see the module docstring).

    Args:
        engine: the engine to drive.
        config: batching and reordering knobs (applied now; no request may be in flight).
        start: kept for compatibility; the engine's loop starts with its first request.
    """

    def __init__(self, engine: RAGCacheEngine, config: SchedulerConfig | None = None, *, start: bool = True) -> None:
        self.engine = engine
        if config is not None:
            engine.configure_scheduler(config)
        self.config = engine.scheduler.config
        self._closed = False

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def in_flight(self) -> int:
        return self.engine.in_flight

    def submit(self, question: str, documents: Sequence = (), sampling: SamplingParams | None = None, **kw) -> RequestHandle:
        self._check_open()
        return self.engine.submit(question, documents, sampling, **kw)

    def submit_segments(self, segments, sampling: SamplingParams | None = None, **kw) -> RequestHandle:
        self._check_open()
        return self.engine.submit_segments(segments, sampling, **kw)

    def generate(self, question: str, documents: Sequence = (), sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        return self.submit(question, documents, sampling, **kw).result()

    async def agenerate(self, question: str, documents: Sequence = (), sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        self._check_open()
        return await self.engine.agenerate(question, documents, sampling, **kw)

    async def astream(self, question: str, documents: Sequence = (), sampling: SamplingParams | None = None, **kw) -> AsyncIterator[StreamChunk]:
        self._check_open()
        async with contextlib.aclosing(self.engine.astream(question, documents, sampling, **kw)) as inner:
            async for chunk in inner:
                yield chunk

    def cancel(self, rid: int) -> None:
        self.engine.cancel(rid)

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests here; wait for (or ``cancel``) those in flight; the engine stays open."""
        self._closed = True
        if cancel:
            for rid in self.engine.live_request_ids():
                self.engine.cancel(rid)
        self.engine.wait_idle(timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the serving engine is closed")

    def __enter__(self) -> ServingEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)
