from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ragcache_backend.cache.blocks import BlockAllocator, blocks_for
from ragcache_backend.errors import CacheBudgetError, InvalidRequestError, UnknownPolicyError
from ragcache_backend.cache.knowledge_tree import Node, SegmentKey, TierName
from ragcache_backend.cache.profile import PrefillProfile
from ragcache_backend.cache.tiers import TieredCache
from tests.cache.sim_mover import SimulatedMover

DEV, HOST = TierName.DEVICE, TierName.HOST
BS = 10  # tokens per block in the hand-computed cases
# T(alpha, beta) = beta * (0.01 + 1e-5 * alpha) seconds: bilinear, so interpolation is exact and
# the cost per new token is 0.01 + 1e-5 * alpha.
PROFILE = PrefillProfile(alphas=(0, 1000), betas=(1, 1001), times=((0.01, 10.01), (0.02, 20.02)))


def K(name: str) -> SegmentKey:
    return SegmentKey(name)


def make(num_blocks: int, host_bytes: int, policy: str = "pgdsf", block_size: int = BS,
         mover: SimulatedMover | None = None) -> tuple[TieredCache, SimulatedMover]:
    mover = mover or SimulatedMover(bytes_per_token=100)
    return TieredCache(num_blocks, block_size, host_bytes, mover, policy=policy, profile=PROFILE), mover


def request(cache: TieredCache, keys: Sequence[str], sizes: dict[str, int], *,
            question: int = 0, hold: bool = False) -> list[Node]:
    """The runner's flow: match, acquire, allocate+insert the rest, record, release."""
    acq = cache.acquire(cache.match([K(k) for k in keys]))
    path = list(acq.nodes)
    computed = [False] * len(path)
    parent = path[-1] if path else None
    beta = question
    try:
        for key in keys[len(path):]:
            blocks = cache.allocate(blocks_for(sizes[key], cache.block_size))
            parent = cache.insert(parent, K(key), sizes[key], blocks)
            path.append(parent)
            computed.append(True)
            beta += sizes[key]
    except CacheBudgetError:
        cache.release(path)
        raise
    cache.record_request(path, computed, acq.cached_tokens, max(beta, 1))
    if not hold:
        cache.release(path)
    cache.check_invariants()
    return path


SIZES = dict(A=20, B=20, C=20, E=40, F=20)


def test_hand_computed_pgdsf_scenario() -> None:
    cache, mover = make(num_blocks=6, host_bytes=4000)
    a, = request(cache, ["A"], SIZES)  # alpha 0, beta 20: 0.01 s/token
    assert a.priority[DEV] == pytest.approx(0.01)
    _, b = request(cache, ["A", "B"], SIZES)  # A hit; B computed with alpha=20: 0.0102 s/token
    assert a.priority[DEV] == pytest.approx(0.02)  # 0 + 2 * 0.01
    assert b.priority[DEV] == pytest.approx(0.0102)
    for _ in range(3):
        c, = request(cache, ["C"], SIZES)
    assert c.priority[DEV] == pytest.approx(0.03)  # 3 * 0.01
    assert cache.device_used_blocks == 6 and cache.clock(DEV) == 0.0

    # E needs 4 blocks. Device leaves: B 0.0102, C 0.03 (A has B below it).
    # Pop B (clock 0.0102) -> host; A becomes a leaf (0.02) and is popped next (clock 0.02).
    e, = request(cache, ["E"], SIZES)
    assert cache.clock(DEV) == pytest.approx(0.02)
    assert a.tiers == (HOST,) and b.tiers == (HOST,) and c.in_device
    assert a.priority[HOST] == pytest.approx(0.02) and b.priority[HOST] == pytest.approx(0.0102)
    assert mover.swap_outs == [((2, 3), 20), ((0, 1), 20)]  # B first, then its parent A
    assert cache.stats.swap_outs == 2 and cache.stats.device_evictions == 2
    assert e.priority[DEV] == pytest.approx(0.03)  # clock 0.02 + 1 * 0.01
    assert cache.host_used_bytes == 4000
    assert cache.match([K("A"), K("B")]).tiers == (HOST, HOST)

    c, = request(cache, ["C"], SIZES)  # C: clock 0.02 + 4 * 0.01 = 0.06
    assert c.priority[DEV] == pytest.approx(0.06)

    # F needs 2 blocks: device leaves C 0.06, E 0.03 -> E (clock 0.03) goes to host, which needs
    # 4000 B: host leaves are B 0.0102 only (A has B below) -> B removed (host clock 0.0102),
    # then A joins and is removed (host clock 0.02). E enters host at 0.02 + 1 * 0.01.
    f, = request(cache, ["F"], SIZES)
    assert cache.clock(DEV) == pytest.approx(0.03)
    assert cache.clock(HOST) == pytest.approx(0.02)
    assert cache.stats.host_evictions == 2
    assert not cache.tree.contains(a) and not cache.tree.contains(b)
    assert e.tiers == (HOST,) and e.priority[HOST] == pytest.approx(0.03)
    assert f.priority[DEV] == pytest.approx(0.04)  # clock 0.03 + 0.01
    assert cache.match([K("A")]).nodes == ()
    assert mover.live_bytes == cache.host_used_bytes == 4000
    assert len(cache.tree) == 3


