"""Workload generator (skew, Poisson arrivals, seeds) and the model-free policy replay."""

from __future__ import annotations

import random

import pytest

from ragcache_backend.bench.report import percentile, summarize
from ragcache_backend.bench.policy_replay import policy_table
from ragcache_backend.cache.profile import PrefillProfile
from ragcache_backend.prompts.builder import Segment, SegmentKind
from ragcache_backend.bench.workload import (PoolQuestion, Recurrence, TraceRequest, build_workload, measure_skew,
                                             passage_recurrence)


class _Store:
    def __init__(self, n):
        self.docs = {f"d{i}": f"text {i}" for i in range(n)}

    def __len__(self):
        return len(self.docs)

    def get(self, doc_id):
        return type("D", (), {"text": self.docs[doc_id]})()


def _pool(n_docs=60, per_doc=2):
    return [PoolQuestion(f"q{d}-{j}", "faq", (f"d{d}", f"d{(d + 1) % n_docs}"))
            for d in range(n_docs) for j in range(per_doc)]


def test_workload_is_seeded_skewed_and_poisson():
    store, pool = _Store(60), _pool()
    a = build_workload(store, pool, num_requests=400, zipf_s=1.2, seed=3)
    b = build_workload(store, pool, num_requests=400, zipf_s=1.2, seed=3)
    assert [r.question for r in a.requests] == [r.question for r in b.requests]
    assert [r.arrival_s(2.0) for r in a.requests] == [r.arrival_s(2.0) for r in b.requests]
    gaps = [y.arrival_units - x.arrival_units for x, y in zip(a.requests, a.requests[1:])]
    assert 0.85 < sum(gaps) / len(gaps) < 1.15  # unit-rate Poisson: mean gap 1
    assert a.requests[10].arrival_s(4.0) == pytest.approx(a.requests[10].arrival_units / 4.0)
    flat = build_workload(store, pool, num_requests=400, zipf_s=0.0, seed=3)
    assert a.skew["share_requests_hitting_top_corpus"] > flat.skew["share_requests_hitting_top_corpus"]
    assert set(a.documents) == {d for r in a.requests for d in r.doc_ids}


def test_measure_skew_by_hand():
    reqs = [TraceRequest(i, float(i), "q", "faq", docs) for i, docs in
            enumerate([("a", "b"), ("a",), ("c",), ("a", "c")])]
    s = measure_skew(reqs, corpus_size=100, top_share=0.03)  # top 3 of the corpus: a, c, b
    assert s["top_docs_corpus"] == 3 and s["share_requests_hitting_top_corpus"] == 1.0
    assert s["top_docs_used"] == 1 and s["share_requests_hitting_top_used"] == 0.75  # only "a"


def test_summary_statistics():
    recs = [{"ttft_s": t, "prompt_tokens": 10, "cached_tokens": 5} for t in (1.0, 2.0, 3.0, 4.0)]
    recs.append({"error": "CacheBudgetError: x"})
    s = summarize(recs, makespan=2.0)
    assert s["completed"] == 4 and s["errors"] == 1 and s["ttft_mean_s"] == 2.5
    assert s["ttft_p50_s"] == 2.0 and s["ttft_p99_s"] == 4.0 and s["throughput_rps"] == 2.0
    assert s["token_hit_rate"] == 0.5 and percentile([], 50) != percentile([], 50)  # nan


def test_policy_replay_is_deterministic_and_bounded():
    rng = random.Random(0)
    system = Segment(tuple(range(1, 20)), SegmentKind.PREFIX, True)
    docs = [Segment(tuple(rng.randrange(100, 5000) for _ in range(rng.randint(20, 60))), SegmentKind.DOCUMENT, True,
                    doc_id=f"d{i}") for i in range(30)]
    prompts = []
    for _ in range(200):
        a, b = rng.choices(range(30), weights=[1 / (i + 1) for i in range(30)], k=2)
        prompts.append([system, docs[a], docs[b], Segment((7, 8, 9), SegmentKind.TAIL, False)])
    profile = PrefillProfile(alphas=(0, 512, 1536), betas=(32, 256, 1024),
                             times=((0.07, 0.5, 2.1), (0.09, 0.6, 2.6), (0.12, 0.8, 3.4)))
    kw = dict(profile=profile, device_bytes=16 * 16 * 16, host_sizes_bytes=[0, 16 * 200], bytes_per_token=16)
    t1, t2 = policy_table(prompts, **kw), policy_table(prompts, **kw)
    assert t1 == t2
    for row in t1.values():
        for r in row.values():
            assert 0.0 < r["token_hit_rate"] < 1.0 and r["requests"] == 200
    assert t1[16 * 200]["pgdsf"]["host_hits"] > 0 and t1[0]["pgdsf"]["host_hits"] == 0


