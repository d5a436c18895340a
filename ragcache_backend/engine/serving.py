"""Async serving engine: many concurrent requests, continuous batching, cache-aware reordering.

One background thread owns the :class:`~ragcache_backend.engine.engine.RAGCacheEngine`'s runner and
:class:`~ragcache_backend.cache.tiers.TieredCache` (neither is thread-safe). Callers on any thread or
event loop :meth:`ServingEngine.submit` requests and get a :class:`RequestHandle` (a
``concurrent.futures.Future`` that is also awaitable); :meth:`ServingEngine.astream` streams text.

Each loop iteration (one forward step):

1. take new requests and cancellations from the inbox;
2. refresh every pending request's cached/computed token estimate (knowledge-tree match, O(depth))
   and ask the :class:`~ragcache_backend.engine.scheduler.Scheduler` for a plan;
3. admit the planned prefills with the engine's own step (``_admit``: match, acquire, allocate);
   a request whose blocks are held by running requests waits for the next step;
4. run **one** ``runner.forward`` over all admitted prefills and all running decodes;
5. commit each prefill (insert its documents, PGDSF statistics), sample, stream, finish.

A request that fails (including a failed forward, which fails the requests of that step) or is
cancelled is always finished with the engine's ``_finish``: its tree path is unlocked and its
blocks freed, so no KV block leaks. TTFT here counts from ``submit`` (queueing included).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import torch

from ragcache_backend.engine.engine import GenerationResult, RAGCacheEngine, StreamChunk, _Request
from ragcache_backend.errors import CacheBudgetError, InvalidRequestError, RAGCacheError, RequestCancelledError
from ragcache_backend.prompts.builder import Segment, cacheable_lead
from ragcache_backend.model.sampling import SamplingParams, sample_token
from ragcache_backend.engine.scheduler import Scheduler, SchedulerConfig
from ragcache_backend.engine.streaming import adrain
from ragcache_backend.prompts.detokenizer import IncrementalText

log = logging.getLogger(__name__)


class EngineClosedError(RAGCacheError):
    """The serving engine is shut down (or shutting down) and takes no new request."""


class _TimedMover:
    """Wraps the cache's KV mover to time tier copies apart from scheduling bookkeeping."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds = 0.0

    def swap_out(self, blocks, num_tokens):
        t0 = time.perf_counter()
        try:
            return self.inner.swap_out(blocks, num_tokens)
        finally:
            self.seconds += time.perf_counter() - t0

    def swap_in(self, host_kv, blocks) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.swap_in(host_kv, blocks)
        finally:
            self.seconds += time.perf_counter() - t0

    def host_nbytes(self, num_tokens: int) -> int:
        return self.inner.host_nbytes(num_tokens)

    def free_host(self, host_kv) -> None:
        self.inner.free_host(host_kv)


@dataclass(slots=True)
class RequestMetrics:
    """Timing of one served request (seconds, ``time.perf_counter`` clock).

    ``sched_s`` is the scheduling overhead charged to the request (RAGCache Table 4's scope):
    its share of the reordering estimate (tree matches) and planning, its admission bookkeeping
    (match, lock, allocate, evict) and its commit (insert + PGDSF update). KV copies between the
    device and host tiers made meanwhile (swap-in of host hits, swap-out on eviction) are data
    movement, counted apart in ``kv_copy_s``.
    """

    submitted: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    sched_s: float = 0.0
    kv_copy_s: float = 0.0
    admit_attempts: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def queue_s(self) -> float:
        return max(0.0, self.admitted - self.submitted) if self.admitted else 0.0


class RequestHandle:
    """A submitted request: a future of its :class:`GenerationResult`; awaitable; cancellable."""

    def __init__(self, rid: int, engine: ServingEngine) -> None:
        self.rid = rid
        self.future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        self.metrics = RequestMetrics(submitted=time.perf_counter())
        self._engine = engine
        self.future.add_done_callback(self._on_done)

    def _on_done(self, fut: concurrent.futures.Future) -> None:
        if fut.cancelled():  # e.g. the awaiting asyncio task was cancelled
            self._engine.cancel(self.rid)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until done; raises the request's error (``RequestCancelledError`` if cancelled)."""
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()

    def cancel(self) -> None:
        """Cancel the request; its future then raises :class:`RequestCancelledError`."""
        self._engine.cancel(self.rid)

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()