def test_pgdsf_and_lru_choose_different_victims() -> None:
    victims = {}
    for policy in ("pgdsf", "lru"):
        cache, _ = make(num_blocks=4, host_bytes=0, policy=policy)
        sizes = dict(X=20, Y=20, Z=20)
        for _ in range(3):
            x, = request(cache, ["X"], sizes)  # frequent but long ago
        y, = request(cache, ["Y"], sizes)  # once, recently
        request(cache, ["Z"], sizes)  # needs 2 blocks: one of X, Y must go
        victims[policy] = "X" if not cache.tree.contains(x) else "Y"
        assert cache.tree.contains(x) != cache.tree.contains(y)
    assert victims == {"pgdsf": "Y", "lru": "X"}  # PGDSF: 0.01 < 0.03 ; LRU: access 3 < 4


def test_swap_out_only_once() -> None:
    cache, mover = make(num_blocks=2, host_bytes=10_000)
    sizes = dict(X=20, Y=10)  # X 2 blocks, Y 1 block: sizes tell the copies apart
    x, = request(cache, ["X"], sizes)
    request(cache, ["Y"], sizes)  # 1st device eviction of X: copy to host
    assert x.tiers == (HOST,) and cache.stats.swap_outs == 1
    acq = cache.acquire(cache.match([K("X")]))  # swap in (evicts Y, copying it)
    assert acq.host_hits == 1 and acq.device_hits == 0 and x.tiers == (DEV, HOST)
    assert cache.stats.swap_ins == 1 and len(mover.swap_ins) == 1
    cache.release(acq.nodes)
    blocks = cache.allocate(2)  # 2nd device eviction of X: host copy exists -> no copy
    assert x.tiers == (HOST,)
    x_copies = [n for _, n in mover.swap_outs if n == 20]
    assert len(x_copies) == 1
    assert cache.stats.swap_outs == 2  # X once, Y once
    assert cache.stats.device_frees_without_copy == 1 and cache.stats.device_evictions == 3
    cache.free(blocks)
    cache.check_invariants()


def test_locked_nodes_are_never_evicted() -> None:
    cache, _ = make(num_blocks=6, host_bytes=0)
    sizes = dict(A=20, B=20, C=20)
    held = request(cache, ["A", "B"], sizes, hold=True)
    request(cache, ["C"], sizes)
    blocks = cache.allocate(2)  # only C can go
    assert all(n.in_device for n in held) and cache.stats.dropped_nodes == 1
    before = cache.stats.device_evictions
    with pytest.raises(CacheBudgetError, match="need 1 device blocks"):
        cache.allocate(1)  # everything else is locked or request-owned
    assert cache.stats.device_evictions == before  # a failed allocate evicts nothing
    cache.free(blocks)
    cache.release(held)
    cache.allocate(6)  # now everything can be evicted
    assert len(cache.tree) == 0
    cache.check_invariants()


