"""The cache's chunk-mode protocol (admit with a recompute rule / commit with statistics / finish) on a simulated mover:
which variant serves a chunk, what becomes an exact or an approximate tree node, the variant caps
(Cache-Craft §3.3) and that nothing leaks."""

from __future__ import annotations

import pytest

from ragcache_backend.cache.chunk_reuse import RecomputeRule, VariantInfo, VariantStats
from ragcache_backend.cache.knowledge_tree import SegmentKey
from ragcache_backend.cache.lease import ChunkSpec
from ragcache_backend.cache.profile import PrefillProfile
from ragcache_backend.cache.tiers import TieredCache
from ragcache_backend.errors import CacheBudgetError, InvalidRequestError
from tests.cache.sim_mover import SimulatedMover

PROFILE = PrefillProfile(alphas=(0, 1000), betas=(1, 1001), times=((0.01, 10.01), (0.02, 20.02)))
K = SegmentKey
RULE = RecomputeRule()


def make(blocks: int = 40, host: int = 0, per_chunk: int = 4, total: int = 1024) -> TieredCache:
    cache = TieredCache(blocks, 10, host, SimulatedMover(bytes_per_token=100), policy="pgdsf", profile=PROFILE)
    cache.configure_variants(fingerprint="model-a/bf16", per_chunk=per_chunk, total=total)
    return cache


def spec(key: str, n: int, chunk: bool = True) -> ChunkSpec:
    return ChunkSpec(K(key), n, chunk)


def stats_for(chunk: str, n: int, context: tuple[str, ...], inter: float = 1.0) -> VariantStats:
    """A variant whose tokens gave ``inter`` to each prefix segment and 4.0 to themselves."""
    return VariantStats(chunk, n, context, (10,) * len(context), (inter,) * len(context), 4.0,
                        tuple(float(i % 3) for i in range(n)))


def run(cache: TieredCache, specs, *, exact_upto: int, alpha: float = 1.0, record: bool = True,
        fresh_above: float = 1.0):
    """admit -> (prefill) -> commit with statistics for every fresh document -> finish."""
    lease = cache.admit(specs, tail_tokens=5, exact_upto=exact_upto, rule=RecomputeRule(alpha=alpha), fresh_above=fresh_above)
    assert lease is not None
    stats = [stats_for(p.spec.key, p.spec.num_tokens, p.context) if record and p.spec.chunk and p.use is None else None
             for p in lease.pieces]
    cache.commit(lease, rest_tokens=1, stats=stats)
    cache.finish(lease)
    cache.check_invariants()
    assert cache.locked_nodes == 0 and cache.request_blocks == 0
    return lease


def test_exact_context_becomes_tree_nodes_with_variants_and_a_moved_chunk_is_served_from_one():
    cache = make()
    first = run(cache, [spec("SYS", 10, False), spec("A", 20), spec("B", 20), spec("Q1", 5, False)], exact_upto=4)
    assert [p.use for p in first.pieces] == [None] * 4  # nothing cached yet
    assert [n.key for n in cache.tree.match_prefix([K("SYS"), K("A"), K("B"), K("Q1")])] == ["SYS", "A", "B", "Q1"]
    assert len(cache.variants(K("A"))) == 1 and len(cache.variants(K("B"))) == 1
    assert cache.variants(K("B"))[0].variant.start == 30
    # B first, then A, after a new question: SYS exact, both documents from their variants
    lease = cache.admit([spec("SYS", 10, False), spec("Q2", 5, False), spec("B", 20), spec("A", 20)],
                               tail_tokens=5, exact_upto=4, rule=RULE)
    assert [n.key for n in lease.prefix] == ["SYS"] and lease.cached_tokens == 10
    b, a = lease.pieces[1], lease.pieces[2]
    assert b.use is not None and b.use.delta == 15 - 30 and a.use is not None and a.use.delta == 35 - 10
    # B's variant saw (SYS, A): SYS still there, A now after it -> beta = 1/2, CFO = CCI * 1/2
    assert 0 < b.use.cfo < 1 and len(b.use.recompute) == pytest.approx(b.use.cfo * 20, abs=1)
    assert lease.reused_tokens + lease.recomputed_tokens == 40 and cache.locked_nodes == 3
    cache.commit(lease, rest_tokens=1, stats=[None, None, None])
    # the copy sources are unlocked at commit; SYS, Q2 and the two fixed chunks (now nodes) stay locked
    assert cache.locked_nodes == 4 and [p.node.approximate for p in lease.pieces] == [False, True, True]
    cache.finish(lease)
    assert cache.stats.variant_hits == 2 and cache.variants(K("B"))[0].variant.reuse_score > 0
    keys = [K("SYS"), K("Q2"), K("B"), K("A")]
    assert len(cache.tree.match_prefix(keys)) == 2  # exact matching stops before approximate KV
    assert len(cache.tree.match_prefix(keys, approximate=True, rule=RULE.key)) == 4  # chunk modes follow it
    # ... made under this rule only: another rule (or none recorded) stops before the approximate KV
    assert len(cache.tree.match_prefix(keys, approximate=True, rule=RecomputeRule(alpha=0.5).key)) == 2
    assert len(cache.tree.match_prefix(keys, approximate=True)) == 2
    cache.check_invariants()


