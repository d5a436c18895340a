"""The serving engine with the tiny model: batching equals unbatched greedy, no request lost,
no KV block leaked after cancel or error, budgets held, and a bounded burst of requests."""

from __future__ import annotations

import asyncio
import random

import pytest

from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.errors import CacheBudgetError, RequestCancelledError
from ragcache_backend.model.sampling import SamplingParams
from tests.engine.leaks import assert_at_baseline as _at_baseline, node_blocks as _node_blocks
from ragcache_backend.engine.scheduler import SchedulerConfig
from ragcache_backend.engine.serving import EngineClosedError, ServingEngine

DOCS = [
    f"Document {i}: the {w} module of the standard library handles {w} tasks; see section {i * 7} "
    f"for the {w} API, its exceptions and the examples of {w} use in scripts."
    for i, w in enumerate(["json", "csv", "pathlib", "asyncio", "socket", "re", "heapq", "bisect"])
]
QUESTIONS = ["How do I parse it?", "What does it raise?", "Is it thread-safe?", "Where are examples?"]


def _engine(tiny_model, fixed_profile, *, device_blocks=256, host_bytes=1 << 20, policy="pgdsf", cache=True):
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # layers * kv_heads * head_dim * fp32 * K/V, 16 tokens
    cfg = EngineConfig(device_budget_bytes=device_blocks * block_bytes, host_budget_bytes=host_bytes,
                       policy=policy, enable_cache=cache, threads=1)
    return RAGCacheEngine(cfg, loaded=tiny_model, profile=fixed_profile)


def _requests(n, seed=0, k=2):
    rng = random.Random(seed)
    return [(rng.choice(QUESTIONS), rng.sample(DOCS[:5], k)) for _ in range(n)]


@pytest.mark.parametrize("reorder", [True, False])
def test_batched_greedy_equals_unbatched_engine(tiny_model, fixed_profile, reorder):
    reqs = _requests(10, seed=1)
    sampling = SamplingParams(max_tokens=6)
    ref_engine = _engine(tiny_model, fixed_profile)
    expected = [ref_engine.generate(q, d, sampling).token_ids for q, d in reqs]
    engine = _engine(tiny_model, fixed_profile)
    with ServingEngine(engine, SchedulerConfig(max_batch_size=4, max_batch_tokens=512, reorder=reorder)) as srv:
        handles = [srv.submit(q, d, sampling) for q, d in reqs]
        results = [h.result(timeout=120) for h in handles]
    assert [r.token_ids for r in results] == expected
    assert sum(r.cached_tokens > 0 for r in results) > 0
    assert max(max(h.metrics.batch_sizes) for h in handles) > 1  # requests really shared steps
    for h in handles:
        assert all(b <= 4 for b in h.metrics.batch_sizes)
    _at_baseline(engine)


def test_cancel_pending_and_running_frees_blocks(tiny_model, fixed_profile):
    engine = _engine(tiny_model, fixed_profile)
    texts: dict[int, list[str]] = {}
    with ServingEngine(engine, SchedulerConfig(max_batch_size=2)) as srv:
        long = SamplingParams(max_tokens=400)
        handles = []
        for i, (q, d) in enumerate(_requests(6, seed=2)):
            texts[i] = []
            handles.append(srv.submit(q, d, long, on_text=texts[i].append))
        for h in handles:
            h.cancel()
        for h in handles:
            with pytest.raises(RequestCancelledError):
                h.result(timeout=60)
    _at_baseline(engine)