def test_allocate_failure_has_no_side_effects() -> None:
    cache, _ = make(num_blocks=4, host_bytes=10_000)
    sizes = dict(A=20, B=20)
    held = request(cache, ["A"], sizes, hold=True)
    request(cache, ["B"], sizes)
    with pytest.raises(CacheBudgetError):
        cache.allocate(3)  # 2 free-able (B) + 0 free < 3
    assert cache.tree.contains(held[0]) and cache.match([K("B")]).tiers == (DEV,)
    assert cache.stats.device_evictions == 0


def test_one_document_larger_than_the_device_arena() -> None:
    cache, _ = make(num_blocks=4, host_bytes=10_000)
    with pytest.raises(CacheBudgetError) as info:
        request(cache, ["BIG"], dict(BIG=50))  # 5 blocks > 4
    assert "5" in str(info.value) and "4" in str(info.value)
    cache.check_invariants()


def test_host_tier_disabled_drops_instead_of_swapping() -> None:
    cache, mover = make(num_blocks=4, host_bytes=0)
    sizes = dict(A=20, B=20, C=20)
    a, b = request(cache, ["A", "B"], sizes)  # A 0.01, B 0.01 (both computed at alpha 0)
    c, = request(cache, ["C"], sizes)  # only B is a device leaf: dropped, clock 0.01
    assert not cache.tree.contains(b) and cache.clock(DEV) == pytest.approx(0.01)
    assert c.priority[DEV] == pytest.approx(0.02)  # 0.01 + 1 * 0.01
    b2, = request(cache, ["B"], sizes)  # B after the root is another node; leaves A 0.01, C 0.02
    assert not cache.tree.contains(a) and cache.tree.contains(c) and b2 is not b
    assert mover.swap_outs == [] and cache.host_used_bytes == 0
    assert cache.stats.swap_outs == 0 and cache.stats.dropped_nodes == 2
    assert all(n.tiers == (DEV,) for n in cache.tree)
    assert cache.match([K("A"), K("B")]).nodes == ()


def test_host_full_of_evictable_copies_makes_room() -> None:
    cache, _ = make(num_blocks=4, host_bytes=4000)
    sizes = dict(A=20, B=20, C=40)
    a, b = request(cache, ["A", "B"], sizes)
    c, = request(cache, ["C"], sizes)  # B, then its parent A, to host: 4000 B, host full
    assert a.tiers == (HOST,) and b.tiers == (HOST,) and cache.host_used_bytes == 4000
    held = request(cache, ["C"], sizes, hold=True)  # C locked: the device has no room for A
    acq = cache.acquire(cache.match([K("A"), K("B")]))
    assert acq.nodes == () and acq.cached_tokens == 0 and a.lock_ref == b.lock_ref == 0
    cache.release(held)
    cache.allocate(4)  # C (4000 B, no host copy) must go to host: B then A leave the host
    assert not cache.tree.contains(a) and not cache.tree.contains(b)
    assert c.tiers == (HOST,) and cache.host_used_bytes == 4000
    assert cache.stats.host_evictions == 2 and cache.clock(HOST) == pytest.approx(0.01)
    cache.check_invariants()


def test_node_larger_than_the_host_budget_is_dropped_with_its_subtree() -> None:
    cache, mover = make(num_blocks=6, host_bytes=1000)
    p, q = request(cache, ["P", "Q"], dict(P=50, Q=10))  # P 5 blocks, Q 1 block
    request(cache, ["R"], dict(R=50))  # Q -> host (1000 B); P (5000 B > 1000) dropped with Q
    assert not cache.tree.contains(p) and not cache.tree.contains(q)
    assert cache.stats.dropped_nodes == 2 and cache.stats.swap_outs == 1
    assert cache.host_used_bytes == 0 == mover.live_bytes
    cache.check_invariants()


