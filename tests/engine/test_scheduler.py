"""Cache-aware reordering (RAGCache §5.2) and per-step batching plans with chunked prefill (vLLM's
and SGLang's token budget): hand-computed cases over plain data."""

from __future__ import annotations

import pytest

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.engine.scheduler import PrefillChunk, Scheduler, SchedulerConfig, order_priority


def _ids(step) -> tuple[int, ...]:
    return tuple(c.rid for c in step.prefill)


def _sizes(step) -> tuple[tuple[int, int], ...]:
    return tuple((c.rid, c.tokens) for c in step.prefill)


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
    assert s.schedule().prefill == (PrefillChunk(4, 50, new=True),)


def test_ties_keep_arrival_order_and_fifo_when_reorder_off():
    s = Scheduler(SchedulerConfig(max_batch_size=4, reorder=True))
    s.add(7, 100, 100)
    s.add(5, 100, 100)
    assert _ids(s.schedule()) == (7, 5)
    f = Scheduler(SchedulerConfig(max_batch_size=4, reorder=False))
    f.add(1, 0, 100)
    f.add(2, 900, 10)
    assert _ids(f.schedule()) == (1, 2)


def _admit_one(s: Scheduler) -> int:
    rid = s.schedule().prefill[0].rid
    s.start(rid, s.entry(rid).compute)
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
    assert _ids(s.schedule()) == (1,)
    w = Scheduler(SchedulerConfig(max_batch_size=1, reorder=True, window=5))
    w.add(1, 0, 10)
    w.add(2, 99, 1)
    w.add(3, 0, 10)
    w.start(2, 1)  # admitted ahead of 1 (older) but not of 3 (younger)
    assert w.entry(1).bypassed == 1 and w.entry(3).bypassed == 0


def _run(s: Scheduler, step) -> None:
    """What the engine does with a step: admit the new ones, then count every chunk computed."""
    for c in step.prefill:
        if c.new:
            s.start(c.rid, s.entry(c.rid).compute)
    for c in step.prefill:
        s.advance(c.rid, c.tokens)


def test_budget_is_split_into_chunks_in_admission_order():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=300, reorder=False))
    for rid, compute in [(1, 100), (2, 150), (3, 100), (4, 10)]:
        s.add(rid, 0, compute)
    step = s.schedule()
    # 1 and 2 fit whole; 3 is admitted with the 50 tokens left (its first chunk); 4 gets no slot
    # of the budget and may not pass 3 anyway
    assert step.prefill == (PrefillChunk(1, 100, True), PrefillChunk(2, 150, True), PrefillChunk(3, 50, True))
    assert step.tokens == 300 and step.admitted == (1, 2, 3)
    _run(s, step)
    assert s.decoding == (1, 2) and s.prefilling == (3,) and s.remaining(3) == 50
    assert s.waiting == 2  # 4 queued and 3 with a chunk left both wait for prefill (Algorithm 2's pool)


def test_decode_rows_come_first_then_continuing_prefills_then_admissions():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=64, reorder=False))
    s.add(1, 0, 5)
    s.add(2, 0, 200)
    s.add(3, 0, 7)
    step = s.schedule()
    assert _sizes(step) == ((1, 5), (2, 59))  # 2 takes the rest of the budget; 3 waits behind it
    _run(s, step)
    step = s.schedule()
    # 1 decodes (1 row); 2 continues with the 63 left; nothing is left for 3
    assert step.decode == (1,) and step.prefill == (PrefillChunk(2, 63, new=False),) and step.tokens == 64
    _run(s, step)
    step = s.schedule()
    assert step.decode == (1,) and step.prefill == (PrefillChunk(2, 63, new=False),)
    _run(s, step)
    step = s.schedule()  # 2 has 15 left: it finishes, and 3 is admitted into the same step
    assert step.decode == (1,) and step.prefill == (PrefillChunk(2, 15, False), PrefillChunk(3, 7, True))
    _run(s, step)
    assert s.decoding == (1, 2, 3) and s.prefilling == () and s.waiting == 0


def test_prompt_longer_than_the_whole_budget_is_chunked_and_others_run_beside_it():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=64, reorder=False))
    s.add(1, 0, 10)
    step = s.schedule()
    _run(s, step)  # 1 decodes from now on
    s.add(2, 0, 1000)
    s.add(3, 0, 10)
    chunks = []
    while 2 in s.prefilling or 2 in s.pending:
        step = s.schedule()
        assert step.decode[:1] == (1,) and step.tokens <= 64  # the decode keeps its row every step
        chunks.append(next(c.tokens for c in step.prefill if c.rid == 2))
        _run(s, step)
    assert sum(chunks) == 1000 and max(chunks) <= 63 and len(chunks) == 16
    # 1000 = 15 * 63 + 55: the step that finished 2 admitted 3 with the 8 tokens left
    assert s.prefilling == (3,) and s.remaining(3) == 2


def test_a_chunk_never_exceeds_what_is_left_and_prefills_always_progress():
    s = Scheduler(SchedulerConfig(max_batch_size=8, max_batch_tokens=2, reorder=False))
    for rid in (1, 2):
        s.add(rid, 0, 1)
    _run(s, s.schedule())
    assert s.decoding == (1, 2)
    s.add(3, 0, 5)
    step = s.schedule()  # the two decodes fill the budget: the prefill still gets one row
    assert step.decode == (1, 2) and step.prefill == (PrefillChunk(3, 1, True),)
    _run(s, step)
    assert s.schedule().prefill == (PrefillChunk(3, 1, False),)


