"""The engine's one continuous-batching step loop, seen from its callers (tiny model, fp32).

Concurrent async callers share forward steps without changing a greedy answer; a request can be
cancelled while queued, prefilling or decoding (sync, async, a client that walks away) and leaves
no KV block or lock behind; "can never fit" fails at once while "no room now" waits; whole-prompt
reuse; a caller's failing ``on_text`` fails only its own request.

No timing is asserted. Where two requests must meet in one step, a *gate* in front of
``runner.forward`` holds the loop until every request is submitted, so batching is deterministic
on a busy machine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import threading
import time

import pytest

from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.engine.scheduler import SchedulerConfig
from ragcache_backend.errors import CacheBudgetError, RequestCancelledError
from ragcache_backend.model.sampling import SamplingParams
from tests.engine.leaks import assert_at_baseline as _at_baseline

DOCS = [
    f"Document {i}: the {w} module of the standard library handles {w} tasks; see section {i * 7} "
    f"for the {w} API, its exceptions and the examples of {w} use in scripts."
    for i, w in enumerate(["json", "csv", "pathlib", "asyncio", "socket", "re", "heapq", "bisect"])
]
QUESTIONS = ["How do I parse it?", "What does it raise?", "Is it thread-safe?", "Where are examples?"]
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # layers * kv_heads * head_dim * fp32 * K/V, 16 tokens
LONG = SamplingParams(max_tokens=1500)  # with stop tokens off: ~1500 steps, far longer than any poll


def _engine(tiny_model, fixed_profile, *, device_blocks=256, host_bytes=1 << 20, policy="pgdsf", cache=True,
            scheduler=None, **overrides):
    cfg = EngineConfig(device_budget_bytes=device_blocks * BLOCK_BYTES, host_budget_bytes=host_bytes,
                       policy=policy, enable_cache=cache, threads=1, **overrides)
    return RAGCacheEngine(cfg, loaded=tiny_model, profile=fixed_profile, scheduler=scheduler)


@pytest.fixture()
def make_engine(tiny_model, fixed_profile):
    """Engines built by the test, closed (their loop joined) at teardown."""
    made: list[RAGCacheEngine] = []

    def make(**kw) -> RAGCacheEngine:
        engine = _engine(tiny_model, fixed_profile, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close(cancel=True, timeout=30)


def _idle_at_baseline(engine) -> None:
    assert engine.wait_idle(10), f"{engine.in_flight} request(s) still in flight"
    _at_baseline(engine)


def _wait_until(cond, timeout=20.0, what="condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


class Gate:
    """Wraps ``engine.runner.forward``: while closed, the step loop blocks before its next forward.

    Also records, per forward step, the batch size and the device blocks in use (the loop's own
    thread reads them, so no race with the cache)."""

    def __init__(self, engine: RAGCacheEngine, monkeypatch, *, closed: bool = False) -> None:
        self.open_event = threading.Event()
        if not closed:
            self.open_event.set()
        self.entered = threading.Event()  # set when a forward call is waiting at (or passed) the gate
        self.batches: list[int] = []
        self.device_used: list[int] = []
        real = engine.runner.forward_step
        cache = engine.cache

        def forward(batch, **kw):
            self.entered.set()
            if not self.open_event.wait(30):
                raise AssertionError("the test never opened the gate")
            self.batches.append(len(batch))
            self.device_used.append(cache.device_used_blocks)
            return real(batch, **kw)

        monkeypatch.setattr(engine.runner, "forward_step", forward)

    def open(self) -> None:
        self.open_event.set()

    def close(self) -> None:
        self.open_event.clear()
        self.entered.clear()


def _solo(tiny_model, fixed_profile, requests, sampling, *, no_stop=False):
    """Each request alone on a fresh engine without the cache: (token ids, forward steps) each."""
    ref = _engine(tiny_model, fixed_profile)
    if no_stop:
        ref.stop_ids = frozenset()
    out = []
    try:
        for q, docs in requests:
            s0 = ref.stats.steps
            r = ref.generate(q, docs, sampling, use_cache=False)
            out.append((r.token_ids, ref.stats.steps - s0))
    finally:
        ref.close(timeout=30)
    return out


# ---- 1, 2: concurrent async callers share forward steps; batching never changes tokens ----------------
async def test_concurrent_async_requests_share_forward_steps(tiny_model, fixed_profile, make_engine, monkeypatch):
    sampling = SamplingParams(max_tokens=8)
    docs = DOCS[:3]
    requests = [(q, docs) for q in QUESTIONS]
    solo = _solo(tiny_model, fixed_profile, requests, sampling)
    engine = make_engine(max_batch_size=4)
    gate = Gate(engine, monkeypatch, closed=True)

    async def release():  # runs after every agenerate below has submitted its request
        gate.open()

    *results, _ = await asyncio.gather(*(engine.agenerate(q, d, sampling) for q, d in requests), release())

    assert [r.token_ids for r in results] == [ids for ids, _ in solo]  # batching changes no token
    assert engine.stats.finished == len(requests) and engine.stats.failed == engine.stats.cancelled == 0
    assert engine.stats.steps < sum(steps for _, steps in solo)  # forward steps were shared
    assert max(gate.batches) > 1 and all(b <= 4 for b in gate.batches)

    # the same through handles: per-request metrics show the shared steps
    gate.close()
    handles = [engine.submit(q, d, sampling) for q, d in requests]
    gate.open()
    again = [await h for h in handles]
    assert [r.token_ids for r in again] == [ids for ids, _ in solo]
    assert any(max(h.metrics.batch_sizes) > 1 for h in handles)
    assert all(r.cached_tokens > 0 for r in again)  # the documents' KV was reused meanwhile
    _idle_at_baseline(engine)


async def test_concurrent_astream_consumers_share_forward_steps(tiny_model, fixed_profile, make_engine, monkeypatch):
    """LangChain-style concurrency: ``asyncio.gather`` over several ``astream`` consumers."""
    sampling = SamplingParams(max_tokens=8)
    requests = [(q, [DOCS[i % 2], DOCS[2]]) for i, q in enumerate(QUESTIONS)]
    solo = _solo(tiny_model, fixed_profile, requests, sampling)
    engine = make_engine(max_batch_size=4)
    gate = Gate(engine, monkeypatch, closed=True)

    async def consume(q, docs):
        return [chunk async for chunk in engine.astream(q, docs, sampling)]

    async def release():  # runs after every consumer below has submitted its request
        gate.open()

    *streams, _ = await asyncio.gather(*(consume(q, d) for q, d in requests), release())

    for chunks, (ids, _) in zip(streams, solo):
        result = chunks[-1].result
        assert result is not None and all(c.result is None for c in chunks[:-1])
        assert result.token_ids == ids
        assert "".join(c.text for c in chunks) == result.answer
    assert engine.stats.finished == len(requests)
    assert engine.stats.steps < sum(steps for _, steps in solo)
    assert max(gate.batches) > 1
    _idle_at_baseline(engine)


# ---- 3: cancellation while queued, while prefilling, while decoding ---------------------------------
def test_cancel_while_queued(make_engine):
    engine = make_engine(scheduler=SchedulerConfig(max_batch_size=1))
    engine.stop_ids = frozenset()  # the running request ends only by length: it keeps the only slot
    first = engine.submit(QUESTIONS[0], DOCS[:2], LONG)
    _wait_until(lambda: len(first.metrics.batch_sizes) >= 1, what="the first request to run")
    waiting = [engine.submit(q, DOCS[:2], SamplingParams(max_tokens=3)) for q in QUESTIONS[1:]]
    n0 = len(first.metrics.batch_sizes)
    # two more steps: the loop has taken the waiting requests into its scheduler (pending)
    _wait_until(lambda: len(first.metrics.batch_sizes) >= n0 + 2, what="two more steps")

    waiting[1].cancel()
    assert waiting[0].future.cancel()  # cancelling the handle's future cancels the request too
    with pytest.raises(RequestCancelledError):
        waiting[1].result(timeout=20)
    with pytest.raises(concurrent.futures.CancelledError):
        waiting[0].result(timeout=20)
    _wait_until(lambda: engine.stats.cancelled == 2, what="both cancellations")
    assert not first.done()  # they really were queued behind the running request
    for h in waiting[:2]:
        assert h.metrics.admit_attempts == 0 and h.metrics.batch_sizes == []

    first.cancel()
    with pytest.raises(RequestCancelledError):
        first.result(timeout=20)
    assert waiting[2].result(timeout=20).token_ids  # the survivor still runs
    assert engine.stats.cancelled == 3 and engine.stats.finished == 1
    _idle_at_baseline(engine)


def test_cancel_right_after_submit(make_engine):
    """The cancel may land before admission or during the prefill: a clean outcome either way."""
    engine = make_engine()
    outcomes = []
    for q in QUESTIONS:
        h = engine.submit(q, DOCS[:3], SamplingParams(max_tokens=3))
        h.cancel()
        try:
            h.result(timeout=20)
            outcomes.append("done")
        except RequestCancelledError:
            outcomes.append("cancelled")
        assert engine.wait_idle(10)
        _at_baseline(engine)
    assert engine.stats.cancelled == outcomes.count("cancelled")
    assert engine.stats.finished == outcomes.count("done")
    assert engine.generate(QUESTIONS[0], DOCS[:3], SamplingParams(max_tokens=3)).token_ids
    _idle_at_baseline(engine)


@pytest.mark.parametrize("how", ["handle", "event"])
def test_cancel_during_prefill(make_engine, monkeypatch, how):
    engine = make_engine()
    gate = Gate(engine, monkeypatch, closed=True)
    cancel = threading.Event()
    h = engine.submit(QUESTIONS[1], DOCS[:3], SamplingParams(max_tokens=50), cancel=cancel)
    assert gate.entered.wait(20)  # admitted: its prefill forward waits at the gate
    assert engine.cache.request_blocks > 0  # the lease holds blocks now
    h.cancel() if how == "handle" else cancel.set()
    gate.open()
    with pytest.raises(RequestCancelledError):
        h.result(timeout=20)
    assert h.metrics.batch_sizes == [1]  # cancelled after its prefill step, before any decode
    assert engine.stats.cancelled == 1 and engine.stats.finished == 0
    _idle_at_baseline(engine)
    # the completed prefill's documents are valid tree nodes: a repeat reuses them
    r = engine.generate(QUESTIONS[1], DOCS[:3], SamplingParams(max_tokens=3))
    assert r.cached_tokens > 0
    _idle_at_baseline(engine)


def test_cancel_while_decoding(make_engine):
    engine = make_engine()
    engine.stop_ids = frozenset()
    # a sync stream: closing it after one chunk cancels and returns once the blocks are freed
    stream = engine.stream(QUESTIONS[2], DOCS[:3], LONG)
    first = next(stream)
    assert first.result is None
    stream.close()
    assert engine.stats.cancelled == 1
    _at_baseline(engine)  # no wait: close() itself waited for the blocks
    # a handle: cancel after a few decode steps
    h = engine.submit(QUESTIONS[3], DOCS[:3], LONG)
    _wait_until(lambda: len(h.metrics.batch_sizes) >= 3, what="decode steps")
    h.cancel()
    with pytest.raises(RequestCancelledError):
        h.result(timeout=20)
    assert 3 <= len(h.metrics.batch_sizes) < LONG.max_tokens
    assert engine.stats.cancelled == 2 and engine.stats.finished == 0
    _idle_at_baseline(engine)


async def test_cancelling_an_agenerate_task_cancels_the_request(make_engine):
    engine = make_engine()
    engine.stop_ids = frozenset()
    task = asyncio.create_task(engine.agenerate(QUESTIONS[0], DOCS[:2], LONG))
    deadline = time.monotonic() + 20
    while engine.stats.steps < 3:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.stats.cancelled == 1  # the awaiting task returned only once the loop let go
    _at_baseline(engine)


# ---- 4: a client that disconnects mid-stream ----------------------------------------------------
async def _until_cancelled(engine, count: int, what: str) -> None:
    """Wait (10 s at most) until ``count`` requests were cancelled and none is in flight."""
    deadline = time.monotonic() + 10
    while engine.in_flight or engine.stats.cancelled < count:
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


async def test_client_disconnect_mid_stream_cancels_the_request(make_engine):
    engine = make_engine()
    engine.stop_ids = frozenset()

    # the client closes its stream after the first chunk (as a web framework does on disconnect)
    async with contextlib.aclosing(engine.astream(QUESTIONS[0], DOCS[:3], LONG)) as stream:
        async for chunk in stream:
            assert chunk.result is None
            break
    await _until_cancelled(engine, 1, "the abandoned request is still running")
    assert engine.stats.cancelled == 1 and engine.stats.finished == 0
    _at_baseline(engine)

    # the client just stops iterating and drops the generator (closed by the event loop's hooks)
    async def client():
        async for chunk in engine.astream(QUESTIONS[1], DOCS[:3], LONG):
            return chunk

    assert (await client()).result is None
    await _until_cancelled(engine, 2, "the dropped stream's request is still running")
    assert engine.stats.cancelled == 2 and engine.stats.finished == 0
    _at_baseline(engine)
    assert engine.generate(QUESTIONS[2], DOCS[:3], SamplingParams(max_tokens=3)).token_ids
    _idle_at_baseline(engine)


@pytest.mark.parametrize("api", ["astream", "astream_segments"])
async def test_closing_a_stream_waits_until_blocks_are_freed(make_engine, api):
    engine = make_engine()
    engine.stop_ids = frozenset()
    if api == "astream":
        opened = engine.astream(QUESTIONS[0], DOCS[:3], LONG)
    else:
        opened = engine.astream_segments(engine.segments_for(QUESTIONS[0], DOCS[:3], LONG)[0], LONG)
    async with contextlib.aclosing(opened) as stream:
        async for chunk in stream:
            assert chunk.result is None
            break
    # no await since aclose(): the request is already cancelled and its blocks freed
    assert engine.stats.cancelled == 1 and engine.in_flight == 0
    _at_baseline(engine)


async def test_async_cancellation_logs_no_unretrieved_future_error(make_engine, caplog):
    engine = make_engine()
    engine.stop_ids = frozenset()
    segments, _ = engine.segments_for(QUESTIONS[0], DOCS[:3], LONG)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        async with contextlib.aclosing(engine.astream_segments(segments, LONG)) as stream:
            async for _chunk in stream:
                break
        assert engine.stats.cancelled == 1
        await asyncio.sleep(0)
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_a_stream_cancelled_again_while_it_waits_logs_no_unretrieved_future_error(make_engine, caplog):
    """A server shutting down cancels its tasks again while a closed stream waits for its request
    to be finished by the loop: the request is still cancelled and nothing is logged at GC."""
    engine = make_engine()
    engine.stop_ids = frozenset()
    segments, _ = engine.segments_for(QUESTIONS[0], DOCS[:3], LONG)
    first = asyncio.Event()

    async def consume():
        async for _chunk in engine.astream_segments(segments, LONG):
            first.set()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        task = asyncio.ensure_future(consume())
        await first.wait()
        task.cancel()
        await asyncio.sleep(0)  # into the stream's finally: the request is cancelled, the task waits for it
        task.cancel()  # ... and is cancelled again while it waits
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _until_cancelled(engine, 1, "the twice-cancelled stream's request is still running")
        await asyncio.sleep(0.05)
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


# ---- 5, 6: "can never fit" fails at once; "no room now" waits ------------------------------------
def test_prompt_larger_than_the_arena_fails_at_once(make_engine):
    engine = make_engine(device_blocks=8)  # 128 tokens of KV
    long_doc = "The arena is far too small for this document. " * 30  # ~300 tokens
    h = engine.submit(QUESTIONS[0], [long_doc], SamplingParams(max_tokens=4))
    with pytest.raises(CacheBudgetError, match="device"):
        h.result(timeout=10)  # at once: no waiting for room that can never come
    assert h.metrics.admit_attempts == 1 and h.metrics.batch_sizes == []
    with pytest.raises(CacheBudgetError):
        engine.generate(QUESTIONS[1], [long_doc], SamplingParams(max_tokens=4))
    assert engine.stats.failed == 2 and engine.stats.steps == 0
    assert engine.wait_idle(10)
    _at_baseline(engine)
    assert engine.cache.device_used_blocks == 0 and len(engine.cache.tree) == 0  # nothing poisoned
    ok = engine.generate(QUESTIONS[0], [], SamplingParams(max_tokens=2))  # still serves
    assert ok.token_ids and engine.stats.finished == 1
    _idle_at_baseline(engine)


def test_no_room_now_waits_instead_of_failing(make_engine, monkeypatch):
    """An arena that fits one request at a time but never two: concurrent requests take turns."""
    sampling = SamplingParams(max_tokens=8)
    requests = [(q, [DOCS[i]]) for i, q in enumerate(QUESTIONS)]  # ~80 tokens + 8 each, distinct docs
    host = 4 * BLOCK_BYTES
    engine = make_engine(device_blocks=8, host_bytes=host)
    engine.stop_ids = frozenset()  # every request runs all 8 steps
    gate = Gate(engine, monkeypatch, closed=True)
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(engine.submit, q, d, sampling) for q, d in requests]
        handles = [f.result(timeout=20) for f in futures]
        _wait_until(lambda: engine.in_flight == len(requests), what="all requests submitted")
        gate.open()
        results = [h.result(timeout=60) for h in handles]  # none raises CacheBudgetError
    assert all(len(r.token_ids) == 8 for r in results)
    assert engine.stats.finished == len(requests) and engine.stats.failed == 0
    assert max(h.metrics.admit_attempts for h in handles) > 1  # some request waited for room
    assert set(gate.batches) == {1}  # two never fit together
    assert max(gate.device_used) <= engine.cache.num_device_blocks
    assert engine.cache.host_used_bytes <= host and engine.cache.stats.device_evictions > 0
    _idle_at_baseline(engine)


# ---- 7: whole-prompt reuse ------------------------------------------------------------------------
@pytest.mark.parametrize("whole_prompt", [True, False])
def test_whole_prompt_reuse(make_engine, whole_prompt):
    engine = make_engine(whole_prompt_reuse=whole_prompt)
    sampling = SamplingParams(max_tokens=6)
    first = engine.generate(QUESTIONS[0], DOCS[:2], sampling)
    second = engine.generate(QUESTIONS[0], DOCS[:2], sampling)
    segments, _ = engine.segments_for(QUESTIONS[0], DOCS[:2], sampling)
    assert first.cached_tokens == 0 and first.prompt_tokens == second.prompt_tokens
    expected = second.prompt_tokens - (1 if whole_prompt else len(segments[-1]))
    assert second.cached_tokens == expected
    assert second.computed_tokens == second.prompt_tokens - expected
    assert second.token_ids == first.token_ids and second.answer == first.answer
    _idle_at_baseline(engine)


# ---- 8: a failing on_text callback fails only its own request -------------------------------------
def test_raising_on_text_fails_only_its_request(make_engine, monkeypatch):
    engine = make_engine()
    engine.stop_ids = frozenset()
    sampling = SamplingParams(max_tokens=6)
    gate = Gate(engine, monkeypatch, closed=True)

    def bad_callback(_text):
        raise ValueError("client callback failed")

    good1 = engine.submit(QUESTIONS[0], DOCS[:2], sampling)
    bad = engine.submit(QUESTIONS[1], DOCS[:2], sampling, on_text=bad_callback)
    seen: list[str] = []
    good2 = engine.submit(QUESTIONS[2], DOCS[:2], sampling, on_text=seen.append)
    gate.open()
    with pytest.raises(ValueError, match="client callback failed"):
        bad.result(timeout=20)
    r1, r2 = good1.result(timeout=20), good2.result(timeout=20)
    assert len(r1.token_ids) == len(r2.token_ids) == 6
    assert "".join(seen) == r2.answer
    assert max(bad.metrics.batch_sizes) > 1  # it failed inside a step shared with the others
    assert engine.stats.failed == 1 and engine.stats.finished == 2 and engine.stats.cancelled == 0
    _idle_at_baseline(engine)
    assert engine.generate(QUESTIONS[1], DOCS[:2], sampling).token_ids  # the engine goes on


def test_a_dropped_engine_is_freed_and_its_loop_ends(tiny_model, fixed_profile):
    import weakref

    engine = _engine(tiny_model, fixed_profile)
    engine.generate(QUESTIONS[0], DOCS[:2], SamplingParams(max_tokens=2))
    ref = weakref.ref(engine)
    del engine
    deadline = time.monotonic() + 5
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert ref() is None  # the loop thread does not keep the engine (and its KV arena) alive
