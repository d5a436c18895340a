"""Cache-Craft's reuse formulas (§3.1-3.3) against hand-computed cases."""

from __future__ import annotations

import hashlib
import math

import pytest

from ragcache_backend.cache.chunk_reuse import (
    VariantStats,
    adjusted_overlap,
    choose_variant,
    context_impact,
    eviction_victim,
    fix_overhead,
    frequency_after_access,
    order_penalty,
    prefix_overlap,
    recompute_count,
    tokens_to_recompute,
)

# C3 (4 tokens) computed after C1 (2 tokens) and C2 (4 tokens): 1.0 of its attention went to C1,
# 3.0 to C2, 8.0 to itself
C3 = VariantStats("C3", 4, ("C1", "C2"), (2, 4), (1.0, 3.0), 8.0, (0.1, 0.9, 0.5, 0.9))


def test_prefix_overlap_eq6():
    assert prefix_overlap(C3, ("C1", "C2")) == 1.0
    assert prefix_overlap(C3, ("C2", "C5")) == 0.75  # 3 / (1 + 3)
    assert prefix_overlap(C3, ("C1",)) == 0.25
    assert prefix_overlap(C3, ()) == 0.0


def test_order_penalty_eq7_normalised_kendall_tau():
    assert order_penalty(("C1", "C2"), ("C1", "C2")) == 0.0
    assert order_penalty(("C1", "C2"), ("C2", "C1")) == 1.0
    assert order_penalty(("C1", "C2"), ("C1", "C9", "C2")) == 0.0  # other chunks do not count
    assert order_penalty(("A", "B", "C"), ("C", "A", "B")) == pytest.approx(2 / 3)  # (A,C), (B,C) discordant
    assert order_penalty(("A", "B", "C", "D"), ("D", "C", "B", "A")) == 1.0
    assert order_penalty(("A",), ("A",)) == 0.0 and order_penalty((), ("A", "B")) == 0.0


def test_adjusted_overlap_eq8():
    assert adjusted_overlap(C3, ("C2", "C1")) == 0.0  # all present, order reversed
    assert adjusted_overlap(C3, ("C2", "C5")) == 0.75  # one common chunk: no order to penalise


def test_context_impact_eq9_to_11():
    a = 1.0 / (4 * 2) + 3.0 / (4 * 4)  # 0.3125
    b = 8.0 / 4**2  # 0.5
    assert context_impact(C3) == pytest.approx(1 / (1 + math.exp(-a / b)))
    assert context_impact(C3) == pytest.approx(0.651355, abs=1e-6)
    alone = VariantStats("C0", 3, (), (), (), 9.0, (0.0, 0.0, 0.0))
    assert context_impact(alone) == 0.5  # sigmoid(0): no prefix influence at all


def test_fix_overhead_eq12_and_token_count_eq14():
    cfo = fix_overhead(C3, ("C2", "C5"), alpha=1.0)
    assert cfo == pytest.approx(0.651355 * 0.25, abs=1e-6)
    assert recompute_count(cfo, 4) == 1  # ceil(0.65)
    assert tokens_to_recompute(C3, 1) == (1,)  # 0.9 at tokens 1 and 3: the earlier wins
    assert tokens_to_recompute(C3, 3) == (1, 2, 3)
    assert fix_overhead(C3, (), alpha=2.0) == 1.0  # clamped: recompute the whole chunk
    assert recompute_count(1.0, 4) == 4 and recompute_count(0.0, 4) == 0 and recompute_count(0.5, 4) == 2
    assert fix_overhead(C3, ("C1", "C2"), alpha=5.0) == 0.0  # the exact prefix: nothing to fix
    with pytest.raises(ValueError):
        fix_overhead(C3, (), alpha=-1.0)


def test_choose_variant_takes_the_lowest_cfo():
    other = VariantStats("C3", 4, ("C5",), (4,), (2.0,), 8.0, (0.4, 0.3, 0.2, 0.1))
    choice = choose_variant([C3, other], ("C5", "C2"), alpha=1.0)
    # C3: beta = 3/4 -> CFO = 0.6514 * 0.25 = 0.163; other: beta = 1 -> CFO = 0
    assert choice.stats is other and choice.cfo == 0.0 and choice.recompute == ()
    # prefix (C1): C3 keeps a quarter of its inter-attention, CFO = 0.6514 * 0.75 = 0.489;
    # other keeps none, CFO = sigmoid(0.125 / 0.5) = 0.562
    choice = choose_variant([C3, other], ("C1",), alpha=1.0)
    assert choice.stats is C3 and choice.cfo == pytest.approx(0.651355 * 0.75, abs=1e-6)
    assert choice.recompute == (1, 3)  # ceil(0.489 * 4) = 2 tokens, the two most attentive to the prefix
    with pytest.raises(ValueError):
        choose_variant([], ("C1",), alpha=1.0)
    with pytest.raises(ValueError):
        choose_variant([C3, VariantStats("C4", 1, (), (), (), 1.0, (0.0,))], (), alpha=1.0)