def test_max_batch_size_counts_decodes_and_prefills_in_progress():
    s = Scheduler(SchedulerConfig(max_batch_size=2, max_batch_tokens=16, reorder=False))
    for rid, compute in [(1, 40), (2, 5), (3, 5)]:
        s.add(rid, 0, compute)
    step = s.schedule()
    assert _ids(step) == (1,)  # 1 takes the whole budget; 2 would fit a slot but no token
    _run(s, step)
    step = s.schedule()
    assert step.prefill == (PrefillChunk(1, 16, False),)  # still the whole budget: 2 waits
    _run(s, step)
    step = s.schedule()
    assert _sizes(step) == ((1, 8), (2, 5))  # 1 finishes; 2 takes the second slot, 3 has none
    _run(s, step)
    assert s.running == (1, 2) and s.schedule().prefill == ()


def test_starvation_window_holds_with_chunked_admissions():
    s = Scheduler(SchedulerConfig(max_batch_size=1, max_batch_tokens=64, reorder=True, window=2))
    s.add(0, cached=0, compute=100)  # long, no cache hit: overtaken until its window is spent
    order = []
    for i in range(1, 5):
        s.add(i, cached=1000, compute=10)
        step = s.schedule()
        rid = step.prefill[0].rid
        order.append(rid)
        _run(s, step)
        while rid in s.prefilling:  # its remaining chunks come first, in later steps
            _run(s, s.schedule())
        s.remove(rid)
    assert order == [1, 2, 0, 3]


def test_unchunkable_prefill_waits_whole_or_runs_alone_over_budget():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=64, reorder=False))
    s.add(1, 0, 40)
    s.add(2, 0, 40, chunkable=False)  # a chunk-mode prefill: whole or not at all
    step = s.schedule()
    assert _sizes(step) == ((1, 40),)  # 24 left: 2 does not fit whole, and keeps its place
    _run(s, step)
    step = s.schedule()
    assert step.decode == (1,) and _sizes(step) == ((2, 40),)
    _run(s, step)
    s.add(3, 0, 1000, chunkable=False)
    s.add(4, 0, 5)
    step = s.schedule()
    assert _sizes(step) == ((3, 1000),)  # larger than the budget the decodes leave: alone
    assert step.tokens > 64
    _run(s, step)
    assert _sizes(s.schedule()) == ((4, 5),)


def test_advance_and_start_refuse_impossible_counts():
    s = Scheduler()
    s.add(1, 0, 10)
    with pytest.raises(InvalidRequestError):
        s.start(1, 0)
    s.start(1, 10)
    with pytest.raises(InvalidRequestError):
        s.advance(1, 11)
    with pytest.raises(InvalidRequestError):
        s.advance(1, 0)
    assert not s.advance(1, 4) and s.remaining(1) == 6 and s.prefilling == (1,)
    assert s.advance(1, 6) and s.decoding == (1,)
    assert s.remove(1) and 1 not in s


def test_full_running_set_admits_nothing_and_remove_works_everywhere():
    s = Scheduler(SchedulerConfig(max_batch_size=3))
    for rid in (1, 2, 3, 4):
        s.add(rid, 0, 5)
    for rid in (1, 2):
        s.start(rid, 5)
        s.advance(rid, 5)
    s.start(3, 5)
    plan = s.schedule()
    assert plan.decode == (1, 2) and plan.prefill == (PrefillChunk(3, 5, False),)
    assert s.remove(4) and s.remove(1) and s.remove(3) and not s.remove(42)
    assert s.running == (2,) and s.pending == () and s.prefilling == () and len(s) == 1


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


def test_a_request_whose_next_piece_is_being_computed_waits_for_it():
    # a burst: 1 and 2 retrieved the same new document (piece 11 after a cached prefix), 3 another
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=1000, reorder=True, window=32))
    s.add(1, 0, 300)
    s.add(2, 0, 300)
    s.add(3, 0, 300)
    s.update(1, 50, 250, pieces=(11, 12))
    s.update(2, 50, 250, pieces=(11, 13))
    s.update(3, 50, 250, pieces=(21,))
    step = s.schedule()
    assert _sizes(step) == ((1, 250), (3, 250))  # 2 passed over in the same step: 1 computes piece 11
    for rid in _ids(step):
        s.start(rid, 250)
    assert _ids(s.schedule()) == (1, 3)  # still computing piece 11: 2 keeps waiting
    assert s.entry(2).bypassed == 1
    s.advance(1, 100)  # 1 committed piece 11 (its chunk passed it): the engine's refresh finds it cached
    s.update(2, 200, 100, pieces=(13,))
    assert _sizes(s.schedule()) == ((1, 150), (3, 250), (2, 100))


def test_a_passed_over_request_runs_once_the_piece_computing_prefill_ends_or_fails():
    for end in ("done", "removed"):
        s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=1000))
        s.add(1, 0, 200)
        s.add(2, 0, 200)
        s.update(1, 0, 200, pieces=(7,))
        s.update(2, 0, 200, pieces=(7, 8))
        assert _ids(s.schedule()) == (1,)
        s.start(1, 200)
        if end == "done":
            assert s.advance(1, 200)  # its piece failed to commit: 2 still finds it uncached
        else:
            s.remove(1)  # cancelled or failed mid-prefill
        assert _sizes(s.schedule()) == ((2, 200),)


def test_requests_without_pieces_are_never_passed_over():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=1000))
    s.add(1, 0, 100)
    s.add(2, 0, 100)
    s.update(1, 0, 100, pieces=(5,))
    assert _ids(s.schedule()) == (1, 2)  # 2 commits nothing (a dry run, a chunk mode): no pieces
    s.start(1, 100)
    s.start(2, 100)
    s.add(3, 0, 100)
    s.update(3, 0, 100, pieces=(6, 5))  # its first piece is not in flight; a later one is
    assert _ids(s.schedule()) == (1, 2, 3)
