"""A shared pool (a CPU, where the device arena and the host tier are the same DRAM): one pool of
arena blocks under the device and host budgets, nodes moved between the two tiers by handing
their blocks over, never copied, and host hits attended in place."""

from __future__ import annotations

import random

import pytest

from ragcache_backend.cache.blocks import BlockAllocator, BlockQuota, blocks_for
from ragcache_backend.cache.host import PoolCopy
from ragcache_backend.cache.knowledge_tree import TierName
from ragcache_backend.cache.sim_arena import SimArena, disk_store
from ragcache_backend.cache.tiers import TieredCache, shared_pool_blocks
from ragcache_backend.errors import CacheBudgetError, InvalidRequestError
from tests.cache.sim_mover import SimulatedMover
from tests.cache.test_tiers import PROFILE, K, request

DEV, HOST = TierName.DEVICE, TierName.HOST
BS = 10


def make(num_blocks: int, host_bytes: int, policy: str = "pgdsf") -> tuple[TieredCache, SimulatedMover]:
    mover = SimulatedMover(bytes_per_token=100)
    return TieredCache(num_blocks, BS, host_bytes, mover, policy=policy, profile=PROFILE, shared_pool=True), mover


def test_block_quota_shares_one_pool_under_two_caps():
    pool = BlockAllocator(6)
    dev, host = BlockQuota(pool, 4), BlockQuota(pool, 2)
    a = dev.allocate(4)
    assert dev.num_free == 0 and pool.num_free == 2
    with pytest.raises(CacheBudgetError):
        dev.allocate(1)  # its cap, though the pool has room
    moved = dev.give(a[:2])
    host.take(moved)  # no copy: the same blocks, now the host's
    assert dev.num_used == 2 and host.num_used == 2 and pool.num_used == 4
    with pytest.raises(CacheBudgetError):
        host.take(dev.give(a[2:3]))  # over the host's cap
    dev.take(a[2:3])
    with pytest.raises(ValueError):
        host.take(a[:1])  # held already
    with pytest.raises(ValueError):
        dev.free(moved)  # the host's now
    host.free(moved)
    assert pool.num_used == 2
    with pytest.raises(InvalidRequestError):
        BlockQuota(pool, 7)


def test_a_device_victim_moves_to_host_and_a_hit_moves_back_without_a_copy():
    cache, mover = make(num_blocks=2, host_bytes=10_000)
    assert cache.tiers.shared_pool
    sizes = dict(X=20, Y=10)
    x, = request(cache, ["X"], sizes)
    x_blocks = list(x.device_blocks)
    request(cache, ["Y"], sizes)  # X evicted: its blocks handed to the host tier
    assert x.tiers == (HOST,) and isinstance(x.host_kv, PoolCopy) and list(x.host_kv.blocks) == x_blocks
    assert cache.stats.moved_out == 1 and cache.stats.swap_outs == 0 and mover.swap_outs == []
    acq = cache.acquire(cache.match([K("X")]))  # a host hit: the same blocks, attended in place
    assert acq.host_hits == 1 and x.tiers == (DEV,) and list(x.device_blocks) == x_blocks
    assert acq.blocks == (tuple(x_blocks),)
    assert cache.stats.moved_in == 1 and cache.stats.swap_ins == 0 and mover.swap_ins == []
    cache.release(acq.nodes)
    assert cache.device_used_blocks <= 2 and cache.host_used_bytes <= 10_000
    assert mover.live == {}  # no host buffer was ever made
    cache.check_invariants()


def test_host_copies_count_whole_blocks():
    cache, _ = make(num_blocks=2, host_bytes=3000)  # 3 blocks of 10 tokens x 100 B
    request(cache, ["A"], dict(A=11))  # 2 blocks
    request(cache, ["B"], dict(B=20))  # A to host: 2000 B (2 whole blocks), not 1100
    assert cache.host_used_bytes == 2000
    cache.check_invariants()