@dataclass(slots=True)
class _Live:
    """A request inside the serving thread."""

    rid: int
    handle: RequestHandle
    segments: list[Segment]
    sampling: SamplingParams
    use_cache: bool
    dropped: tuple[str, ...]
    on_text: Callable[[str], None]
    lead_keys: list = field(default_factory=list)
    req: _Request | None = None
    text: IncrementalText | None = None
    gen: torch.Generator | None = None
    token: int | None = None
    computed: int = 0
    ttft: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)


class ServingEngine:
    """Continuous-batching server over one :class:`RAGCacheEngine` (RAGCache §5.2).

    Args:
        engine: the engine whose model, runner and cache this server drives. While the server
            runs, direct calls to the engine still work (they take the same lock, between steps).
        config: batching and reordering knobs.
        start: start the serving thread now (else call :meth:`start`).

    Use as a context manager, or call :meth:`close` to stop (pending and running requests are
    finished first unless ``close(cancel=True)``).
    """

    def __init__(self, engine: RAGCacheEngine, config: SchedulerConfig | None = None, *, start: bool = True) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.scheduler = Scheduler(self.config)
        cache = engine.cache
        if not isinstance(cache._mover, _TimedMover):
            cache._mover = _TimedMover(cache._mover)
        self._mover: _TimedMover = cache._mover
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._live: dict[int, _Live] = {}
        self._closing = False
        self._cancel_all = False
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        #: totals over the server's life, for the benchmark
        self.stats = {"steps": 0, "forward_s": 0.0, "sched_s": 0.0, "finished": 0, "failed": 0, "cancelled": 0}
        if start:
            self.start()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ragcache-serving", daemon=True)
            self._thread.start()

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; finish (or with ``cancel`` cancel) those in flight; join the thread."""
        self._closing = True
        self._cancel_all = self._cancel_all or cancel
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ServingEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._live) + self._inbox.qsize()

    # ---- submission ----------------------------------------------------------------------------
    def submit(self, question: str, documents: Sequence = (), sampling: SamplingParams | None = None, *,
               use_cache: bool | None = None, on_text: Callable[[str], None] | None = None) -> RequestHandle:
        """Queue a RAG request (question + retrieved documents, in retrieval order).

        Raises (at once, nothing queued): EmptyQueryError, ContextWindowError, EngineClosedError.
        """
        sampling = sampling or SamplingParams()
        segments, dropped = self.engine.segments_for(question, documents, sampling)
        return self.submit_segments(segments, sampling, use_cache=use_cache, on_text=on_text, dropped=dropped)

    def submit_segments(self, segments: Sequence[Segment], sampling: SamplingParams | None = None, *,
                        use_cache: bool | None = None, on_text: Callable[[str], None] | None = None,
                        dropped: tuple[str, ...] = ()) -> RequestHandle:
        """Queue an already segmented prompt (see :meth:`RAGCacheEngine.generate_segments`)."""
        if self._closing:
            raise EngineClosedError("the serving engine is closed")
        sampling = sampling or SamplingParams()
        if not segments:
            raise InvalidRequestError("a prompt needs at least one segment")
        self.engine._check_window(segments, sampling)
        rid = next(self._ids)
        handle = RequestHandle(rid, self)
        use = self.engine.config.enable_cache if use_cache is None else use_cache
        lead = [s.key for s in cacheable_lead(segments)] if use else []
        live = _Live(rid, handle, list(segments), sampling, use, dropped, on_text or (lambda _t: None), lead)
        self._inbox.put(("add", live))
        return handle

    def generate(self, question: str, documents: Sequence = (), sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        """Submit and wait (blocking)."""
        return self.submit(question, documents, sampling, **kw).result()

    async def agenerate(self, question: str, documents: Sequence = (), sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        """Submit and await; cancelling the awaiting task cancels the request."""
        handle = self.submit(question, documents, sampling, **kw)
        try:
            return await handle
        finally:
            if not handle.done():
                handle.cancel()

    async def astream(self, question: str, documents: Sequence = (), sampling: SamplingParams | None = None,
                      **kw) -> AsyncIterator[StreamChunk]:
        """Stream text deltas; the last chunk carries the result. Closing the stream cancels."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        handle = self.submit(question, documents, sampling,
                             on_text=lambda t: loop.call_soon_threadsafe(out.put_nowait, StreamChunk(t)), **kw)

        def done(fut: concurrent.futures.Future) -> None:
            item = fut.exception() if not fut.cancelled() and fut.exception() else None
            final = item if item is not None else (None if fut.cancelled() else StreamChunk("", fut.result()))
            loop.call_soon_threadsafe(out.put_nowait, final or RequestCancelledError("the request was cancelled"))

        handle.future.add_done_callback(done)
        try:
            async for item in adrain(out):
                yield item
        finally:
            if not handle.done():
                handle.cancel()

    def cancel(self, rid: int) -> None:
        """Cancel request ``rid`` (no-op if it already finished)."""
        self._inbox.put(("cancel", rid))

    # ---- the serving thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                self._drain(block=not self._live and not self._closing)
                if self._cancel_all:
                    for rid in list(self._live):
                        self._fail(self._live[rid], RequestCancelledError("the serving engine was shut down"))
                if self._closing and not self._live and self._inbox.empty():
                    return
                if self._live:
                    self._step()
        except BaseException as exc:  # a bug: fail everyone loudly rather than hang callers
            log.exception("serving loop crashed")
            for live in list(self._live.values()):
                self._fail(live, exc if isinstance(exc, Exception) else RAGCacheError(repr(exc)))
            self._closing = True
            while not self._inbox.empty():
                kind, item = self._inbox.get()
                if kind == "add":
                    item.handle.future.set_exception(EngineClosedError(f"the serving loop stopped: {exc!r}"))

    def _drain(self, block: bool) -> bool:
        got = False
        while True:
            try:
                kind, item = self._inbox.get(timeout=0.5) if block and not got else self._inbox.get_nowait()
            except queue.Empty:
                return got
            got = True
            if kind == "add":
                if self._closing and self._cancel_all:
                    item.handle.future.set_exception(RequestCancelledError("the serving engine was shut down"))
                    continue
                self._live[item.rid] = item
                self.scheduler.add(item.rid, 0, item.prompt_tokens)
            elif kind == "cancel":
                live = self._live.get(item)
                if live is not None:
                    self._fail(live, RequestCancelledError("the request was cancelled"))

    def _refresh(self) -> None:
        cache = self.engine.cache
        for rid in self.scheduler.pending:
            live = self._live[rid]
            cached = cache.match(live.lead_keys).cached_tokens if live.lead_keys else 0
            self.scheduler.update(rid, cached, live.prompt_tokens - cached)

    def _step(self) -> None:
        eng = self.engine
        with eng._lock:
            t0 = time.perf_counter()
            if self.config.reorder and self.config.window > 0:
                self._refresh()
            plan = self.scheduler.plan()
            plan_s = time.perf_counter() - t0
            decoders = [self._live[rid] for rid in plan.decode]
            admitted: list[_Live] = []
            for rid in plan.prefill:
                live = self._live[rid]
                if self._admit(live, can_wait=bool(decoders or admitted)):
                    admitted.append(live)
                elif rid in self._live:  # waits for blocks held by running requests
                    break
            share = plan_s / max(1, len(admitted) + len(decoders))
            for live in admitted + decoders:
                live.handle.metrics.sched_s += share
            self.stats["sched_s"] += time.perf_counter() - t0
            if not admitted and not decoders:
                return
            batch = [eng._prefill_input(l.req) for l in admitted] + [eng._decode_input(l.req, l.token) for l in decoders]
            t1 = time.perf_counter()
            try:
                logits = eng.runner.forward(batch)
            except Exception as exc:
                log.warning("forward step of %d sequences failed: %r", len(batch), exc)
                for live in admitted + decoders:
                    self._fail(live, exc)
                return
            self.stats["forward_s"] += time.perf_counter() - t1
            self.stats["steps"] += 1
            now = time.perf_counter()
            for live, lg in zip(admitted, logits[: len(admitted)]):
                live.handle.metrics.batch_sizes.append(len(batch))
                self._after_prefill(live, lg, now)
            for live, lg in zip(decoders, logits[len(admitted):]):
                if live.rid in self._live:
                    live.handle.metrics.batch_sizes.append(len(batch))
                    self._advance(live, lg)

    def _admit(self, live: _Live, *, can_wait: bool) -> bool:
        eng = self.engine
        m = live.handle.metrics
        m.admit_attempts += 1
        t0, c0 = time.perf_counter(), self._mover.seconds
        live.req = _Request(live.segments, live.sampling, live.use_cache)
        try:
            eng._admit(live.req)
        except CacheBudgetError as exc:
            eng._finish(live.req)
            live.req = None
            self._charge(m, t0, c0)
            if can_wait:
                return False
            self._fail(live, exc)
            return False
        except Exception as exc:
            self._fail(live, exc)
            return False
        self._charge(m, t0, c0)
        m.admitted = time.perf_counter()
        self.scheduler.start(live.rid)
        live.text = IncrementalText(eng.loaded.tokenizer, live.sampling.stop)
        seed = live.sampling.seed
        live.gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return True

    def _charge(self, m: RequestMetrics, t0: float, c0: float) -> None:
        copy = self._mover.seconds - c0
        m.kv_copy_s += copy
        m.sched_s += time.perf_counter() - t0 - copy

    def _after_prefill(self, live: _Live, logits: torch.Tensor, now: float) -> None:
        eng, req = self.engine, live.req
        try:
            t0, c0 = time.perf_counter(), self._mover.seconds
            live.computed = sum(len(s) for s, _ in req.pending) + len(req.tail)
            eng._commit(req)
            self._charge(live.handle.metrics, t0, c0)
            token = sample_token(logits, live.sampling, live.gen)
            live.handle.metrics.first_token = time.perf_counter()
            live.ttft = live.handle.metrics.first_token - live.handle.metrics.submitted
        except Exception as exc:
            self._fail(live, exc)
            return
        self._accept(live, token)

    def _advance(self, live: _Live, logits: torch.Tensor) -> None:
        try:
            token = sample_token(logits, live.sampling, live.gen)
        except Exception as exc:
            self._fail(live, exc)
            return
        self._accept(live, token)

    def _accept(self, live: _Live, token: int) -> None:
        eng = self.engine
        try:
            reason = eng._accept_token(live.req, token, live.text, live.on_text)
        except Exception as exc:  # e.g. the caller's on_text raised
            self._fail(live, exc)
            return
        if reason is None:
            live.token = token
            return
        m = live.handle.metrics
        try:
            eng._finish(live.req)
        finally:
            self._forget(live)
        m.finished = time.perf_counter()
        result = eng._result(live.req, live.text, reason, live.ttft, m.finished - m.submitted, live.computed, live.dropped)
        self.stats["finished"] += 1
        if not live.handle.future.done():
            live.handle.future.set_result(result)

    def _forget(self, live: _Live) -> None:
        self._live.pop(live.rid, None)
        self.scheduler.remove(live.rid)

    def _fail(self, live: _Live, exc: BaseException) -> None:
        try:
            if live.req is not None:
                with self.engine._lock:
                    self.engine._finish(live.req)
        finally:
            self._forget(live)
            live.handle.metrics.finished = time.perf_counter()
            self.stats["cancelled" if isinstance(exc, RequestCancelledError) else "failed"] += 1
            if not live.handle.future.done():
                live.handle.future.set_exception(exc)