def test_acquire_truncates_when_locked_data_fills_the_device() -> None:
    cache, mover = make(num_blocks=4, host_bytes=10_000)
    sizes = dict(A=10, B=20, L=20, X=40)
    a, b = request(cache, ["A", "B"], sizes)  # 1 + 2 blocks
    request(cache, ["X"], sizes)  # 4 blocks: B then A to host
    assert a.tiers == (HOST,) and b.tiers == (HOST,)
    held = request(cache, ["L"], sizes, hold=True)  # 2 blocks locked (X leaves the device)
    own = cache.allocate(1)  # request-owned: 1 block left free
    acq = cache.acquire(cache.match([K("A"), K("B")]))
    assert acq.nodes == (a,) and acq.host_hits == 1 and acq.cached_tokens == 10
    assert a.lock_ref == 1 and b.lock_ref == 0 and b.tiers == (HOST,)
    assert a.tiers == (DEV, HOST)  # host copy kept
    assert acq.blocks == (tuple(a.device_blocks),)
    cache.check_invariants()
    cache.release(acq.nodes)
    cache.release(held)
    cache.free(own)
    cache.check_invariants()


def test_insert_existing_child_reuses_it() -> None:
    cache, _ = make(num_blocks=8, host_bytes=10_000)
    x, = request(cache, ["X"], dict(X=20))
    blocks = cache.allocate(2)
    used = cache.device_used_blocks
    same = cache.insert(None, K("X"), 20, blocks)
    assert same is x and x.lock_ref == 1 and cache.device_used_blocks == used - 2
    cache.release([x])
    with pytest.raises(InvalidRequestError):
        cache.release([x])
    with pytest.raises(InvalidRequestError):
        cache.insert(None, K("Y"), 20, [7, 6])  # not allocated by a request
    cache.check_invariants()


def test_constructor_validation() -> None:
    mover = SimulatedMover()
    with pytest.raises(InvalidRequestError, match="PrefillProfile"):
        TieredCache(4, 16, 0, mover)
    with pytest.raises(UnknownPolicyError):
        TieredCache(4, 16, 0, mover, policy="nope")
    TieredCache(4, 16, 0, mover, policy="lru")  # no profile needed


def test_clear_keeps_locked_paths() -> None:
    cache, mover = make(num_blocks=8, host_bytes=10_000)
    sizes = dict(A=10, B=10, C=10)
    held = request(cache, ["A", "B"], sizes, hold=True)
    request(cache, ["C"], sizes)
    cache.clear()
    assert set(cache.tree) == set(held)
    cache.release(held)
    cache.clear()
    assert len(cache.tree) == 0 and cache.device_used_blocks == 0 and mover.live_bytes == 0


def test_block_allocator() -> None:
    alloc = BlockAllocator(4)
    assert alloc.allocate(0) == [] and alloc.allocate(3) == [0, 1, 2]
    with pytest.raises(CacheBudgetError):
        alloc.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([3])
    with pytest.raises(ValueError):
        alloc.free([9])
    with pytest.raises(ValueError):
        alloc.free([1, 1])
    alloc.free([1])
    assert (alloc.num_free, alloc.num_used, alloc.num_blocks) == (2, 2, 4)
    assert blocks_for(0, 16) == 0 and blocks_for(16, 16) == 1 and blocks_for(17, 16) == 2