def test_kv_approximated_under_one_recompute_rule_never_serves_another():
    """The recompute rule is part of the approximate key: a prefix node and a chunk variant built
    over reused chunks under one rule are followed / chosen by requests under that rule only."""
    cache = make()
    run(cache, [spec("SYS", 10, False), spec("A", 20), spec("B", 20), spec("Q1", 5, False)], exact_upto=4)
    # Q2, B, A under RULE: B and A reused; C after them is fresh over approximate KV (a variant)
    lease = cache.admit([spec("SYS", 10, False), spec("Q2", 5, False), spec("B", 20), spec("A", 20), spec("C", 20)],
                        tail_tokens=5, exact_upto=5, rule=RULE)
    assert lease.rule_key == RULE.key
    cache.commit(lease, rest_tokens=1, stats=[None, None, None, stats_for(K("C"), 20, lease.pieces[3].context)])
    cache.finish(lease)
    c_nodes = cache.variants(K("C"))
    assert len(c_nodes) == 1 and c_nodes[0].approximate
    lead = [spec("SYS", 10, False), spec("Q2", 5, False), spec("B", 20), spec("A", 20), spec("C", 20)]
    same = cache.admit(lead, tail_tokens=5, exact_upto=5, rule=RULE)
    assert len(same.prefix) == 5  # the whole approximate path, under the same rule
    cache.finish(same)
    other = RecomputeRule(alpha=RULE.alpha * 2)
    assert other.key != RULE.key
    lease = cache.admit(lead, tail_tokens=5, exact_upto=5, rule=other)
    assert [n.key for n in lease.prefix] == ["SYS", "Q2"]  # approximate nodes of another rule are not followed
    assert lease.pieces[2].use is None or not lease.pieces[2].use.node.approximate  # nor is C's approximate variant
    cache.finish(lease)
    cache.check_invariants()


def test_a_fresh_chunk_after_reused_kv_is_an_approximate_node_and_a_variant():
    cache = make()
    run(cache, [spec("SYS", 10, False), spec("A", 20)], exact_upto=2)
    lease = run(cache, [spec("SYS", 10, False), spec("Q", 5, False), spec("A", 20), spec("C", 30)], exact_upto=4)
    assert lease.pieces[1].use is not None and lease.pieces[2].use is None
    variants = cache.variants(K("C"))
    assert len(variants) == 1 and variants[0].approximate and variants[0].key != K("C")
    keys = [K("SYS"), K("Q"), K("A"), K("C")]
    assert [n.key for n in cache.tree.match_prefix(keys)] == ["SYS", "Q"]  # exact matching never reaches it
    # an exact repeat in a chunk mode reuses the whole prompt, approximate part included
    again = cache.admit([spec("SYS", 10, False), spec("Q", 5, False), spec("A", 20), spec("C", 30)],
                               tail_tokens=1, exact_upto=4, rule=RULE)
    assert len(again.prefix) == 4 and again.pieces == [] and again.approximate_prefix_tokens == 50
    cache.finish(again)
    # ... but never for a request that recomputes everything: its prefix stops at the exact KV
    full = cache.admit([spec("SYS", 10, False), spec("Q", 5, False), spec("A", 20), spec("C", 30)],
                              tail_tokens=1, exact_upto=4, rule=RecomputeRule("all"))
    assert [n.key for n in full.prefix] == ["SYS", "Q"] and full.approximate_prefix_tokens == 0
    assert all(p.use is None or len(p.use.recompute) == p.spec.num_tokens for p in full.pieces)
    cache.finish(full)
    # a later request elsewhere reuses the approximate node as C's variant
    other = cache.admit([spec("SYS", 10, False), spec("C", 30)], tail_tokens=1, exact_upto=2, rule=RULE)
    assert other.pieces[0].use is not None and other.pieces[0].use.node is variants[0]
    cache.finish(other)  # released before commit: nothing inserted, nothing leaks
    assert cache.locked_nodes == 0 and cache.request_blocks == 0
    cache.check_invariants()


