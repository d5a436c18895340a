"""Dynamic speculative pipelining (RAGCache §5.3, Algorithm 2) on a random tiny Llama.

The staged search is played by lists of candidate top-k (one per stage), so each test decides
exactly when the candidates change; answers are compared with ``generate`` on the final documents
(fp32, greedy: token for token).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from ragcache_backend.engine.pipelining import SpeculativePipeline
from ragcache_backend.engine.request import RequestHandle
from ragcache_backend.engine.scheduler import SpeculationDecision, decide_speculation
from ragcache_backend.errors import EmptyQueryError, RequestCancelledError, RetrievalError
from ragcache_backend.model.sampling import SamplingParams

from tests.engine.test_engine import assert_no_leak, make_engine

A = "The global interpreter lock (GIL) lets one thread run Python bytecode at a time. " * 5
B = "Lists are mutable sequences; tuples are immutable and can be dictionary keys. " * 5
C = "A decorator is a callable that takes a function and returns a replacement. " * 5
E = "Generators produce values lazily with yield and keep their frame between calls. " * 5
Q = "What does the GIL do?"
GREEDY = SamplingParams(max_tokens=24)


@pytest.fixture()
def engine(tiny_model, fixed_profile):
    eng = make_engine(tiny_model, fixed_profile)
    yield eng
    eng.close(cancel=True)


def stages(*lists, delay: float = 0.0) -> Iterator[list[str]]:
    """A staged search: yields each list after ``delay`` seconds of 'search'."""
    for docs in lists:
        time.sleep(delay)
        yield list(docs)


def settled(engine) -> None:
    assert engine.wait_idle(10)
    assert engine.in_flight == 0
    assert_no_leak(engine)


# ---- Algorithm 2's decision, as a pure function ---------------------------------------------------
@pytest.mark.parametrize(("changed", "speculating", "waiting", "bs", "expected"), [
    (False, True, 0, 1, SpeculationDecision(False, False)),   # same candidates: keep going
    (False, False, 0, 1, SpeculationDecision(False, False)),
    (True, False, 0, 1, SpeculationDecision(False, True)),    # first candidates, idle engine: speculate
    (True, True, 0, 1, SpeculationDecision(True, True)),      # changed: terminate and restart
    (True, True, 1, 1, SpeculationDecision(True, False)),     # pool at max_prefill_bs: terminate only
    (True, False, 3, 4, SpeculationDecision(False, True)),
    (True, False, 4, 4, SpeculationDecision(False, False)),
    (True, True, 0, 0, SpeculationDecision(True, False)),     # max_prefill_bs 0: never speculate
])
def test_decide_speculation(changed, speculating, waiting, bs, expected):
    assert decide_speculation(changed=changed, speculating=speculating, waiting=waiting, max_prefill_bs=bs) == expected


# ---- answers equal the final documents' answer ----------------------------------------------------
def test_kept_speculation_answers_exactly_as_the_final_documents(engine):
    plain = engine.generate(Q, [A, C], GREEDY, use_cache=False)
    engine.reset_cache()
    text: list[str] = []
    result = engine.generate_pipelined(Q, stages([A, B], [A, C], [A, C], delay=0.05), GREEDY, on_text=text.append)
    assert result.token_ids == plain.token_ids and result.answer == plain.answer
    assert "".join(text) == result.answer  # only the kept generation's text reached the caller
    assert result.speculation_kept
    assert result.speculative_requests == 2  # [A, B], then [A, C]; the third stage changed nothing
    assert result.documents == plain.documents
    assert 0.0 <= result.unoverlapped_search_s < result.search_s
    assert result.ttft_s >= result.search_s - 1e-6  # nothing reaches the caller before the search ends
    settled(engine)


def test_stale_speculation_is_terminated_its_text_never_seen_and_blocks_freed(engine):
    slow = SamplingParams(max_tokens=1000, stop=())  # generates for longer than the 0.4 s stage on a fast CPU
    final = engine.generate(Q, [A, C], slow, use_cache=False)
    engine.reset_cache()
    text: list[str] = []
    # [B, E] is speculated for 0.4 s (long enough to generate text), then the candidates change
    result = engine.generate_pipelined(Q, stages([B, E], [A, C], delay=0.4), slow, on_text=text.append)
    assert result.token_ids == final.token_ids
    assert "".join(text) == final.answer
    assert result.speculative_requests == 2 and result.speculation_kept
    assert result.wasted_tokens > 0  # [B, E] had prefilled (and maybe decoded) before it was terminated
    assert engine.stats.cancelled == 1
    settled(engine)


def test_final_documents_differ_from_the_last_speculation_regenerates(engine):
    final = engine.generate(Q, [C, A], GREEDY, use_cache=False)
    engine.reset_cache()
    # the last stage changes the order: a pool of 1 allows the restart, so make the pool "busy"
    pipeline = engine.speculative_pipeline(Q, GREEDY, max_prefill_bs=1)
    result = pipeline.run(stages([A, C], [A, C], [C, A]))
    assert result.token_ids == final.token_ids
    assert result.speculative_requests == 2  # [A, C], then [C, A] at the last stage: kept
    settled(engine)


class _Busy:
    """An engine view whose pool is always full."""

    waiting_requests = 5


def test_busy_pool_never_speculates_and_the_answer_is_generated_after_the_search(engine):
    submitted: list[tuple[str, ...]] = []

    def submit(docs, on_text) -> RequestHandle:
        submitted.append(tuple(docs))
        return engine.submit(Q, docs, GREEDY, on_text=on_text)

    pipeline = SpeculativePipeline(_Busy(), submit, key=lambda d: d, max_prefill_bs=4)
    result = pipeline.run(stages([A, B], [A, C], [C, A]))
    assert submitted == [(C, A)]  # only the final documents, once the search ended
    assert not result.speculation_kept and result.speculative_requests == 0 and result.wasted_tokens == 0
    assert result.unoverlapped_search_s == pytest.approx(result.search_s)
    assert result.token_ids == engine.generate(Q, [C, A], GREEDY, use_cache=False).token_ids
    settled(engine)


def test_max_prefill_bs_zero_turns_speculation_off(engine):
    result = engine.generate_pipelined(Q, stages([A, B], [A, C]), GREEDY, max_prefill_bs=0)
    assert result.speculative_requests == 0 and not result.speculation_kept
    assert result.token_ids == engine.generate(Q, [A, C], GREEDY).token_ids
    settled(engine)


def test_unchanged_candidates_keep_one_speculation(engine):
    result = engine.generate_pipelined(Q, stages([A, B], [A, B], [A, B], [A, B], delay=0.02), GREEDY)
    assert result.speculative_requests == 1 and result.speculation_kept and result.wasted_tokens == 0
    assert result.token_ids == engine.generate(Q, [A, B], GREEDY, use_cache=False).token_ids
    settled(engine)


def test_empty_search_answers_without_documents(engine):
    result = engine.generate_pipelined(Q, iter(()), GREEDY)
    assert result.documents == ()
    assert result.token_ids == engine.generate(Q, [], GREEDY, use_cache=False).token_ids
    settled(engine)


# ---- bad input and abandonment -------------------------------------------------------------------------
def failing_search(engine) -> Iterator[list[str]]:
    yield [A, B]
    deadline = time.monotonic() + 5  # fail while the speculative request runs (a fixed sleep raced a fast CPU)
    while not engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.001)
    raise OSError("the vector store went away")


def test_search_failure_fails_the_request_and_frees_speculative_work(engine):
    with pytest.raises(RetrievalError, match="went away"):
        engine.generate_pipelined(Q, failing_search(engine), SamplingParams(max_tokens=400, stop=()))
    settled(engine)
    assert engine.stats.cancelled == 1


def test_search_timeout_fails_cleanly(engine):
    with pytest.raises(RetrievalError, match="timeout"):
        engine.generate_pipelined(Q, stages([A, B], [A, C], [A, E], delay=0.15), GREEDY, search_timeout_s=0.2)
    settled(engine)


def test_cancel_during_the_search(engine):
    cancel = threading.Event()
    threading.Timer(0.15, cancel.set).start()
    with pytest.raises(RequestCancelledError):
        engine.generate_pipelined(Q, stages([A, B], [A, C], [A, E], delay=0.1), GREEDY, cancel=cancel)
    settled(engine)


def test_abandoned_stream_cancels_everything(engine):
    slow = SamplingParams(max_tokens=400, stop=())
    stream = engine.stream_pipelined(Q, stages([A, B], [A, C], delay=0.05), slow)
    first = next(stream)
    assert first.text and first.result is None
    stream.close()
    settled(engine)


def test_stream_yields_the_final_answer(engine):
    chunks = list(engine.stream_pipelined(Q, stages([A, B], [A, C], delay=0.05), GREEDY))
    result = chunks[-1].result
    assert result is not None and "".join(c.text for c in chunks) == result.answer
    assert result.token_ids == engine.generate(Q, [A, C], GREEDY, use_cache=False).token_ids
    settled(engine)


def test_blank_question_and_bad_timeout_raise_before_searching(engine):
    touched = []

    def search():
        touched.append(1)
        yield [A]

    with pytest.raises(EmptyQueryError):
        engine.generate_pipelined("  ", search(), GREEDY)
    with pytest.raises(ValueError):
        engine.generate_pipelined(Q, search(), GREEDY, search_timeout_s=0)
    assert not touched


def test_async_pipelined_and_task_cancellation(engine):
    async def main():
        result = await engine.agenerate_pipelined(Q, stages([A, B], [A, C], delay=0.05), GREEDY)
        task = asyncio.ensure_future(engine.agenerate_pipelined(
            Q, stages([A, B], [A, C], [B, C], [E, C], delay=0.1), GREEDY))
        await asyncio.sleep(0.15)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return result

    result = asyncio.run(main())
    assert result.token_ids == engine.generate(Q, [A, C], GREEDY, use_cache=False).token_ids
    settled(engine)


def test_ask_pipelined_equals_ask_on_a_real_store(tiny_model, fixed_profile, faq_store):
    eng = make_engine(tiny_model, fixed_profile)
    eng.store = faq_store
    try:
        for question in ("How do I make a Python script executable on Unix?", "Why are floating-point results inexact?"):
            plain = eng.ask(question, k=3, sampling=GREEDY, use_cache=False)
            piped = eng.ask(question, k=3, sampling=GREEDY, pipelined=True, num_stages=4)
            assert piped.token_ids == plain.token_ids and piped.documents == plain.documents
            assert piped.search_s > 0 and plain.search_s > 0
        settled(eng)
    finally:
        eng.close(cancel=True)


def test_cancel_while_the_final_documents_are_generated(engine):
    """No speculation (max_prefill_bs 0): the task is cancelled after the search, while the final
    documents' answer is being generated; it is cancelled and freed too."""
    slow = SamplingParams(max_tokens=2000, stop=())

    async def main():
        task = asyncio.ensure_future(engine.agenerate_pipelined(Q, stages([A, B]), slow, max_prefill_bs=0))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    t0 = time.perf_counter()
    asyncio.run(main())
    assert time.perf_counter() - t0 < 5
    settled(engine)
