"""Timeouts, retries and the shared default objects (no model: a stub engine)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ragcache_backend.engine.engine import GenerationResult, StreamChunk
from ragcache_backend.errors import CacheBudgetError, InvalidRequestError, RequestCancelledError
from ragcache_backend.prompts.builder import Segment, SegmentKind
from ragcache_backend.model.sampling import SamplingParams
from ragcache_integrations import GenerationTimeoutError, known_documents
from ragcache_integrations._params import RAGCacheParams
from ragcache_integrations._runtime import Generation, _Lazy

RESULT = GenerationResult(answer="ok", token_ids=(1,), finish_reason="stop", ttft_s=0.1, total_s=0.2,
                          prompt_tokens=3, cached_tokens=0, computed_tokens=3, device_hits=0, host_hits=0,
                          documents=(), dropped_documents=(), model="stub")
SEGMENTS = (Segment((1, 2, 3), SegmentKind.TAIL, cacheable=False),)


class StubEngine:
    """Fails with the given errors first, then succeeds; records how it was called."""

    model_name = "stub"
    store = None

    def __init__(self, *errors: BaseException, wait_for_cancel: bool = False) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.wait_for_cancel = wait_for_cancel

    def generate_segments(self, segments, sampling, *, use_cache=None, on_text=None, cancel=None, reuse=None):
        self.calls += 1
        if self.wait_for_cancel:  # polls like the engine's decode loop does
            deadline = time.monotonic() + 5
            while not cancel.is_set():
                assert time.monotonic() < deadline, "never cancelled"
                time.sleep(0.01)
            raise RequestCancelledError("the request was cancelled")
        if self.errors:
            raise self.errors.pop(0)
        on_text("ok")
        return RESULT

    async def agenerate_segments(self, segments, sampling, *, use_cache=None, reuse=None):
        self.calls += 1
        if self.wait_for_cancel:
            await asyncio.sleep(5)
            raise AssertionError("never cancelled")
        if self.errors:
            raise self.errors.pop(0)
        return RESULT

    def stream_segments(self, segments, sampling, *, use_cache=None, reuse=None):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        yield StreamChunk("ok")
        yield StreamChunk("", RESULT)


def generation(engine, **kw) -> Generation:
    return Generation(engine, SEGMENTS, SamplingParams(max_tokens=4), **kw)


def test_transient_errors_are_retried() -> None:
    engine = StubEngine(GenerationTimeoutError("slow"), GenerationTimeoutError("slow"))
    assert generation(engine, max_retries=2).run() is RESULT and engine.calls == 3
    engine = StubEngine(GenerationTimeoutError("slow"))
    assert [c.text for c in generation(engine, max_retries=1).stream()] == ["ok", ""] and engine.calls == 2


def test_retries_are_bounded_and_input_errors_never_retried() -> None:
    engine = StubEngine(*[GenerationTimeoutError("slow")] * 3)
    with pytest.raises(GenerationTimeoutError):
        generation(engine, max_retries=1).run()
    assert engine.calls == 2
    engine = StubEngine(CacheBudgetError("this prompt can never fit the arena"))  # never retried
    with pytest.raises(CacheBudgetError):
        generation(engine, max_retries=3).run()
    assert engine.calls == 1
    engine = StubEngine(InvalidRequestError("bad"))
    with pytest.raises(InvalidRequestError):
        generation(engine, max_retries=5).run()
    assert engine.calls == 1


def test_timeout_cancels_the_request_and_caller_cancel_is_not_a_timeout() -> None:
    engine = StubEngine(wait_for_cancel=True)
    with pytest.raises(GenerationTimeoutError):
        generation(engine, timeout=0.05, max_retries=1).run()
    assert engine.calls == 2
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RequestCancelledError):
        generation(StubEngine(wait_for_cancel=True), max_retries=3).run(cancel=cancel)


def test_overrides_and_sampling() -> None:
    params = RAGCacheParams.model_construct(engine=StubEngine(), temperature=0.5, stop=["\n\n"], max_tokens=9)
    gen = params.generation(SEGMENTS, None, {"max_tokens": 3, "seed": 7})
    assert gen.sampling == SamplingParams(max_tokens=3, temperature=0.5, stop=("\n\n",), seed=7)
    assert params.generation(SEGMENTS, ["END"]).sampling.stop == ("END",)
    with pytest.raises(InvalidRequestError, match="logprobs"):
        params.generation(SEGMENTS, None, {"logprobs": True})
    with pytest.raises(InvalidRequestError, match="serves"):
        params.generation(SEGMENTS, None, {"model": "other"})


def test_lazy_value_is_built_once_across_threads() -> None:
    built = []
    lazy = _Lazy(lambda: built.append(1) or object())
    threads = [threading.Thread(target=lazy.get) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and lazy.get() is lazy.get()
    assert known_documents() is known_documents()


async def test_async_run_retries_and_times_out() -> None:
    engine = StubEngine(GenerationTimeoutError("slow"))
    assert await generation(engine, max_retries=1).arun() is RESULT and engine.calls == 2
    engine = StubEngine(wait_for_cancel=True)
    t0 = time.monotonic()
    with pytest.raises(GenerationTimeoutError):
        await generation(engine, timeout=0.05, max_retries=1).arun()
    assert engine.calls == 2 and time.monotonic() - t0 < 2
