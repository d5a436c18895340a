"""Chunk-cache mode through the engine on a random tiny Llama (fp32): reuse at any position, the
exactness limits (recompute everything = full recomputation), the guard, bad input, no leaks."""

from __future__ import annotations

import math
import time

import pytest
import torch

from ragcache_backend.cache.chunk_reuse import RecomputeRule
from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.errors import ContextWindowError, InvalidRequestError
from ragcache_backend.model.sampling import SamplingParams
from ragcache_backend.prompts.builder import SegmentKind

DOCS = [
    "The global interpreter lock (GIL) lets one thread run Python bytecode at a time. " * 6,
    "Lists are mutable sequences; tuples are immutable and can be dictionary keys. " * 6,
    "A decorator is a callable that takes a function and returns a replacement. " * 6,
    "Generators produce values lazily with yield and keep their frame between calls. " * 6,
]
GREEDY = SamplingParams(max_tokens=8)


def make(model, profile, **kw) -> RAGCacheEngine:
    cfg = dict(device_budget_bytes=8 * 1024 * 1024, host_budget_bytes=16 * 1024 * 1024, reuse="auto", chunk_guard=None,
               chunk_fresh_above=1.0, chunk_alpha=1.0)
    cfg.update(kw)
    return RAGCacheEngine(EngineConfig(**cfg), loaded=model, profile=profile)


def assert_clean(engine: RAGCacheEngine) -> None:
    engine.cache.check_invariants()
    assert engine.cache.locked_nodes == 0 and engine.cache.request_blocks == 0