def test_variant_store_frequency_and_eviction():
    assert frequency_after_access(0.0, 0.25) == 4.0
    assert frequency_after_access(4.0, 0.5) == 6.0
    assert frequency_after_access(0.0, 0.0) == 1000.0  # an exact fit gains the most
    assert eviction_victim([3.0, 1.0, 1.0, 5.0]) == 1
    with pytest.raises(ValueError):
        eviction_victim([])


@pytest.mark.parametrize("kwargs", [
    {"length": 0, "token_inter": ()},
    {"token_inter": (0.1,)},  # one score for 4 tokens
    {"prefix": ("C1", "C1")},  # repeated prefix chunk
    {"inter": (1.0,)},  # misaligned
    {"intra": 0.0},
    {"inter": (-1.0, 3.0)},
])
def test_inconsistent_variant_stats_are_refused(kwargs):
    fields = {"chunk": "C3", "length": 4, "prefix": ("C1", "C2"), "prefix_lengths": (2, 4), "inter": (1.0, 3.0),
              "intra": 8.0, "token_inter": (0.1, 0.9, 0.5, 0.9)} | kwargs
    with pytest.raises(ValueError):
        VariantStats(**fields)


# ---- rules, variant statistics from attention mass, Algorithm 1, eq. 16 --------------------------
from ragcache_backend.cache.chunk_reuse import (  # noqa: E402
    FocusTracker,
    RecomputeRule,
    choose_with_rule,
    context_keys,
    focused_set,
    preload_depth,
    stats_from_mass,
)


def test_recompute_rules_pick_their_tokens():
    new = ("C2", "C5")  # CFO = 0.651355 * 0.25 -> ceil(0.163 * 4) = 1 token: the top one by inter-attention
    assert choose_with_rule([C3], new, RecomputeRule("cfo")).recompute == (1,)
    assert choose_with_rule([C3], new, RecomputeRule("all")).recompute == (0, 1, 2, 3)
    assert choose_with_rule([C3], new, RecomputeRule("none")).recompute == ()
    lead = choose_with_rule([C3], new, RecomputeRule("leading", leading=3))
    assert lead.recompute == (0, 1, 2) and lead.cfo == 0.75
    share = choose_with_rule([C3], new, RecomputeRule("share", share=0.5))
    assert share.recompute == (1, 3) and share.cfo == 0.5  # the two highest token_inter (0.9, 0.9)
    with pytest.raises(ValueError):
        RecomputeRule("magic")


def test_context_keys_make_repeats_unique():
    assert context_keys(["S", "A", "B", "A", "A"]) == ("S", "A", "B", "A#2", "A#3")


def test_stats_from_mass_sums_rows_eq3_eq4_eq14():
    # segments: sink, S, A, the chunk B (2 tokens); rows are B's tokens
    mass = [(0.5, 0.1, 0.2, 0.2), (0.3, 0.2, 0.1, 0.4)]
    st = stats_from_mass("B", mass, own=3, keys=("<sink>", "S", "A", "B"), lengths=(4, 6, 10, 2), skip=1)
    assert st.prefix == ("S", "A") and st.prefix_lengths == (6, 10)
    assert st.inter == pytest.approx((0.3, 0.3)) and st.intra == pytest.approx(0.6)
    assert st.token_inter == pytest.approx((0.3, 0.3))  # the sink is left out
    with pytest.raises(ValueError):
        stats_from_mass("B", mass, own=4, keys=("<sink>", "S", "A", "B"), lengths=(4, 6, 10, 2))


def test_focused_set_algorithm1_hand_case():
    # cumulative 1, 9, 2, 8: sorted 9, 8, 2, 1 (chunks 1, 3, 2, 0); gaps 1, 6, 1 -> p = 1/8, 3/4, 1/8
    # h = 0.2599, 0.4757, 0.7356; jumps h1 - h0 = 0.2158, h2 - h1 = 0.2599 -> i* = 2: chunks 1 and 3
    assert focused_set([1.0, 9.0, 2.0, 8.0]) == frozenset({1, 3})
    assert focused_set([3.0, 1.0]) == frozenset({0, 1})  # fewer than 3 chunks: all focused
    assert focused_set([2.0, 2.0, 2.0]) == frozenset({0, 1, 2})  # no gap