def test_forward_error_fails_the_step_and_frees_blocks(tiny_model, fixed_profile, monkeypatch):
    engine = _engine(tiny_model, fixed_profile)
    real_forward = engine.runner.forward_step
    calls = {"n": 0}

    def flaky(batch, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return real_forward(batch, **kw)

    monkeypatch.setattr(engine.runner, "forward_step", flaky)
    with ServingEngine(engine, SchedulerConfig(max_batch_size=3)) as srv:
        handles = [srv.submit(q, d, SamplingParams(max_tokens=5)) for q, d in _requests(8, seed=3)]
        outcomes = []
        for h in handles:
            try:
                h.result(timeout=120)
                outcomes.append("ok")
            except RuntimeError as exc:
                assert "injected" in str(exc)
                outcomes.append("error")
    assert "error" in outcomes and "ok" in outcomes
    _at_baseline(engine)


def test_request_too_large_for_device_gets_a_clear_error(tiny_model, fixed_profile):
    engine = _engine(tiny_model, fixed_profile, device_blocks=8)  # 128 tokens of KV
    with ServingEngine(engine) as srv:
        h = srv.submit(QUESTIONS[0], DOCS[:4], SamplingParams(max_tokens=4))
        with pytest.raises(CacheBudgetError, match="device"):
            h.result(timeout=60)
        ok = srv.submit(QUESTIONS[0], [], SamplingParams(max_tokens=2)).result(timeout=60)
        assert ok.token_ids
    _at_baseline(engine)


def test_closed_engine_refuses_and_async_api_works(tiny_model, fixed_profile):
    engine = _engine(tiny_model, fixed_profile)
    srv = ServingEngine(engine)

    async def go():
        res = await srv.agenerate(QUESTIONS[1], DOCS[:2], SamplingParams(max_tokens=4))
        chunks = [c async for c in srv.astream(QUESTIONS[1], DOCS[:2], SamplingParams(max_tokens=4))]
        return res, chunks

    res, chunks = asyncio.run(go())
    assert chunks[-1].result is not None
    assert chunks[-1].result.token_ids == res.token_ids
    assert "".join(c.text for c in chunks) == res.answer
    assert chunks[-1].result.cached_tokens > 0  # the second call reused the documents' KV
    srv.close()
    with pytest.raises(EngineClosedError):
        srv.submit(QUESTIONS[0], DOCS[:1])
    _at_baseline(engine)


def test_bounded_burst_of_hundreds_loses_nothing(tiny_model, fixed_profile):
    """300 concurrent requests into a small device tier: each answered or a clear error."""
    engine = _engine(tiny_model, fixed_profile, device_blocks=96, host_bytes=256 * 1024)
    baseline_blocks = engine.cache.device_used_blocks
    reqs = _requests(300, seed=4, k=3)
    rng = random.Random(5)
    with ServingEngine(engine, SchedulerConfig(max_batch_size=8, max_batch_tokens=1024, window=16)) as srv:
        handles = [srv.submit(q, d, SamplingParams(max_tokens=rng.randint(1, 4))) for q, d in reqs]
        for h in handles[::37]:
            h.cancel()
        answered = errors = cancelled = 0
        for h in handles:
            try:
                r = h.result(timeout=300)
                assert r.token_ids or r.finish_reason == "stop"
                answered += 1
            except RequestCancelledError:
                cancelled += 1
            except CacheBudgetError:
                errors += 1
        assert srv.in_flight == 0
    assert answered + errors + cancelled == 300
    assert answered >= 250
    assert srv.stats.finished == answered
    _at_baseline(engine)
    assert engine.cache.device_used_blocks <= engine.cache.num_device_blocks
    assert engine.cache.host_used_bytes <= 256 * 1024
    engine.reset_cache()
    assert engine.cache.device_used_blocks == baseline_blocks == 0


@pytest.mark.parametrize("reuse", ["auto", "chunk"])
def test_chunk_mode_burst_with_cancellations_loses_nothing_and_leaks_nothing(tiny_model, fixed_profile, reuse):
    """200 concurrent chunk-mode requests, documents in varying order, into a small device tier with
    a host tier: variants are reused, evicted, swapped; cancelled ones free everything."""
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16
    cfg = EngineConfig(device_budget_bytes=96 * block_bytes, host_budget_bytes=256 * 1024, threads=1, reuse=reuse,
                       chunk_guard=0.05, chunk_variants_per_chunk=2, chunk_max_variants=12)
    engine = RAGCacheEngine(cfg, loaded=tiny_model, profile=fixed_profile)
    rng = random.Random(7)
    reqs = [(rng.choice(QUESTIONS), rng.sample(DOCS, rng.randint(2, 4))) for _ in range(200)]
    handles = [engine.submit(q, d, SamplingParams(max_tokens=rng.randint(1, 4)), question_first=rng.random() < 0.5)
               for q, d in reqs]
    for h in handles[::23]:
        h.cancel()
    outcomes = {"answered": 0, "cancelled": 0, "errors": 0}
    hits = 0
    for h in handles:
        try:
            r = h.result(timeout=300)
            outcomes["answered"] += 1
            hits += r.chunk_hits > 0
            assert r.cached_tokens + r.computed_tokens == r.prompt_tokens and r.computed_tokens >= 1
        except RequestCancelledError:
            outcomes["cancelled"] += 1
        except CacheBudgetError:
            outcomes["errors"] += 1
    assert sum(outcomes.values()) == 200 and outcomes["answered"] >= 170, outcomes
    assert hits > 0 and engine.cache.stats.variant_hits > 0
    assert engine.cache.num_variants <= 12
    engine.wait_idle(30)
    _at_baseline(engine)
    engine.close()