def test_documents_in_another_order_are_served_from_chunk_variants(tiny_model, fixed_profile):
    eng = make(tiny_model, fixed_profile)
    first = eng.generate("What is the GIL?", DOCS[:3], GREEDY)
    assert first.reuse == "auto" and first.chunk_hits == 0 and eng.cache.num_variants == 3
    # D1 and D2 lost D0 from their context, D0 gained context: every variant reused, some tokens recomputed
    again = eng.generate("Why are tuples hashable?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY)
    assert again.chunk_hits == 3 and again.chunk_cached_tokens > 0
    assert again.cached_tokens == again.prompt_tokens - again.computed_tokens
    assert again.computed_tokens >= again.recomputed_tokens > 0
    # per chunk, in prompt order: what was reused and how it was fixed (no guard: nothing measured)
    rec = again.chunk_reuse
    assert len(rec) == 3 and [r.position for r in rec] == sorted(r.position for r in rec)
    assert sum(r.recomputed_tokens for r in rec) == again.recomputed_tokens
    assert sum(r.tokens - r.recomputed_tokens for r in rec) == again.chunk_cached_tokens
    assert all(0.0 <= r.cfo <= 1.0 and r.deviation is None and r.attention is None and not r.guarded for r in rec)
    assert all(r.recomputed_tokens == min(r.tokens, math.ceil(r.cfo * r.tokens - 1e-9)) for r in rec)  # eq. 14
    exact = eng.generate("Why are tuples hashable?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY, reuse="exact")
    assert exact.chunk_hits == 0 and exact.cached_tokens < again.cached_tokens  # the tree alone: the system prompt
    assert exact.chunk_reuse == ()
    assert_clean(eng)


def test_recomputing_every_token_of_reused_chunks_equals_full_recomputation(tiny_model, fixed_profile):
    eng = make(tiny_model, fixed_profile, chunk_recompute="all")
    eng.generate("What is the GIL?", DOCS[:3], GREEDY)
    segs, _ = eng.segments_for("Tell me about decorators.", [DOCS[1], DOCS[3], DOCS[0], DOCS[2]], GREEDY)
    ref, cached0 = eng.first_token_logits(segs, use_cache=False)
    assert cached0 == 0
    got, cached = eng.first_token_logits(segs, store=False)
    assert cached > 0  # the system prompt, exactly; every document token recomputed
    assert (got - ref).abs().max().item() < 1e-4
    on = eng.generate("Tell me about decorators.", [DOCS[1], DOCS[3], DOCS[0], DOCS[2]], GREEDY)
    off = eng.generate("Tell me about decorators.", [DOCS[1], DOCS[3], DOCS[0], DOCS[2]], GREEDY, use_cache=False)
    assert on.chunk_hits == 3 and on.token_ids == off.token_ids
    assert_clean(eng)


def test_full_reuse_without_recomputation_differs_and_the_rules_order_by_cost(tiny_model, fixed_profile):
    eng = make(tiny_model, fixed_profile)
    eng.generate("What is the GIL?", DOCS[:3], GREEDY)
    segs, _ = eng.segments_for("And lists?", [DOCS[2], DOCS[1], DOCS[0]], GREEDY)
    ref, _ = eng.first_token_logits(segs, use_cache=False)
    none, _ = eng.first_token_logits(segs, store=False, recompute=RecomputeRule("none"))
    assert (none - ref).abs().max().item() > 1e-4  # reused KV is approximate: the test is not vacuous
    handle = eng.submit_segments(segs, GREEDY, recompute=RecomputeRule("leading", leading=8), store=False)
    lead = handle.result()
    assert lead.recomputed_tokens == 8 * 3 and lead.chunk_hits == 3
    every = eng.submit_segments(segs, GREEDY, recompute=RecomputeRule("all"), store=False).result()
    assert every.chunk_cached_tokens == 0 and every.recomputed_tokens == sum(len(s) for s in segs if s.doc_id)
    assert_clean(eng)


def test_chunk_mode_takes_documents_from_variants_and_exact_mode_never_does(tiny_model, fixed_profile):
    eng = make(tiny_model, fixed_profile, reuse="chunk")
    eng.generate("What is the GIL?", DOCS[:2], GREEDY)
    rep = eng.generate("What is the GIL?", DOCS[:2], GREEDY)
    assert rep.chunk_hits == 2 and rep.recomputed_tokens == 0  # same context: CFO 0, RoPE delta 0
    ex = eng.generate("What is the GIL?", DOCS[:2], GREEDY, reuse="exact")
    assert ex.chunk_hits == 0 and ex.cached_tokens == ex.prompt_tokens - 1
    assert_clean(eng)


def test_the_guard_recomputes_a_chunk_that_moved_too_far(tiny_model, fixed_profile):
    eng = make(tiny_model, fixed_profile, chunk_guard=1e-6, chunk_recompute="share", chunk_share=0.2)
    eng.generate("What is the GIL?", DOCS[:3], GREEDY)
    segs, _ = eng.segments_for("What is the GIL?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY)
    ref, _ = eng.first_token_logits(segs, use_cache=False)
    res = eng.submit_segments(segs, GREEDY, keep_logits=True)
    out = res.result()
    assert out.guarded_chunks == 3 and out.chunk_hits == 0 and out.recomputed_tokens == 0
    # the records keep what the guard saw before its second pass: every chunk measured and flagged
    assert len(out.chunk_reuse) == 3 and all(r.guarded and r.deviation > 1e-6 for r in out.chunk_reuse)
    assert all(0.0 < r.attention < 1.0 for r in out.chunk_reuse) and sum(r.attention for r in out.chunk_reuse) < 1.0
    assert max(r.deviation * r.attention for r in out.chunk_reuse) == pytest.approx(out.chunk_deviation, rel=1e-6)
    assert (res.first_logits - ref).abs().max().item() < 1e-4  # every chunk recomputed: exact again
    assert eng.cache.num_variants > 3  # the recomputed chunks are kept as variants for this context
    assert_clean(eng)


def test_the_guard_weighs_each_chunks_deviation_by_the_attention_the_answer_gives_it(tiny_model, fixed_profile):
    """A chunk is flagged when its recomputed tokens' deviation times the last prompt token's
    attention to it exceeds the threshold: with a threshold between two chunks' products, exactly
    the chunks above it are recomputed, whatever their deviation alone."""
    from ragcache_backend.engine import batch

    assert batch.guard_signals({0: 0.3, 1: 0.1, 2: 0.2}, {0: 0.01, 1: 0.5}) == pytest.approx({0: 0.003, 1: 0.05, 2: 0.2})
    assert batch.guard_flags({0: 0.003, 1: 0.05}, 0.012) == frozenset({1}) and batch.guard_flags({0: 1.0}, None) == frozenset()
    measure = make(tiny_model, fixed_profile, chunk_guard=1e9, chunk_recompute="share", chunk_share=0.2)
    measure.generate("What is the GIL?", DOCS[:3], GREEDY)
    segs, _ = measure.segments_for("What is the GIL?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY)
    seen = measure.submit_segments(segs, GREEDY, store=False).result().chunk_reuse
    products = sorted(r.deviation * r.attention for r in seen)
    assert len(products) == 3 and not any(r.guarded for r in seen)
    threshold = (products[1] + products[2]) / 2  # only the chunk with the largest product is above
    eng = make(tiny_model, fixed_profile, chunk_guard=threshold, chunk_recompute="share", chunk_share=0.2)
    eng.generate("What is the GIL?", DOCS[:3], GREEDY)
    out = eng.submit_segments(segs, GREEDY, store=False).result()
    assert out.guarded_chunks == 1 and out.chunk_hits == 2
    assert [r.guarded for r in out.chunk_reuse] == [r.deviation * r.attention > threshold for r in seen]
    assert_clean(eng)


def test_past_the_segment_cap_the_guard_measures_chunks_in_groups_not_by_deviation_alone(tiny_model, fixed_profile,
                                                                                         monkeypatch):
    """More reused chunks (and text between them) than the runner measures segments for: neighbouring
    spans are measured together and each chunk gets its group's attention (an upper bound on its
    own), so the guard's product stays on the scale its threshold was set for."""
    from ragcache_backend.engine import batch

    def seen(cap: int | None):
        eng = make(tiny_model, fixed_profile, chunk_guard=1e9, chunk_recompute="share", chunk_share=0.2)
        eng.generate("What is the GIL?", DOCS[:3], GREEDY)
        segs, _ = eng.segments_for("What is the GIL?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY)
        if cap is not None:  # the variants were recorded under the real cap; this request measures under a lower one
            monkeypatch.setattr(batch, "MAX_STAT_SEGMENTS", cap)
        out = eng.submit_segments(segs, GREEDY, store=False).result().chunk_reuse
        assert_clean(eng)
        return out

    own, grouped = seen(None), seen(2)  # three chunks and the text around them: more than 2 spans
    assert len(own) == len(grouped) == 3 and all(r.attention is not None for r in own + grouped)
    assert all(g.attention >= o.attention - 1e-6 for o, g in zip(own, grouped))  # a group's mass bounds its members'
    assert sum(set(r.attention for r in grouped)) <= 1.0 + 1e-6 and len(set(r.attention for r in grouped)) <= 2
    assert [r.deviation for r in grouped] == pytest.approx([r.deviation for r in own], rel=1e-5)


def test_a_retried_chunk_request_reports_no_chunk_records_of_its_failed_attempt(tiny_model, fixed_profile, monkeypatch):
    """The guard's second pass fails (a device error, say): the request is retried by recomputation
    in exact mode, and its result lists no chunk of the attempt that failed."""
    eng = make(tiny_model, fixed_profile, chunk_guard=1e-6, chunk_recompute="share", chunk_share=0.2)
    eng.generate("What is the GIL?", DOCS[:3], GREEDY)
    segs, _ = eng.segments_for("What is the GIL?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY)
    ref = eng.generate("What is the GIL?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY, use_cache=False)
    real, prefills = eng.runner.forward_step, []

    def forward(inputs, **kw):
        if any(not i.decode for i in inputs):
            prefills.append(1)
            if len(prefills) == 2:  # the guard's second pass
                raise RuntimeError("injected forward failure")
        return real(inputs, **kw)

    monkeypatch.setattr(eng.runner, "forward_step", forward)
    out = eng.submit_segments(segs, GREEDY).result()
    assert eng.stats.retried == 1 and len(prefills) == 3
    assert out.reuse == "exact" and out.chunk_hits == 0 and out.guarded_chunks == 0 and out.chunk_reuse == ()
    assert out.token_ids == ref.token_ids
    assert_clean(eng)


def test_the_guards_second_pass_starts_at_the_first_flagged_chunk_and_is_counted(tiny_model, fixed_profile, monkeypatch):
    eng = make(tiny_model, fixed_profile, chunk_guard=1e-6, chunk_recompute="share", chunk_share=0.2)
    eng.generate("What is the GIL?", DOCS[:3], GREEDY)
    forward = eng.runner.forward_step

    def slow(*a, **kw):  # every forward 0.3 s longer: the second pass must not count as scheduling
        time.sleep(0.3)
        return forward(*a, **kw)

    monkeypatch.setattr(eng.runner, "forward_step", slow)
    forward_before = eng.stats.forward_s
    # DOCS[0] is the tree's exact prefix, DOCS[3] is new (computed in full), DOCS[1] moved: reused, flagged
    docs = [DOCS[0], DOCS[3], DOCS[1]]
    segs, _ = eng.segments_for("What is the GIL?", docs, GREEDY)
    ref, _ = eng.first_token_logits(segs, use_cache=False)
    handle = eng.submit_segments(segs, GREEDY, keep_logits=True)
    out = handle.result()
    assert out.guarded_chunks == 1 and out.chunk_hits == 0
    assert (handle.first_logits - ref).abs().max().item() < 1e-4  # exact again
    doc_segs = [s for s in segs if s.kind is SegmentKind.DOCUMENT]
    new_doc, moved = len(doc_segs[1]), len(doc_segs[2])
    last_doc = max(i for i, s in enumerate(segs) if s.kind is SegmentKind.DOCUMENT)
    tail = sum(len(s) for s in segs[last_doc + 1:])
    # the first pass computed DOCS[3] in full, ~20% of DOCS[1] and the tail; the second pass redoes
    # DOCS[1]'s rows and the tail only (DOCS[3] keeps its KV)
    assert tail <= out.guard_tokens <= round(0.2 * moved) + 1 + tail and out.guard_tokens < new_doc
    assert out.computed_tokens == new_doc + moved + tail
    # the second pass is a forward: in guard_forward_s and the engine's forward_s, not in sched_s
    assert handle.metrics.guard_forward_s >= 0.3 and handle.metrics.sched_s < 0.3
    assert eng.stats.forward_s - forward_before >= 0.3 + handle.metrics.guard_forward_s
    unguarded = eng.submit_segments(eng.segments_for("What is the GIL?", DOCS[2:4], GREEDY)[0], GREEDY, reuse="exact")
    unguarded.result()
    assert unguarded.metrics.guard_forward_s == 0.0
    assert_clean(eng)


def test_teacher_forcing_feeds_the_given_tokens_and_keeps_every_steps_logits(tiny_model, fixed_profile):
    eng = make(tiny_model, fixed_profile)
    segs, _ = eng.segments_for("What is the GIL?", DOCS[:2], GREEDY)
    free = eng.submit_segments(segs, GREEDY, keep_logits=True, use_cache=False)
    ref = free.result()
    forced = eng.submit_segments(segs, keep_logits=True, use_cache=False, teacher_tokens=ref.token_ids)
    res = forced.result()
    assert res.token_ids == ref.token_ids and forced.forced_logits.shape == (len(ref.token_ids), eng.runner.vocab_size)
    assert forced.forced_logits.dtype == torch.float32 and (forced.forced_logits[0] - free.first_logits).abs().max() < 1e-5
    assert forced.forced_logits.argmax(-1).tolist() == list(ref.token_ids)  # greedy: each step's argmax is the token fed
    other = [t for t in reversed(ref.token_ids)]  # any tokens are fed, not sampled
    assert eng.submit_segments(segs, use_cache=False, teacher_tokens=other).result().token_ids == tuple(other)
    for bad in ([], [eng.runner.vocab_size], [-1]):
        with pytest.raises(InvalidRequestError):
            eng.submit_segments(segs, teacher_tokens=bad)
    assert_clean(eng)


def test_a_kl_target_picks_the_calibrated_cfo_scale(tiny_model, fixed_profile, tmp_path):
    from ragcache_backend.cache.chunk_reuse import KLCalibration
    from ragcache_backend.errors import ConfigError

    cal = KLCalibration(tiny_model.name, "float32", (0.5, 1.0, 2.0), (0.03, 0.01, 0.002), 0.05, 0.005, 10)
    path = tmp_path / "cal.json"
    path.write_text(cal.to_json_text())
    eng = make(tiny_model, fixed_profile, chunk_kl_target=0.01, chunk_calibration_path=path)
    assert eng.recompute_rule.kind == "cfo" and eng.recompute_rule.alpha == 1.0
    eng.close()
    eng = make(tiny_model, fixed_profile, chunk_kl_target=0.0, chunk_calibration_path=path)  # 0: full recompute
    assert eng.recompute_rule.kind == "all"
    segs, _ = eng.segments_for("What is the GIL?", DOCS[:3], GREEDY)
    eng.submit_segments(segs, GREEDY).result()
    segs, _ = eng.segments_for("Why?", [DOCS[2], DOCS[0]], GREEDY)
    ref, _ = eng.first_token_logits(segs, use_cache=False)
    got, _ = eng.first_token_logits(segs, store=False)
    assert (got - ref).abs().max().item() < 1e-4
    eng.close()
    with pytest.raises(ValueError):
        EngineConfig(chunk_kl_target=-0.1)
    with pytest.raises(ValueError):
        EngineConfig(chunk_kl_target=float("nan"))
    with pytest.raises(ConfigError, match="calibration"):
        make(tiny_model, fixed_profile, chunk_kl_target=0.01, chunk_calibration_path=tmp_path / "missing.json")
    other = tmp_path / "other.json"
    other.write_text(KLCalibration("another-model", "float32", (1.0,), (0.01,), 0.05, 0.005, 10).to_json_text())
    with pytest.raises(ConfigError, match="another-model"):
        make(tiny_model, fixed_profile, chunk_kl_target=0.01, chunk_calibration_path=other)


def test_bad_input_in_chunk_mode(tiny_model, fixed_profile):
    eng = make(tiny_model, fixed_profile)
    with pytest.raises(InvalidRequestError):
        eng.generate("q?", DOCS[:1], GREEDY, reuse="fuzzy")
    with pytest.raises(InvalidRequestError):
        eng.generate("q?", ["   "], GREEDY)  # an empty chunk
    segs, _ = eng.segments_for("q?", DOCS[:1], GREEDY)
    with pytest.raises(InvalidRequestError):
        eng.submit_segments(segs, GREEDY, reuse="exact", store=False)
    # a chunk longer than the context window: left out whole by generate, refused for a fixed prompt
    huge = "word " * 5000
    assert len(eng.generate("q?", [DOCS[0], huge], GREEDY).dropped_documents) == 1
    big = eng.prompts.build("q?", [(huge, None)])
    with pytest.raises(ContextWindowError):
        eng.submit_segments(big, GREEDY)
    # the same document twice: computed twice, recorded once; a one-character edit is never reused
    twice = eng.generate("Twice?", [DOCS[0], DOCS[1], DOCS[0]], GREEDY)
    assert twice.chunk_hits == 0 and len(eng.cache.variants(eng.segments_for("x", DOCS[:1], GREEDY)[0][1].key)) == 1
    edited = DOCS[1].replace("mutable", "mutabIe", 1)
    res = eng.generate("Edited?", [DOCS[3], edited], GREEDY)
    assert res.chunk_hits == 0
    assert_clean(eng)


def test_blend_and_focus_rules_stop_rows_and_count_them_by_depth(tiny_model, fixed_profile):
    eng = make(tiny_model, fixed_profile)
    eng.generate("What is the GIL?", DOCS[:4], GREEDY)
    segs, _ = eng.segments_for("And lists?", [DOCS[1], DOCS[3], DOCS[2], DOCS[0]], GREEDY)
    doc_tokens = sum(len(s) for s in segs if s.doc_id)
    every = eng.submit_segments(segs, GREEDY, recompute=RecomputeRule("all"), store=False).result()
    blend = eng.submit_segments(segs, GREEDY, recompute=RecomputeRule("blend", share=0.2), store=False).result()
    # every token through layer 1 of 2, then 20% of each chunk through layer 2: about 0.6 of the chunk tokens
    assert blend.chunk_hits == 4 and every.recomputed_tokens == doc_tokens
    assert 0.5 * doc_tokens < blend.recomputed_tokens < 0.7 * doc_tokens
    assert blend.cached_tokens + blend.computed_tokens == blend.prompt_tokens
    focus = eng.submit_segments(segs, GREEDY, recompute=RecomputeRule("all", focus_window=1), store=False).result()
    assert focus.recomputed_tokens < doc_tokens  # an unfocused chunk stopped after layer 1
    assert_clean(eng)


def test_an_exact_repeat_in_auto_mode_reuses_the_approximate_prompt_whole(tiny_model, fixed_profile):
    eng = make(tiny_model, fixed_profile)
    eng.generate("What is the GIL?", DOCS[:3], GREEDY)
    first = eng.generate("Why are tuples hashable?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY)
    assert first.chunk_hits == 3
    again = eng.generate("Why are tuples hashable?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY)
    assert again.computed_tokens == 1 and again.cached_tokens == again.prompt_tokens - 1
    assert again.chunk_hits == 0 and 0 < again.chunk_cached_tokens < again.cached_tokens  # the approximate part
    assert again.token_ids == first.token_ids  # the same approximate KV as the first time
    exact = eng.generate("Why are tuples hashable?", [DOCS[1], DOCS[2], DOCS[0]], GREEDY, reuse="exact")
    assert exact.chunk_cached_tokens == 0 and exact.cached_tokens < again.cached_tokens  # never approximate KV
    assert_clean(eng)