@pytest.mark.parametrize("policy", ["pgdsf", "gdsf", "lru", "lfu"])
@pytest.mark.parametrize("host_bytes", [0, 6000, 40_000])
def test_randomized_budgets_and_invariants(policy: str, host_bytes: int) -> None:
    rng = random.Random(f"{policy}-{host_bytes}")
    mover = SimulatedMover(bytes_per_token=100)
    cache = TieredCache(40, 8, host_bytes, mover, policy=policy, profile=PROFILE)
    docs = [f"d{i}" for i in range(12)]
    sizes = {d: rng.randint(3, 50) for d in docs} | {"sys": 12}
    held: list[list[Node]] = []
    own: list[list[int]] = []
    failures = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.70:
            keys = (["sys"] if rng.random() < 0.7 else []) + rng.sample(docs, rng.randint(1, 3))
            hold = rng.random() < 0.15
            try:
                path = request(cache, keys, sizes, question=rng.randint(0, 20), hold=hold)
            except CacheBudgetError:
                failures += 1
            else:
                if hold:
                    held.append(path)
        elif op < 0.85 and held:
            cache.release(held.pop(rng.randrange(len(held))))
        elif op < 0.92:
            try:
                own.append(cache.allocate(rng.randint(0, 6)))
            except CacheBudgetError:
                failures += 1
        elif op < 0.98 and own:
            cache.free(own.pop(rng.randrange(len(own))))
        elif op < 0.99:
            cache.clear()
        cache.check_invariants()
        assert cache.device_used_blocks <= 40 and cache.host_used_bytes <= host_bytes
        assert mover.live_bytes == cache.host_used_bytes
        assert all(n.lock_ref > 0 for p in held for n in p)
        if len(held) > 2:
            cache.release(held.pop(0))
        if len(own) > 2:
            cache.free(own.pop(0))
    st = cache.stats
    assert st.device_evictions > 50 and st.misses > 50 and st.device_hits > 50
    if host_bytes:
        assert st.swap_outs > 0 and st.swap_ins > 0 and st.host_hits > 0
        assert st.host_evictions > 0
        assert st.device_frees_without_copy > 0 or host_bytes < 10_000  # a tiny host churns
    else:
        assert st.swap_outs == 0 and st.dropped_nodes == st.device_evictions
    assert failures < 150, failures


def test_stale_match_is_cut_where_it_stopped_being_valid() -> None:
    cache, _ = make(num_blocks=4, host_bytes=0)
    sizes = dict(A=20, B=20, C=20)
    a, b = request(cache, ["A", "B"], sizes)
    stale = cache.match([K("A"), K("B")])
    request(cache, ["C"], sizes)  # drops B (host disabled)
    acq = cache.acquire(stale)
    assert acq.nodes == (a,) and acq.device_hits == 1 and b.lock_ref == 0
    cache.release(acq.nodes)
    cache.check_invariants()


def test_policies_without_profile_still_count() -> None:
    cache = TieredCache(4, BS, 0, SimulatedMover(), policy="lfu")
    x, = request(cache, ["X"], dict(X=20))
    request(cache, ["X"], dict(X=20))
    assert (x.frequency, x.num_computed, x.total_cost, x.last_access) == (2, 1, 0.0, 2)
    assert x.priority[DEV] == 2.0 and cache.stats.misses == 1 and cache.stats.device_hits == 1
    with pytest.raises(InvalidRequestError):
        cache.record_request([x], [True], 0, 0)  # a computed node needs beta >= 1


def test_check_invariants_catches_a_broken_tier_order() -> None:
    cache, _ = make(num_blocks=8, host_bytes=10_000)
    a, b = request(cache, ["A", "B"], dict(A=10, B=10))
    a.host_kv, saved = object(), a.device_blocks
    a.device_blocks = None  # A host-only (by hand) while its child B is on device
    with pytest.raises(AssertionError, match="on device but parent"):
        cache.check_invariants()
    a.device_blocks, a.host_kv = saved, None
    cache.check_invariants()


# ---- the request protocol: admit / commit / finish ----------------------------------------------
def _specs(*pairs):
    from ragcache_backend.cache.lease import SegmentSpec

    return [SegmentSpec(K(k), n) for k, n in pairs]