@pytest.mark.parametrize("policy", ["pgdsf", "lru"])
@pytest.mark.parametrize("host_bytes", [6000, 40_000])
def test_randomized_budgets_and_invariants_in_a_shared_pool(policy: str, host_bytes: int) -> None:
    rng = random.Random(f"shared-{policy}-{host_bytes}")
    cache, mover = make(40, host_bytes, policy)
    pool = shared_pool_blocks(40, host_bytes, BS * 100)
    docs = [f"d{i}" for i in range(12)]
    sizes = {d: rng.randint(3, 50) for d in docs} | {"sys": 12}
    held, own = [], []
    for _ in range(1500):
        op = rng.random()
        if op < 0.75:
            keys = (["sys"] if rng.random() < 0.7 else []) + rng.sample(docs, rng.randint(1, 3))
            hold = rng.random() < 0.15
            try:
                path = request(cache, keys, sizes, question=rng.randint(0, 20), hold=hold)
            except CacheBudgetError:
                continue
            if hold:
                held.append(path)
        elif op < 0.88 and held:
            cache.release(held.pop(rng.randrange(len(held))))
        elif op < 0.95:
            try:
                own.append(cache.allocate(rng.randint(0, 6)))
            except CacheBudgetError:
                pass
        elif own:
            cache.free(own.pop(rng.randrange(len(own))))
        cache.check_invariants()
        host_blocks = sum(blocks_for(n.num_tokens, BS) for n in cache.tree if n.in_host)
        assert cache.device_used_blocks <= 40 and cache.host_used_bytes <= host_bytes
        assert cache.device_used_blocks + host_blocks <= pool
        assert not any(n.in_device and n.in_host for n in cache.tree)
        if len(held) > 2:
            cache.release(held.pop(0))
        if len(own) > 2:
            cache.free(own.pop(0))
    st = cache.stats
    assert st.moved_out > 20 and st.moved_in > 20 and st.host_hits > 20
    assert st.swap_outs == st.swap_ins == 0 and mover.swap_outs == mover.swap_ins == []
    assert mover.live == {}


def test_the_engine_free_flow_in_a_shared_pool_checks_every_token_and_survives_a_restart(tmp_path):
    """The cache core driven with token ids (examples/cache_core.py checks every reused token's
    KV): moves between device and host copy nothing, KV read back from disk is written into pool
    blocks once, and the disk writer's temporary copies are freed."""
    from tests.cache.test_engine_free import A, B, BLOCK, core

    def make_shared(blocks: int = 12, host_blocks: int = 64) -> tuple[TieredCache, SimArena]:
        probe = SimArena(num_blocks=1, block_size=BLOCK)
        host = host_blocks * probe.host_nbytes(BLOCK)
        arena = SimArena(num_blocks=shared_pool_blocks(blocks, host, probe.host_nbytes(BLOCK)), block_size=BLOCK)
        cache = TieredCache(blocks, BLOCK, host, arena, policy="lru", shared_pool=True)
        cache.attach_disk(disk_store(tmp_path, 1 << 20))
        return cache, arena

    cache, arena = make_shared()
    assert core.serve(cache, arena, A) == {"cached_tokens": 0, "device": 0, "host": 0, "disk": 0}
    assert core.serve(cache, arena, B) == {"cached_tokens": 32, "device": 4, "host": 0, "disk": 0}
    for i in range(3):  # 12 blocks of device memory: these push A and B to host
        core.serve(cache, arena, list(range(2000 + 100 * i, 2060 + 100 * i)))
    assert cache.stats.moved_out > 0 and cache.stats.swap_outs == 0
    assert core.serve(cache, arena, A) == {"cached_tokens": 48, "device": 0, "host": 6, "disk": 0}
    assert cache.stats.moved_in == 6 and cache.stats.swap_ins == 0
    cache.persist_pending()
    cache.close_disk()
    assert len(cache.disk) == len(cache.tree) and arena.live == 0  # the writers' copies are freed
    cache.check_invariants()

    again, arena2 = make_shared()
    assert core.serve(again, arena2, A) == {"cached_tokens": 48, "device": 0, "host": 0, "disk": 6}
    assert arena2.live == 0 and all(isinstance(n.host_kv, PoolCopy) or n.host_kv is None for n in again.tree)
    again.check_invariants()
    again.close_disk()
