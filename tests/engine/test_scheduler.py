"""Cache-aware reordering (RAGCache §5.2) and per-step batching plans: hand-computed cases."""

from __future__ import annotations

import pytest

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.engine.scheduler import Scheduler, SchedulerConfig, order_priority


def test_order_priority_is_cached_over_computed():
    assert order_priority(300, 100) == 3.0
    assert order_priority(0, 50) == 0.0
    assert order_priority(10, 0) == 10.0  # computation counted as at least one token


def test_reorder_admits_highest_cached_to_computed_ratio_first():
    s = Scheduler(SchedulerConfig(max_batch_size=1, reorder=True, window=32))
    s.add(1, cached=0, compute=100)     # 0.0
    s.add(2, cached=400, compute=100)   # 4.0
    s.add(3, cached=200, compute=100)   # 2.0
    s.add(4, cached=400, compute=50)    # 8.0
    assert [e.rid for e in s.order()] == [4, 2, 3, 1]
    assert s.schedule().prefill == (4,)


def test_ties_keep_arrival_order_and_fifo_when_reorder_off():
    s = Scheduler(SchedulerConfig(max_batch_size=4, reorder=True))
    s.add(7, 100, 100)
    s.add(5, 100, 100)
    assert s.schedule().prefill == (7, 5)
    f = Scheduler(SchedulerConfig(max_batch_size=4, reorder=False))
    f.add(1, 0, 100)
    f.add(2, 900, 10)
    assert f.schedule().prefill == (1, 2)


def _admit_one(s: Scheduler) -> int:
    rid = s.schedule().prefill[0]
    s.start(rid)
    s.remove(rid)  # finished at once: leaves the running set
    return rid


def test_starvation_window_bounds_overtaking():
    # request 0 never gains a cache hit; a stream of better requests arrives behind it.
    s = Scheduler(SchedulerConfig(max_batch_size=1, reorder=True, window=3))
    s.add(0, cached=0, compute=500)
    order = []
    for i in range(1, 7):
        s.add(i, cached=1000, compute=10)
        order.append(_admit_one(s))
    # 1, 2, 3 overtake request 0 (bypassed 1, 2, 3); then 0 has waited its window and goes first.
    assert order[:4] == [1, 2, 3, 0]
    assert order[4:] == [4, 5]


def test_window_zero_is_fifo_and_bypass_counts_only_older_requests():
    s = Scheduler(SchedulerConfig(max_batch_size=1, reorder=True, window=0))
    s.add(1, 0, 10)
    s.add(2, 99, 1)
    assert s.schedule().prefill == (1,)
    w = Scheduler(SchedulerConfig(max_batch_size=1, reorder=True, window=5))
    w.add(1, 0, 10)
    w.add(2, 99, 1)
    w.add(3, 0, 10)
    w.start(2)  # admitted ahead of 1 (older) but not of 3 (younger)
    assert w.entry(1).bypassed == 1 and w.entry(3).bypassed == 0


def test_plan_respects_batch_size_and_token_budget():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=300, reorder=False))
    for rid, compute in [(1, 100), (2, 150), (3, 100), (4, 10)]:
        s.add(rid, 0, compute)
    plan = s.schedule()
    assert plan.prefill == (1, 2)  # 100 + 150 fit; 3 would exceed 300 and 4 may not pass it
    for rid in plan.prefill:
        s.start(rid)
    plan = s.schedule()  # two decodes take 2 slots and 2 tokens
    assert plan.decode == (1, 2) and plan.prefill == (3, 4)
    assert len(plan.decode) + sum(s.entry(r).compute for r in plan.prefill) <= 300


def test_oversize_prompt_runs_alone_instead_of_starving():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=64, reorder=False))
    s.add(1, 0, 1000)
    s.add(2, 0, 10)
    assert s.schedule().prefill == (1,)
    s.start(1)
    assert s.schedule() .prefill == (2,)


def test_full_running_set_admits_nothing_and_remove_works_everywhere():
    s = Scheduler(SchedulerConfig(max_batch_size=2))
    for rid in (1, 2, 3):
        s.add(rid, 0, 5)
    s.start(1)
    s.start(2)
    plan = s.schedule()
    assert plan.decode == (1, 2) and plan.prefill == ()
    assert s.remove(3) and s.remove(1) and not s.remove(42)
    assert s.running == (2,) and s.pending == () and len(s) == 1


def test_config_validation():
    with pytest.raises(InvalidRequestError):
        SchedulerConfig(max_batch_size=0)
    with pytest.raises(InvalidRequestError):
        SchedulerConfig(max_batch_tokens=0)
    with pytest.raises(InvalidRequestError):
        SchedulerConfig(window=-1)
    s = Scheduler()
    s.add(1)
    with pytest.raises(InvalidRequestError):
        s.add(1)