def test_admit_commit_finish_reuses_the_prefix_and_frees_the_tail():
    cache, _ = make(num_blocks=20, host_bytes=0)
    lease = cache.admit(_specs(("S", 10), ("A", 25)), tail_tokens=12)
    assert lease is not None and lease.reused == 0 and lease.cached_tokens == 0
    assert [len(p.blocks) for p in lease.pending] == [1, 3] and len(lease.tail_blocks) == 2
    cache.commit(lease, rest_tokens=8)
    assert [n.key for n in lease.path] == [K("S"), K("A")] and cache.locked_nodes == 2
    cache.finish(lease)
    cache.finish(lease)  # idempotent
    assert cache.locked_nodes == 0 and cache.request_blocks == 0 and cache.device_used_blocks == 4
    again = cache.admit(_specs(("S", 10), ("A", 25), ("B", 5)), tail_tokens=3)
    assert again.reused == 2 and again.cached_tokens == 35 and again.device_hits == 2
    assert [p.spec.key for p in again.pending] == [K("B")]
    cache.commit(again, rest_tokens=1)
    with pytest.raises(InvalidRequestError):
        cache.commit(again, rest_tokens=1)  # once only
    cache.finish(again)
    cache.check_invariants()


def test_no_room_now_is_none_and_never_fits_raises():
    cache, _ = make(num_blocks=6, host_bytes=0)
    first = cache.admit(_specs(("A", 30)), tail_tokens=20)  # 3 + 2 blocks, all held while it runs
    assert first is not None
    assert cache.admit(_specs(("B", 30)), tail_tokens=10) is None  # 4 blocks: fits, but not now
    assert cache.request_blocks == 5 and cache.locked_nodes == 0  # the refused request holds nothing
    with pytest.raises(CacheBudgetError, match="device arena holds only 6"):
        cache.admit(_specs(("C", 50)), tail_tokens=20)  # 7 blocks: can never fit
    cache.commit(first, rest_tokens=20)
    cache.finish(first)
    later = cache.admit(_specs(("B", 30)), tail_tokens=10)  # A (unlocked) is evicted for it
    assert later is not None and cache.stats.device_evictions == 1
    cache.finish(later)  # released before commit: its pending blocks are freed, nothing inserted
    assert [n.key for n in cache.tree] == [] and cache.device_used_blocks == 0
    cache.check_invariants()


class FailingSwapOut(SimulatedMover):
    """Copies to host fail while ``broken`` is set."""

    broken = False

    def swap_out(self, blocks, num_tokens):
        if self.broken:
            raise OSError("copy to host failed")
        return SimulatedMover.swap_out(self, blocks, num_tokens)


def test_a_failed_swap_out_keeps_the_victim_a_candidate() -> None:
    """A device victim whose copy to host fails stays on device and stays evictable."""
    mover = FailingSwapOut(bytes_per_token=100)
    cache, _ = make(num_blocks=4, host_bytes=10_000, mover=mover)
    request(cache, ["A"], dict(A=20))
    mover.broken = True
    with pytest.raises(OSError, match="copy to host failed"):
        cache.allocate(4)  # A must go to host first
    a = cache.tree.root.children[K("A")]
    assert a.in_device and not a.in_host and cache.request_blocks == 0
    cache.check_invariants()  # A is still in the device heap
    mover.broken = False
    blocks = cache.allocate(4)
    assert a.tiers == (HOST,)
    cache.free(blocks)
    cache.check_invariants()