def test_warmup_splits_the_trace_and_rebases_arrivals():
    store, pool = _Store(60), _pool()
    whole = build_workload(store, pool, num_requests=50, seed=5)
    wl = build_workload(store, pool, num_requests=50, seed=5, warmup=20)
    assert [r.question for r in wl.requests] == [r.question for r in whole.requests]  # same trace
    timed = wl.timed_requests()
    assert len(timed) == 30 and timed[0].index == 20
    base = wl.requests[19].arrival_units
    assert wl.timed_arrival_s(timed[0], 2.0) == pytest.approx((timed[0].arrival_units - base) / 2.0)
    assert wl.timed_arrival_s(timed[0], 2.0) > 0
    assert wl.skew == measure_skew(timed, len(store))  # skew of the timed part only
    assert whole.timed_arrival_s(whole.requests[3], 1.0) == whole.requests[3].arrival_units
    with pytest.raises(ValueError):
        build_workload(store, pool, num_requests=5, warmup=6)


def test_drift_redraws_popularity_but_keeps_the_stationary_trace():
    store, pool = _Store(60), _pool()
    stationary = build_workload(store, pool, num_requests=600, zipf_s=1.2, seed=1)
    assert [r.question for r in build_workload(store, pool, num_requests=600, zipf_s=1.2, seed=1,
                                                drift_every=0).requests] == [r.question for r in stationary.requests]
    drifting = build_workload(store, pool, num_requests=600, zipf_s=1.2, seed=1, drift_every=100)

    def top_anchor(reqs):
        from collections import Counter
        return Counter(r.doc_ids[0] for r in reqs).most_common(1)[0][0]

    # stationary: the same document leads every phase; drifting: leaders change between phases
    assert len({top_anchor(stationary.requests[i:i + 100]) for i in range(0, 600, 100)}) <= 2
    assert len({top_anchor(drifting.requests[i:i + 100]) for i in range(0, 600, 100)}) >= 4


def test_paired_by_hit_compares_the_same_requests():
    from ragcache_backend.bench.report import paired_by_hit

    ours = [{"ttft_s": 0.1, "prompt_tokens": 100, "cached_tokens": 90},   # hit
            {"ttft_s": 0.5, "prompt_tokens": 100, "cached_tokens": 10},   # miss
            {"ttft_s": 0.2, "prompt_tokens": 100, "cached_tokens": 80},   # hit
            {"error": "X"}]
    off = [{"ttft_s": 0.6}, {"ttft_s": 0.55}, {"ttft_s": 1.0}, {"ttft_s": 9.0}]
    p = paired_by_hit({"records": {"ragcache": {"1.0": ours}, "no-cache": {"1.0": off},
                                   "short": {"1.0": off[:2]}}})["1.0"]
    assert p["hit"]["requests"] == 2 and p["hit"]["ragcache"] == pytest.approx(0.15)
    assert p["hit"]["no-cache"] == pytest.approx(0.8)
    assert p["miss"] == {"requests": 1, "ragcache": 0.5, "no-cache": 0.55}
    assert "partial" not in p and all("short" not in row for row in p.values())  # misaligned runs are skipped


def test_topics_are_the_popularity_anchors():
    """Questions of one topic share an anchor, so a popular topic brings different questions over
    overlapping passages; a question without a topic is anchored at its top-1 passage."""
    store = _Store(40)
    topical = [PoolQuestion(f"t{j}", "library", (f"d{j}", "d30", "d31"), topic="library/x") for j in range(10)]
    loose = [PoolQuestion(f"q{d}", "faq", (f"d{d}", "d39")) for d in range(10, 20)]
    assert topical[0].anchor == "library/x" and loose[0].anchor == "d10"
    wl = build_workload(store, topical + loose, num_requests=300, zipf_s=0.0, seed=1)
    from_topic = [r for r in wl.requests if r.source == "library"]
    # 11 anchors drawn uniformly: the topic's share is ~1/11 (a question each would give 10/20)
    assert 0.03 < len(from_topic) / len(wl.requests) < 0.2
    assert len({r.question for r in from_topic}) > 5  # the topic's different questions are all asked


def test_passage_recurrence_by_hand():
    asked = [("a", ["d1", "d2"]), ("b", ["d2", "d3"]), ("a", ["d1", "d3", "d4"]), ("c", ["d5"])]
    assert passage_recurrence(asked) == [
        Recurrence(False, 0, 0, 2),
        Recurrence(False, 1, 0, 1),  # d2 was used by "a"
        Recurrence(True, 1, 1, 1),  # d1 only by "a" itself, d3 by "b", d4 never
        Recurrence(False, 0, 0, 1),
    ]
    assert passage_recurrence(asked, 2) == passage_recurrence(asked)[2:]
    assert passage_recurrence(asked, 4) == []
    with pytest.raises(ValueError, match="start"):
        passage_recurrence(asked, 5)