def test_focus_tracker_decides_after_a_stable_window():
    tracker = FocusTracker(window=2)
    assert tracker.feed([5.0, 0.1, 0.2]) is None  # one layer: not yet
    assert tracker.feed([5.0, 0.1, 0.2]) == focused_set([10.0, 0.2, 0.4])
    assert tracker.layer == 2 and tracker.feed([0.0, 9.0, 9.0]) is None  # decided: later layers ignored
    with pytest.raises(ValueError):
        FocusTracker(window=0).feed([1.0, 2.0])
    other = FocusTracker(window=3)
    other.feed([1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        other.feed([1.0, 2.0])  # another number of chunks


def test_preload_depth_eq16():
    assert preload_depth(5, 1.0, 2.0) == 3  # the paper's Fig. 19: prefill:load = 1:2, L = 5 -> L_p = 3
    assert preload_depth(30, 2.0, 1.0) == 1  # loading is faster than computing: one layer ahead
    assert preload_depth(30, 1.0, 1e9) == 30
    with pytest.raises(ValueError):
        preload_depth(0, 1.0, 1.0)


def test_added_context_factor_counts_context_the_variant_never_saw():
    from ragcache_backend.cache.chunk_reuse import SINK_KEY, added_context_factor

    # C3 saw C1 (2 tokens) and C2 (4); now after C1, C9 (6 tokens, new), C2 and the sink (ignored)
    assert added_context_factor(C3, (SINK_KEY, "C1", "C9", "C2"), (4, 2, 6, 4)) == pytest.approx(6 / 12)
    assert added_context_factor(C3, ("C1", "C2"), (2, 4)) == 1.0  # nothing added
    # eq. 6 alone: beta = 1, nothing to fix; with the added context beta' = 0.5, CFO = CCI * 0.5
    assert fix_overhead(C3, ("C1", "C9", "C2"), alpha=1.0) == 0.0
    assert fix_overhead(C3, ("C1", "C9", "C2"), alpha=1.0, new_lengths=(2, 6, 4)) == pytest.approx(0.651355 * 0.5, abs=1e-6)
    rule = RecomputeRule("cfo", added_context=False)
    assert choose_with_rule([C3], ("C1", "C9", "C2"), rule, (2, 6, 4)).recompute == ()  # the paper's formula
    with pytest.raises(ValueError):
        added_context_factor(C3, ("C1",), (2, 3))


def test_the_recompute_rules_key_names_everything_that_shapes_its_kv():
    base = RecomputeRule()
    assert base.key == RecomputeRule().key and len(base.key) == 12
    others = [RecomputeRule(alpha=2.5), RecomputeRule(guard=0.3), RecomputeRule("share"), RecomputeRule(focus_window=3),
              RecomputeRule(added_context=False), RecomputeRule("leading", leading=16)]
    assert len({base.key, *(r.key for r in others)}) == 1 + len(others)
    # the guard's signal changed meaning (deviation x attention since 2026-11-27): the same threshold
    # under the old signal had this key, and must not serve the new one
    old_text = "cfo;1.0;0.15;32;0.012;None;1"
    assert RecomputeRule(guard=0.012).key != hashlib.sha256(old_text.encode()).hexdigest()[:12]


def test_a_kl_calibration_turns_a_target_into_the_least_recomputing_scale():
    from ragcache_backend.cache.chunk_reuse import KLCalibration

    cal = KLCalibration("m", "float32", (0.5, 1.0, 2.0, 4.0), (0.02, 0.008, 0.003, 0.001), 0.04, 0.004, 12)
    base = RecomputeRule(guard=0.2)
    assert cal.rule(base) == RecomputeRule("cfo", alpha=2.0, guard=0.2)  # its own target: 0.004
    assert cal.rule(base, 0.02).alpha == 0.5 and cal.rule(base, 0.0085).alpha == 1.0
    assert cal.rule(base, 0.0).kind == "all"  # 0: recompute everything
    assert cal.rule(base, 1e-5).kind == "all"  # no measured scale meets it
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="KL target"):
            cal.rule(base, bad)
    assert KLCalibration.from_json_text(cal.to_json_text()) == cal
    for text in ("{", '{"version": 2}', cal.to_json_text().replace('"kl"', '"kx"')):
        with pytest.raises(ValueError):
            KLCalibration.from_json_text(text)
    with pytest.raises(ValueError):
        KLCalibration("m", "float32", (1.0, 0.5), (0.1, 0.2), 0.1, 0.01, 1)  # not ascending
    with pytest.raises(ValueError):
        KLCalibration("m", "float32", (1.0,), (float("nan"),), 0.1, 0.01, 1)


def test_the_shipped_kl_calibration_reads_and_gives_a_rule_for_the_default_model():
    from importlib.resources import files

    from ragcache_backend.cache.chunk_reuse import KLCalibration
    from ragcache_backend.config import EngineConfig

    cal = KLCalibration.from_json_text(files("ragcache_backend.engine").joinpath("chunk_calibration.json").read_text())
    assert cal.model == "SmolLM2-135M-Instruct" and cal.dtype == "float32" and cal.requests >= 8
    assert list(cal.kl) == sorted(cal.kl, reverse=True) or cal.kl[-1] <= cal.kl[0]  # more recompute, less KL
    rule = EngineConfig(chunk_kl_target=cal.target).recompute_rule(cal.model)
    assert rule.kind == "cfo" and rule.alpha in cal.alphas
    assert EngineConfig(chunk_kl_target=0.0).recompute_rule(cal.model).kind == "all"
