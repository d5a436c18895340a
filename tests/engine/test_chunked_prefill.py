"""Chunked prefill and mixed steps (vLLM's and SGLang's per-step token budget) through the engine,
on the random tiny Llama (fp32) and, once, on the real default model.

A prompt longer than the step's budget is computed over several steps while running requests keep
decoding; its answer and first-token logits equal the unchunked ones (and cached equals uncached);
the documents and blocks each chunk completes are in the knowledge tree (and queued for the disk
tier) before the prompt finishes; a request cancelled between chunks leaves only whole, exact
nodes; a forward that fails mid-prefill is retried by recomputation; a chunk-mode prompt still
runs whole. No timing is asserted: a wrapper around ``runner.forward_step`` records each step's
rows on the loop's own thread.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.engine.scheduler import SchedulerConfig
from ragcache_backend.errors import InvalidRequestError, RequestCancelledError
from ragcache_backend.model.sampling import SamplingParams
from ragcache_backend.prompts.builder import SegmentKind
from tests.engine.leaks import assert_at_baseline
from tests.engine.test_engine_loop import BLOCK_BYTES, DOCS

BUDGET = 37  # tokens per step: the test prompts (~270-400 tokens) take many chunks, cut inside documents
Q = "Which module handles which task, and where are the examples?"
GREEDY = SamplingParams(max_tokens=10)


@pytest.fixture()
def make(tiny_model, fixed_profile):
    """Engines on the tiny model (``budget``: the step's token budget, default the config's 4096),
    closed at teardown."""
    made: list[RAGCacheEngine] = []

    def build(*, budget: int | None = None, batch: int = 4, **overrides) -> RAGCacheEngine:
        cfg = EngineConfig(device_budget_bytes=512 * BLOCK_BYTES, host_budget_bytes=1 << 20, threads=1, **overrides)
        sched = SchedulerConfig(max_batch_size=batch, max_batch_tokens=budget) if budget else None
        engine = RAGCacheEngine(cfg, loaded=tiny_model, profile=fixed_profile, scheduler=sched)
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.close(cancel=True, timeout=30)


class Steps:
    """Wraps ``engine.runner.forward_step``: records every step's rows (decode rows, prompt rows
    per prefill) on the loop thread, and calls ``before(inputs)`` first when given."""

    def __init__(self, engine: RAGCacheEngine, monkeypatch, before=None) -> None:
        self.decode_rows: list[int] = []
        self.prompt_rows: list[tuple[int, ...]] = []
        self.before = before
        real = engine.runner.forward_step

        def forward(inputs, **kw):
            if self.before is not None:
                self.before(inputs)
            self.decode_rows.append(sum(1 for i in inputs if i.decode))
            self.prompt_rows.append(tuple(len(i.new_tokens) for i in inputs if not i.decode))
            return real(inputs, **kw)

        monkeypatch.setattr(engine.runner, "forward_step", forward)


def _lead(engine: RAGCacheEngine, question: str, docs, sampling=GREEDY):
    segs, _ = engine.segments_for(question, docs, sampling)
    return segs, engine.prompt_plan(segs).lead


def _matched(engine: RAGCacheEngine, lead) -> int:
    """Lead segments of a prompt the tree holds now (exact: tokens compared)."""
    return len(engine.cache.match([s.key for s in lead], tokens=[s.token_ids for s in lead]).nodes)


def _idle_at_baseline(engine: RAGCacheEngine) -> None:
    assert engine.wait_idle(20)
    assert_at_baseline(engine)


# ---- chunk inputs over plain data ----------------------------------------------------------------------
def _slots(runs, block_size: int) -> list[int]:
    return [r.blocks[(r.start + i) // block_size] * block_size + (r.start + i) % block_size
            for r in runs for i in range(r.length)]


def test_chunk_inputs_split_the_whole_prefill_and_see_every_earlier_chunk():
    from ragcache_backend.cache.chunk_reuse import RecomputeRule
    from ragcache_backend.cache.tiers import TieredCache
    from ragcache_backend.engine import batch
    from ragcache_backend.prompts.builder import PromptPlan, Segment, SegmentKind
    from tests.cache.sim_mover import SimulatedMover

    bs = 4
    cache = TieredCache(32, bs, 0, SimulatedMover(), policy="lru")
    a = Segment(tuple(range(10, 16)), SegmentKind.PREFIX, cacheable=True)
    b = Segment(tuple(range(20, 25)), SegmentKind.DOCUMENT, cacheable=True)
    c = Segment(tuple(range(30, 33)), SegmentKind.DOCUMENT, cacheable=True)
    warm = cache.admit(batch.lead_specs([a], chunks=False), tail_tokens=1)
    cache.commit(warm, rest_tokens=1)
    cache.finish(warm)
    plan = PromptPlan((a, b, c), (1, 2, 3))
    lease = cache.admit(batch.lead_specs(plan.lead, chunks=False), tail_tokens=5)
    assert lease.reused == 1 and batch.prefill_tokens(plan, lease) == 5 + 3 + 3
    whole, _ = batch.prefill_input(plan, lease, rule=RecomputeRule())
    one = batch.prefill_chunk_input(plan, lease, 0, 11)
    assert one.new_tokens == whole.new_tokens and one.cached == whole.cached
    assert _slots(one.target, bs) == _slots(whole.target, bs)
    cached, target = _slots(whole.cached, bs), _slots(whole.target, bs)
    tokens: list[int] = []
    for start, count in [(0, 4), (4, 3), (7, 4)]:  # cut inside b, at b's end, then c and the rest
        item = batch.prefill_chunk_input(plan, lease, start, count)
        tokens.extend(item.new_tokens)
        assert _slots(item.cached, bs) == cached + target[:start]  # the prefix, then every earlier chunk
        assert _slots(item.target, bs) == target[start:start + count]
    assert tuple(tokens) == whole.new_tokens == b.token_ids + c.token_ids + plan.rest
    assert [batch.complete_pieces(lease, n) for n in (0, 4, 5, 7, 8, 11)] == [0, 0, 1, 1, 2, 2]
    for start, count in [(-1, 2), (0, 0), (10, 2)]:
        with pytest.raises(InvalidRequestError):
            batch.prefill_chunk_input(plan, lease, start, count)
    cache.finish(lease)
    cache.check_invariants()


# ---- exactness --------------------------------------------------------------------------------------
def test_chunked_prefill_equals_the_whole_prefill_cached_and_uncached(make, monkeypatch):
    whole, chunked = make(), make(budget=BUDGET)
    segs, lead = _lead(whole, Q, DOCS[:6])
    prompt = sum(len(s) for s in segs)
    ref_logits, _ = whole.first_token_logits(segs, use_cache=False)
    ref = whole.generate(Q, DOCS[:6], GREEDY, use_cache=False)
    steps = Steps(chunked, monkeypatch)

    logits, cached = chunked.first_token_logits(segs, use_cache=False)
    assert cached == 0 and len(steps.prompt_rows) == math.ceil(prompt / BUDGET) > 5  # cut into chunks
    assert all(sum(rows) <= BUDGET for rows in steps.prompt_rows)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    miss = chunked.generate(Q, DOCS[:6], GREEDY)  # a chunked miss that commits chunk by chunk
    hit = chunked.generate(Q, DOCS[:6], GREEDY)  # the whole prompt but its last token from the tree
    assert miss.cached_tokens == 0 and hit.cached_tokens == prompt - 1
    assert miss.token_ids == hit.token_ids == ref.token_ids
    logits, cached = chunked.first_token_logits(segs, use_cache=True)
    assert cached == prompt - 1
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)

    # a partial hit: the first documents from the tree, the rest chunked over them
    other_q, other_docs = "Is any of them thread-safe?", DOCS[:3] + DOCS[6:8]
    other_segs, _ = _lead(whole, other_q, other_docs)
    other_ref, _ = whole.first_token_logits(other_segs, use_cache=False)
    n0 = len(steps.prompt_rows)
    logits, cached = chunked.first_token_logits(other_segs, use_cache=True)
    computed = sum(len(s) for s in other_segs) - cached
    assert cached > 0 and len(steps.prompt_rows) - n0 == math.ceil(computed / BUDGET) > 1
    torch.testing.assert_close(logits, other_ref, rtol=0, atol=1e-4)
    assert chunked.generate(other_q, other_docs, GREEDY).token_ids == whole.generate(
        other_q, other_docs, GREEDY, use_cache=False).token_ids
    _idle_at_baseline(chunked)


# ---- mixed steps --------------------------------------------------------------------------------------
def test_running_requests_keep_decoding_while_a_long_prompt_is_prefilled(make, monkeypatch):
    engine = make(budget=64)
    engine.stop_ids = frozenset()  # A ends by length only: it decodes through B's whole prefill
    a = engine.submit("Short?", DOCS[:1], SamplingParams(max_tokens=400))
    generated: list[int] = []  # A's tokens as each step starts, read on the loop thread
    steps = Steps(engine, monkeypatch, before=lambda _inputs: generated.append(a.metrics.generated_tokens))
    while a.metrics.first_token == 0.0:
        assert not a.done()
        time.sleep(0.001)
    n0 = len(steps.prompt_rows)
    b = engine.submit(Q, DOCS, SamplingParams(max_tokens=2)).result(timeout=60)
    chunked = [i for i, rows in enumerate(steps.prompt_rows) if rows and i >= n0]
    first, last = chunked[0], chunked[-1]
    assert last - first + 1 == len(chunked) == math.ceil(b.computed_tokens / 63) > 3
    for i in range(first, last + 1):  # every step of B's prefill: A's decode row, within the budget
        assert steps.decode_rows[i] == 1 and steps.decode_rows[i] + sum(steps.prompt_rows[i]) <= 64
    assert generated[last + 1] - generated[first] == last - first + 1  # A got a token in each of them
    assert not a.done()
    a.cancel()
    with pytest.raises(RequestCancelledError):
        a.result(timeout=20)
    _idle_at_baseline(engine)


# ---- per-chunk commit -----------------------------------------------------------------------------------
def test_each_chunk_commits_what_it_completed_before_the_prompt_finishes(make, monkeypatch, tmp_path):
    engine = make(budget=BUDGET, disk_dir=tmp_path / "kv")
    _, lead = _lead(engine, Q, DOCS)
    seen: list[tuple[int, int]] = []  # (lead segments in the tree, nodes queued for disk) while B prefills
    pool: list[int] = []  # Algorithm 2's pool meanwhile: B waits for prefill until its last chunk
    holder: dict[str, object] = {}

    def before(_inputs):
        b = holder.get("b")
        if b is not None and b.metrics.first_token == 0.0 and b.metrics.computed_tokens > 0:
            seen.append((_matched(engine, lead), engine.cache.stats.disk_queued))
            pool.append(engine.waiting_requests)

    Steps(engine, monkeypatch, before=before)
    holder["b"] = b = engine.submit(Q, DOCS, GREEDY)
    result = b.result(timeout=60)
    matched = [m for m, _ in seen]
    assert len(seen) > 5 and matched == sorted(matched)  # segments join the tree chunk by chunk,
    assert 0 < matched[len(matched) // 2] and matched[0] < matched[-1]  # long before the last chunk
    assert max(q for _, q in seen) > 0  # and the disk tier got them before the prompt finished
    assert set(pool) == {1} and engine.waiting_requests == 0
    assert _matched(engine, lead) == len(lead) and result.cached_tokens == 0
    _idle_at_baseline(engine)
    again = engine.generate(Q, DOCS, GREEDY)
    assert again.token_ids == result.token_ids and again.cached_tokens == result.prompt_tokens - 1
    _idle_at_baseline(engine)


def test_cancel_between_chunks_keeps_only_whole_exact_nodes(make, monkeypatch):
    reference = make()
    engine = make(budget=BUDGET)
    segs, lead = _lead(engine, Q, DOCS)
    ref_logits, _ = reference.first_token_logits(segs, use_cache=False)
    cancel = threading.Event()
    holder: dict[str, object] = {}

    def before(_inputs):  # once two segments are committed and chunks remain: cancel
        b = holder.get("b")
        if b is not None and b.metrics.first_token == 0.0 and _matched(engine, lead) >= 2:
            cancel.set()

    steps = Steps(engine, monkeypatch, before=before)
    holder["b"] = b = engine.submit(Q, DOCS, GREEDY, cancel=cancel)
    with pytest.raises(RequestCancelledError):
        b.result(timeout=60)
    assert b.metrics.first_token == 0.0 and 0 < b.metrics.computed_tokens < sum(len(s) for s in segs)
    _idle_at_baseline(engine)  # lease released: no block, no lock left
    kept = _matched(engine, lead)
    assert 2 <= kept < len(lead) and len(engine.cache.tree) == kept  # only whole segments of its prefix
    for node, seg in zip(engine.cache.match([s.key for s in lead]).nodes, lead):
        assert node.num_tokens == len(seg) and tuple(node.tokens) == tuple(seg.token_ids)
    n0 = len(steps.prompt_rows)
    logits, cached = engine.first_token_logits(segs, use_cache=True)  # over the kept nodes: exact KV
    assert cached == sum(len(s) for s in lead[:kept]) and len(steps.prompt_rows) > n0
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    _idle_at_baseline(engine)


def test_a_forward_failing_mid_prefill_is_retried_by_recomputation(make, monkeypatch):
    reference = make()
    engine = make(budget=BUDGET)
    ref = reference.generate(Q, DOCS[:5], GREEDY, use_cache=False)
    _, lead = _lead(engine, Q, DOCS[:5])
    chunks = []

    def before(inputs):
        if any(not i.decode for i in inputs):
            chunks.append(len(chunks))
            if len(chunks) == 3:  # the third chunk's forward fails (a device error, say)
                raise RuntimeError("injected forward failure")

    Steps(engine, monkeypatch, before=before)
    result = engine.generate(Q, DOCS[:5], GREEDY)
    assert engine.stats.retried == 1 and engine.stats.failed == 0
    assert result.token_ids == ref.token_ids and result.cached_tokens == 0  # recomputed, nothing reused
    assert 0 < _matched(engine, lead) < len(lead)  # the first two chunks' whole segments stayed, exact
    _idle_at_baseline(engine)
    assert engine.generate(Q, DOCS[:5], GREEDY).token_ids == ref.token_ids
    _idle_at_baseline(engine)


# ---- what is not chunked ----------------------------------------------------------------------------------
def test_a_chunk_mode_prompt_longer_than_the_budget_runs_whole_in_one_step(make, monkeypatch):
    reference = make()
    engine = make(budget=BUDGET)
    ref = reference.generate(Q, DOCS[:4], GREEDY, use_cache=False)
    steps = Steps(engine, monkeypatch)
    result = engine.generate(Q, DOCS[:4], GREEDY, reuse="chunk")
    assert result.token_ids == ref.token_ids and result.computed_tokens == result.prompt_tokens
    prompt_steps = [rows for rows in steps.prompt_rows if rows]
    assert prompt_steps == [(result.prompt_tokens,)]  # alone, over the budget, in one forward
    _idle_at_baseline(engine)


# ---- the real default model --------------------------------------------------------------------------------
@pytest.mark.model
def test_real_model_chunked_prefill_equals_whole(real_model, fixed_profile):
    docs = ["The global interpreter lock lets one thread run Python bytecode at a time; C extensions "
            "may release it around long computations. " * 3,
            "A decorator is a callable that takes a function and returns a replacement function. " * 3]
    question = "Can two threads run Python bytecode at once?"
    sampling = SamplingParams(max_tokens=8)
    cfg = EngineConfig(device_budget_bytes=64 << 20, host_budget_bytes=64 << 20)
    whole = RAGCacheEngine(cfg, loaded=real_model, profile=fixed_profile)
    chunked = RAGCacheEngine(cfg, loaded=real_model, profile=fixed_profile, scheduler=SchedulerConfig(max_batch_tokens=48))
    try:
        segs, _ = whole.segments_for(question, docs, sampling)
        assert sum(len(s) for s in segs) > 3 * 48
        ref, _ = whole.first_token_logits(segs, use_cache=False)
        logits, _ = chunked.first_token_logits(segs, use_cache=False)
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
        off = whole.generate(question, docs, sampling, use_cache=False)
        assert chunked.generate(question, docs, sampling).token_ids == off.token_ids  # a chunked miss
        hit = chunked.generate(question, docs, sampling)
        assert hit.cached_tokens > 0 and hit.token_ids == off.token_ids
    finally:
        whole.close()
        chunked.close()


# ---- a burst sharing a new document ----------------------------------------------------------------------
def _admitted_together(engine: RAGCacheEngine, monkeypatch, *requests):
    """Greedy ``requests`` ((question, documents) pairs, submitted in that order) while the loop waits
    inside a step of a running request C ("Short?", 400 tokens; the engine's stop ids must be empty so
    it ends by length only): all of them reach the same admission. Returns the step recorder, its step
    count before them, C's handle (cancelled once they finished) and their results."""
    gate, parked = threading.Event(), threading.Event()
    gate.set()

    def before(_inputs):
        parked.set()
        assert gate.wait(30)

    steps = Steps(engine, monkeypatch, before=before)
    c = engine.submit("Short?", DOCS[:1], SamplingParams(max_tokens=400))
    while c.metrics.generated_tokens < 2:
        time.sleep(0.001)
    gate.clear()
    parked.clear()
    assert parked.wait(30)  # the loop waits inside a step
    n0 = len(steps.prompt_rows)
    handles = [engine.submit(q, docs, GREEDY) for q, docs in requests]
    gate.set()
    results = [h.result(timeout=60) for h in handles]
    c.cancel()
    return steps, n0, c, results