def test_chunk_mode_serves_documents_from_variants_even_where_the_exact_path_exists():
    cache = make()
    run(cache, [spec("SYS", 10, False), spec("A", 20), spec("Q", 5, False)], exact_upto=3)
    lease = cache.admit([spec("SYS", 10, False), spec("A", 20), spec("Q", 5, False)], tail_tokens=1,
                               exact_upto=1, rule=RULE)
    use = lease.pieces[0].use
    assert [n.key for n in lease.prefix] == ["SYS"] and use is not None
    assert use.cfo == 0.0 and use.recompute == () and use.delta == 0  # same context: nothing to fix
    cache.finish(lease)
    cache.check_invariants()


def test_variants_of_another_model_or_of_an_edited_document_are_never_served():
    cache = make()
    run(cache, [spec("SYS", 10, False), spec("A", 20)], exact_upto=2)
    node = cache.variants(K("A"))[0]
    node.variant.fingerprint = "model-b/fp32"  # e.g. loaded from a file written under another model
    assert cache.variants(K("A")) == [] and len(cache.variants_any(K("A"))) == 1
    lease = cache.admit([spec("SYS", 10, False), spec("Q", 3, False), spec("A", 20)], tail_tokens=1,
                               exact_upto=3, rule=RULE)
    assert lease.pieces[1].use is None
    cache.finish(lease)
    edited = cache.admit([spec("SYS", 10, False), spec("Q", 3, False), spec("A'", 20)], tail_tokens=1,
                                exact_upto=3, rule=RULE)
    assert edited.pieces[1].use is None  # another content hash: another chunk
    cache.finish(edited)
    cache.check_invariants()


def test_the_same_document_twice_in_a_prompt_is_a_variant_once():
    cache = make()
    lease = run(cache, [spec("SYS", 10, False), spec("A", 20), spec("Q", 3, False), spec("A", 20)], exact_upto=4)
    assert lease.pieces[3].context == ("SYS", "A", "Q") and len(cache.variants(K("A"))) == 1
    again = cache.admit([spec("SYS", 10, False), spec("R", 3, False), spec("A", 20), spec("A", 20)],
                               tail_tokens=1, exact_upto=4, rule=RULE)
    assert again.pieces[1].use is not None and again.pieces[2].use is None  # the repeat is computed
    assert again.pieces[2].context == ("SYS", "R", "A")
    cache.finish(again)
    cache.check_invariants()


def test_per_chunk_cap_evicts_the_lowest_reuse_score():
    cache = make(per_chunk=2)
    for i in range(3):  # three contexts for A: CFO = CCI (0.73) * (1 - beta' = 1/2) > 0.3, so each is computed anew
        lease = run(cache, [spec("SYS", 10, False), spec(f"P{i}", 10), spec("A", 20)], exact_upto=3, fresh_above=0.3)
        assert lease.pieces[-1].use is None
    variants = cache.variants(K("A"))
    assert len(variants) == 2 and cache.stats.variant_evictions == 1
    assert {n.variant.stats.prefix for n in variants} == {("SYS", "P1"), ("SYS", "P2")}  # the oldest, f_r 0, went
    run(cache, [spec("SYS", 10, False), spec("P3", 10), spec("A", 20)], exact_upto=3)  # reused: f_r grows
    assert cache.stats.variant_hits == 1 and cache.variants(K("A"))[0].variant.reuse_score > 2
    cache.check_invariants()