# ---- chunked prefill: commit_prefix then commit ---------------------------------------------------
def test_commit_prefix_inserts_whole_pieces_at_once_then_commit_the_rest():
    cache, _ = make(num_blocks=20, host_bytes=0)
    lease = cache.admit(_specs(("S", 10), ("A", 25), ("B", 15)), tail_tokens=12)
    assert cache.commit_prefix(lease, 0, rest_tokens=8) == []  # the first chunk completed nothing
    cache.check_invariants()
    fresh = cache.commit_prefix(lease, 2, rest_tokens=8)  # S and A computed whole; B only in part
    assert [n.key for n in fresh] == [K("S"), K("A")] and lease.committed_pieces == 2 and not lease.committed
    assert [n.key for n in cache.tree] == [K("S"), K("A")] and cache.locked_nodes == 2
    assert all(n.frequency == 1 and n.num_computed == 1 for n in fresh)  # Alg. 1 counted them at once
    cache.check_invariants()
    # another request reuses them while this prefill goes on
    other = cache.admit(_specs(("S", 10), ("A", 25), ("C", 5)), tail_tokens=3)
    assert other.reused == 2 and other.cached_tokens == 35
    assert cache.commit_prefix(lease, 2, rest_tokens=8) == []  # nothing new: idempotent
    cache.commit(lease, rest_tokens=8)  # the last chunk: B, and the lease is committed
    assert [n.key for n in lease.path] == [K("S"), K("A"), K("B")] and lease.committed
    assert [n.frequency for n in lease.path] == [1, 1, 1]  # each node counted once for this request
    with pytest.raises(InvalidRequestError):
        cache.commit_prefix(lease, 3, rest_tokens=8)  # committed: nothing more
    cache.finish(lease)
    cache.finish(other)
    assert cache.locked_nodes == 0 and cache.request_blocks == 0
    cache.check_invariants()


def test_a_lease_released_between_chunks_keeps_only_its_whole_committed_pieces():
    cache, _ = make(num_blocks=20, host_bytes=0)
    lease = cache.admit(_specs(("S", 10), ("A", 25), ("B", 15)), tail_tokens=12)
    cache.commit_prefix(lease, 1, rest_tokens=8)
    cache.finish(lease)  # cancelled (or failed) before its last chunk
    assert [n.key for n in cache.tree] == [K("S")] and cache.tree.root.children[K("S")].num_tokens == 10
    assert cache.locked_nodes == 0 and cache.request_blocks == 0 and cache.device_used_blocks == 1
    with pytest.raises(InvalidRequestError):
        cache.commit_prefix(lease, 2, rest_tokens=8)  # released
    again = cache.admit(_specs(("S", 10), ("A", 25)), tail_tokens=3)
    assert again.reused == 1 and again.cached_tokens == 10
    cache.finish(again)
    cache.check_invariants()


def test_commit_prefix_stops_at_a_piece_that_cannot_hang_from_the_tree():
    from ragcache_backend.cache.lease import SegmentSpec

    cache, _ = make(num_blocks=20, host_bytes=0)
    first = cache.admit([SegmentSpec(K("S"), 2, token_ids=(1, 2))], tail_tokens=1)
    cache.commit(first, rest_tokens=1)
    cache.finish(first)
    # a collision: key S again but other tokens; nothing of this request hangs from the tree
    lease = cache.admit([SegmentSpec(K("S"), 2, token_ids=(3, 4)), SegmentSpec(K("T"), 3, token_ids=(5, 6, 7))],
                        tail_tokens=2)
    assert lease.reused == 0
    assert cache.commit_prefix(lease, 1, rest_tokens=1) == [] and lease.committed_pieces == 1
    cache.commit(lease, rest_tokens=1)
    assert lease.path == [] and [n.key for n in cache.tree] == [K("S")]
    cache.check_invariants()
    cache.finish(lease)
    assert cache.request_blocks == 0 and cache.locked_nodes == 0
    cache.check_invariants()


def test_commit_prefix_refuses_bad_counts_and_variant_leases():
    cache, _ = make(num_blocks=20, host_bytes=0)
    lease = cache.admit(_specs(("S", 10), ("A", 25)), tail_tokens=2)
    for bad in (-1, 3):
        with pytest.raises(InvalidRequestError):
            cache.commit_prefix(lease, bad, rest_tokens=1)
    lease.pieces[1].use = object()  # stands for a chunk variant in use (only its presence is read)
    with pytest.raises(InvalidRequestError, match="committed whole"):
        cache.commit_prefix(lease, 1, rest_tokens=1)
    lease.pieces[1].use = None
    cache.finish(lease)
    cache.check_invariants()