def test_two_requests_retrieving_the_same_new_documents_at_once_compute_them_once(make, monkeypatch):
    engine, plain = make(), make()
    engine.stop_ids = frozenset()  # C ends by length only: the loop keeps stepping
    docs, q2 = DOCS[2:5], "Which of them reads files?"
    ref_a = plain.generate(Q, docs, GREEDY, use_cache=False)
    ref_b = plain.generate(q2, docs, GREEDY, use_cache=False)
    steps, n0, c, (ra, rb) = _admitted_together(engine, monkeypatch, (Q, docs), (q2, docs))  # C caches the system prompt
    _, lead = _lead(engine, Q, docs)
    prefix = sum(len(s) for s in lead if s.kind is SegmentKind.PREFIX)  # the system prompt: cached by C
    documents = sum(len(s) for s in lead if s.kind is SegmentKind.DOCUMENT)
    first, second = sorted((ra, rb), key=lambda r: r.cached_tokens)  # reordering picks who goes first
    assert documents > 100 and first.cached_tokens == prefix and second.cached_tokens == prefix + documents
    prefills = [rows for rows in steps.prompt_rows[n0:] if rows]  # one prefill of the documents alone,
    assert prefills == [(first.prompt_tokens - prefix,), (second.prompt_tokens - prefix - documents,)]  # the other over them
    assert ra.token_ids == ref_a.token_ids and rb.token_ids == ref_b.token_ids
    with pytest.raises(RequestCancelledError):
        c.result(timeout=20)
    _idle_at_baseline(engine)