def test_total_cap_and_budget_errors():
    cache = make(total=3)
    for name in "ABCD":
        run(cache, [spec("SYS", 10, False), spec(name, 10)], exact_upto=2)
    assert cache.num_variants == 3
    with pytest.raises(CacheBudgetError):
        cache.admit([spec("BIG", 500)], tail_tokens=1, exact_upto=1, rule=RULE)
    with pytest.raises(ValueError):
        RecomputeRule(alpha=-1.0)
    with pytest.raises(InvalidRequestError):
        cache.admit([spec("A", 10)], tail_tokens=-1, exact_upto=1, rule=RULE)
    with pytest.raises(InvalidRequestError):
        cache.configure_variants(fingerprint="x", per_chunk=0)
    cache.check_invariants()


def test_no_room_now_returns_none_and_holds_nothing():
    cache = make(blocks=8)
    first = cache.admit([spec("SYS", 10, False), spec("A", 30)], tail_tokens=20, exact_upto=2, rule=RULE)
    assert first is not None  # 1 + 3 + 2 blocks held
    assert cache.admit([spec("B", 30)], tail_tokens=1, exact_upto=1, rule=RULE) is None
    assert cache.request_blocks == 6 and cache.locked_nodes == 0
    cache.finish(first)
    assert cache.request_blocks == 0 and cache.device_used_blocks == 0
    cache.check_invariants()


def test_variants_swapped_to_host_are_swapped_back_in_to_serve():
    cache = make(blocks=9, host=100_000)
    run(cache, [spec("SYS", 10, False), spec("A", 30)], exact_upto=2)
    run(cache, [spec("X", 40, False), spec("Y", 30, False)], exact_upto=2)  # pushes A (and SYS) to host
    a = cache.variants(K("A"))
    assert a and not a[0].in_device and a[0].in_host
    lease = cache.admit([spec("SYS", 10, False), spec("Q", 5, False), spec("A", 30)], tail_tokens=1,
                               exact_upto=3, rule=RULE)
    assert lease is not None and lease.pieces[1].use is not None and lease.host_hits >= 1
    cache.finish(lease)
    cache.check_invariants()


def test_add_variant_rejects_nodes_outside_the_tree():
    cache = make()
    from ragcache_backend.cache.knowledge_tree import Node

    with pytest.raises(InvalidRequestError):
        cache.add_variant(Node(K("x"), 3), VariantInfo(stats_for("x", 3, ()), 0, "f"))


def test_on_equal_cfo_a_variant_computed_exactly_is_preferred():
    cache = make()
    # A computed after (SYS, X, B~): B reused -> A is an approximate node, recorded as a variant
    run(cache, [spec("SYS", 10, False), spec("B", 20)], exact_upto=2)
    run(cache, [spec("SYS", 10, False), spec("X", 10, False), spec("B", 20), spec("A", 20)], exact_upto=4)
    approx = cache.variants(K("A"))
    assert len(approx) == 1 and approx[0].approximate
    # the same context computed exactly (auto stops its exact prefix at X: a chunk-mode request computes A fresh)
    lease = cache.admit([spec("SYS", 10, False), spec("X", 10, False), spec("A", 20)], tail_tokens=1,
                               exact_upto=3, rule=RecomputeRule(), fresh_above=0.0)
    cache.commit(lease, 1, [stats_for(p.spec.key, p.spec.num_tokens, p.context) if p.spec.chunk else None
                                   for p in lease.pieces])
    cache.finish(lease)
    exact = [n for n in cache.variants(K("A")) if not n.approximate]
    assert len(exact) == 1
    # stats_for gives every variant the same sums: same CFO for an identical new context
    again = cache.admit([spec("SYS", 10, False), spec("Y", 10, False), spec("A", 20)], tail_tokens=1,
                               exact_upto=3, rule=RULE)
    assert again.pieces[1].use is not None and again.pieces[1].use.node is exact[0]
    cache.finish(again)
    cache.check_invariants()