def test_a_full_hits_one_token_row_comes_after_the_steps_multi_token_chunks(make, monkeypatch):
    engine, plain = make(), make()
    engine.stop_ids = frozenset()  # C ends by length only: the loop keeps stepping
    hit_docs, new_docs, q2 = DOCS[:3], DOCS[4:7], "Which of them reads files?"
    ref_hit = plain.generate(Q, hit_docs, GREEDY, use_cache=False)
    ref_new = plain.generate(q2, new_docs, GREEDY, use_cache=False)
    assert engine.generate(Q, hit_docs, GREEDY).token_ids == ref_hit.token_ids  # now cached whole
    steps, n0, c, (rh, rn) = _admitted_together(engine, monkeypatch, (Q, hit_docs), (q2, new_docs))  # the hit first
    assert rh.cached_tokens == rh.prompt_tokens - 1 and rn.prompt_tokens - rn.cached_tokens > 1
    # admitted in one step, the hit's one row after the other prefill's rows, then C's decode row
    step = next(i for i in range(n0, len(steps.prompt_rows)) if 1 in steps.prompt_rows[i])
    assert steps.prompt_rows[step] == (rn.prompt_tokens - rn.cached_tokens, 1) and steps.decode_rows[step] == 1
    for rows in steps.prompt_rows:
        assert list(rows) == sorted(rows, key=lambda n: n == 1)  # no one-token chunk before a longer one
    assert rh.token_ids == ref_hit.token_ids and rn.token_ids == ref_new.token_ids
    with pytest.raises(RequestCancelledError):
        c.result(timeout=20)
    _idle_at_baseline(engine)