def test_a_variant_whose_pinned_ancestors_leave_no_room_is_given_up_for_a_fresh_prefill():
    cache = make(blocks=64)
    # SYS (2 blocks) -> DX (20) -> D (30): D's variant pins 52 blocks while it is held
    run(cache, [spec("SYS", 20, False), spec("DX", 200), spec("D", 300)], exact_upto=3)
    assert cache.device_used_blocks == 52
    # SYS + Q + D + tail = 37 blocks fit the arena, but not beside D's pinned path (52 + 35)
    lease = cache.admit([spec("SYS", 20, False), spec("Q", 5, False), spec("D", 300)], tail_tokens=40,
                               exact_upto=3, rule=RULE)
    assert lease is not None and [p.use for p in lease.pieces] == [None, None]
    assert cache.locked_nodes == 1 and cache.stats.variant_hits == 0  # only SYS is held
    cache.finish(lease)
    assert cache.locked_nodes == 0 and cache.request_blocks == 0
    cache.check_invariants()


class FailingMover(SimulatedMover):
    """A simulated mover whose host-to-device copies fail once ``broken`` is set."""

    broken = False

    def swap_in(self, host_kv, blocks) -> None:
        if self.broken:
            raise OSError("host copy failed")
        super().swap_in(host_kv, blocks)


def test_a_failed_swap_in_of_a_variant_holds_nothing():
    mover = FailingMover(bytes_per_token=100)
    cache = TieredCache(9, 10, 100_000, mover, policy="pgdsf", profile=PROFILE)
    cache.configure_variants(fingerprint="model-a/bf16")
    run(cache, [spec("SYS", 10, False), spec("A", 30)], exact_upto=2)
    run(cache, [spec("X", 40, False), spec("Y", 30, False)], exact_upto=2)  # pushes A (and SYS) to host
    assert not cache.variants(K("A"))[0].in_device
    mover.broken = True
    with pytest.raises(OSError, match="host copy failed"):
        cache.admit([spec("X", 40, False), spec("Q", 5, False), spec("A", 30)], tail_tokens=1, exact_upto=3,
                           rule=RULE)  # X is matched (locked) before A's swap-in fails
    assert cache.locked_nodes == 0 and cache.request_blocks == 0
    cache.check_invariants()


def test_in_a_shared_pool_a_variant_whose_path_went_to_host_still_serves():
    """On a CPU (shared pool) a variant whose node and parent were moved to the host tier still
    serves: its path moves back to device (blocks handed over, no copy) instead of the chunk being
    recomputed. With separate memories (a copy per node) such a variant is passed over, as before."""
    for shared in (True, False):
        cache = TieredCache(12, 10, 40_000, SimulatedMover(bytes_per_token=100), policy="pgdsf", profile=PROFILE,
                            shared_pool=shared)
        cache.configure_variants(fingerprint="model-a/bf16", per_chunk=4, total=1024)
        run(cache, [spec("SYS", 10, False), spec("A", 20), spec("B", 20), spec("Q1", 5, False)], exact_upto=4)
        run(cache, [spec("S2", 10, False), spec("C", 40), spec("D", 40), spec("Q2", 5, False)], exact_upto=4)
        b = cache.variants(K("B"))[0]
        assert not b.in_device and not b.parent.in_device and b.resident and b.parent.resident  # both on host now
        lease = cache.admit([spec("S3", 10, False), spec("Q3", 5, False), spec("B", 20)], tail_tokens=5, exact_upto=3,
                            rule=RULE)
        assert lease is not None
        use = lease.pieces[-1].use
        if shared:
            assert use is not None and use.node is b and b.in_device and b.parent.in_device
        else:
            assert use is None  # computed fresh
        cache.commit(lease, rest_tokens=1, stats=[None, None, None if use else stats_for(K("B"), 20, lease.pieces[-1].context)])
        cache.finish(lease)
        cache.check_invariants()
        assert cache.locked_nodes == 0 and cache.request_blocks == 0
