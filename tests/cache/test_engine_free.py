"""The cache core without our engine: token ids and a simulated arena only (the seam a vLLM
connector will use). Match a prefix across tiers, admit, commit, finish, evict, persist to disk
and read back after a restart, with the KV checked token for token at every reuse."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from ragcache_backend.cache.sim_arena import SimArena, disk_store
from ragcache_backend.cache.tiers import TieredCache

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cache_core.py"
spec = importlib.util.spec_from_file_location("cache_core", EXAMPLE)
core = importlib.util.module_from_spec(spec)
spec.loader.exec_module(core)
BLOCK = core.BLOCK

SYSTEM = list(range(1000, 1032))  # 4 blocks
A = SYSTEM + list(range(1, 20))  # + 2 whole blocks, then 3 tokens always computed
B = SYSTEM + list(range(500, 530))


def make(folder=None, blocks: int = 12, host_blocks: int = 64) -> tuple[TieredCache, SimArena]:
    arena = SimArena(num_blocks=blocks, block_size=BLOCK)
    cache = TieredCache(blocks, BLOCK, host_blocks * arena.host_nbytes(BLOCK), arena, policy="lru")
    if folder is not None:
        cache.attach_disk(disk_store(folder, 1 << 20))
    return cache, arena


def test_the_cache_core_imports_no_engine_model_or_runner():
    code = ("import sys, ragcache_backend.cache.tiers, ragcache_backend.cache.sim_arena; "
            "bad = [m for m in sys.modules if m.startswith(('ragcache_backend.engine', 'ragcache_backend.model', "
            "'ragcache_backend.prompts', 'transformers'))]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=EXAMPLE.parents[1])


def test_a_shared_prefix_is_reused_across_tiers_and_survives_a_restart(tmp_path):
    cache, arena = make(tmp_path)
    assert core.serve(cache, arena, A) == {"cached_tokens": 0, "device": 0, "host": 0, "disk": 0}
    assert core.serve(cache, arena, B) == {"cached_tokens": 32, "device": 4, "host": 0, "disk": 0}
    for i in range(3):  # 12 blocks of device memory: these push A and B to host
        core.serve(cache, arena, list(range(2000 + 100 * i, 2060 + 100 * i)))
    assert cache.stats.swap_outs > 0 and cache.stats.device_evictions > 0
    assert core.serve(cache, arena, A) == {"cached_tokens": 48, "device": 0, "host": 6, "disk": 0}
    assert cache.locked_nodes == 0 and cache.request_blocks == 0 and arena.live == cache.host_used_bytes // arena.host_nbytes(BLOCK)
    cache.persist_pending()
    cache.close_disk()
    assert len(cache.disk) == len(cache.tree)

    again, arena2 = make(tmp_path)
    assert len(again.tree) == 0
    assert core.serve(again, arena2, A) == {"cached_tokens": 48, "device": 0, "host": 0, "disk": 6}
    assert again.stats.disk_hits == 6 and again.disk.stats.loaded == 6
    again.close_disk()


def test_a_damaged_file_is_recomputed_never_served(tmp_path):
    cache, arena = make(tmp_path)
    core.serve(cache, arena, A)
    cache.persist_pending()
    cache.close_disk()
    third = cache.tree.root.children[core.block_specs(A)[0].key]
    third = next(iter(next(iter(third.children.values())).children.values()))
    path = cache.disk.directory / f"{third.path_key}.kv.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))

    again, arena2 = make(tmp_path)
    hits = core.serve(again, arena2, A)  # serve() checks every reused token's KV
    assert hits["disk"] == 2 and hits["cached_tokens"] == 2 * BLOCK  # stops before the damaged third block
    assert again.disk.stats.corrupt == 1 and not path.exists()
    assert again.locked_nodes == 0 and arena2.live == again.host_used_bytes // arena2.host_nbytes(BLOCK)  # no copy leaked
    again.close_disk()


def test_a_restart_reads_the_path_s_files_at_once_and_no_more_than_the_host_tier_holds(tmp_path):
    """After a restart, the files of a matched path are read together by the disk tier's reader
    threads, exactly (``serve`` checks every token); with a host tier smaller than the path, the
    match stops where the host tier is full, the files below are neither read nor counted, and
    no host copy is left over."""
    import threading

    cache, arena = make(tmp_path)
    core.serve(cache, arena, A)
    cache.persist_pending()
    cache.close_disk()

    again, arena2 = make(tmp_path)
    assert core.serve(again, arena2, A) == {"cached_tokens": 48, "device": 0, "host": 0, "disk": 6}
    assert any(t.name.startswith("ragcache-disk-read") for t in threading.enumerate())
    assert arena2.live == again.host_used_bytes // arena2.host_nbytes(BLOCK)
    again.close_disk()

    small, arena3 = make(tmp_path, host_blocks=4)  # room for 4 of the path's 6 blocks
    hits = core.serve(small, arena3, A)
    assert hits["disk"] == 4 and hits["cached_tokens"] == 4 * BLOCK
    assert small.disk.stats.loaded == 4 and small.locked_nodes == 0
    assert arena3.live == small.host_used_bytes // arena3.host_nbytes(BLOCK)
    small.close_disk()


def test_a_restart_cut_at_the_host_budget_asks_no_remote_tier_for_what_the_disk_holds(tmp_path, redis_server,
                                                                                        monkeypatch):
    """The path's files past what the host tier holds are on disk: the match stops there without
    a Redis read (one the host tier could not take anyway), and leaves no copy behind."""
    import dataclasses

    from ragcache_backend.cache.remote import RemoteStore
    from ragcache_backend.cache.sim_arena import DIM, HEADS, LAYERS

    keyed = core.block_specs  # with each block's token ids, as an engine gives them (the remote tier needs them)
    monkeypatch.setattr(core, "block_specs", lambda tokens: [
        dataclasses.replace(s, token_ids=tuple(tokens[i * BLOCK:(i + 1) * BLOCK])) for i, s in enumerate(keyed(tokens))])
    cache, arena = make(tmp_path / "disk")
    core.serve(cache, arena, A)
    cache.persist_pending()
    cache.close_disk()

    small, arena2 = make(tmp_path / "disk", host_blocks=4)  # room for 4 of the path's 6 blocks
    small.attach_remote(RemoteStore(redis_server.url, "sim-arena", (LAYERS, HEADS, DIM), torch.float32))
    hits = core.serve(small, arena2, A)
    assert hits["disk"] == 4 and hits["cached_tokens"] == 4 * BLOCK
    assert small.remote.stats.hits == small.remote.stats.misses == small.remote.stats.errors == 0
    assert small.locked_nodes == 0 and arena2.live == small.host_used_bytes // arena2.host_nbytes(BLOCK)
    small.close_disk()


def test_eviction_under_pressure_keeps_budgets_and_frees_everything(tmp_path):
    cache, arena = make(blocks=10, host_blocks=8)
    prompts = [SYSTEM + list(range(100 * i, 100 * i + 17)) for i in range(12)]
    for p in prompts + prompts[::-1]:
        core.serve(cache, arena, p)
        assert cache.device_used_blocks <= cache.num_device_blocks
        assert cache.host_used_bytes <= cache.host_budget_bytes
    assert cache.stats.host_evictions > 0 and cache.stats.device_evictions > 0
    cache.clear()
    assert len(cache.tree) == 0 and cache.device_used_blocks == 0 and cache.host_used_bytes == 0 and arena.live == 0


def test_a_missing_parent_file_takes_the_files_below_it_along(tmp_path):
    """Files below a parent whose file is gone are unreachable: they are deleted with it, and the
    store's books stay right (a later eviction or delete of the path works)."""
    cache, arena = make(tmp_path)
    core.serve(cache, arena, A)
    cache.persist_pending()
    assert cache.disk.flush(30)
    store = cache.disk
    first = cache.tree.root.children[core.block_specs(A)[0].key]
    n = len(store)
    (store.directory / f"{first.path_key}.kv.safetensors").unlink()
    assert store.load(store.lookup(first.path_key)) is None
    assert len(store) == 0 and store.used_bytes == 0 and not list(store.directory.glob("*.kv.safetensors"))
    assert n == 6
    cache.close_disk()


def test_a_file_deleted_while_its_write_is_queued_never_lands(tmp_path, monkeypatch):
    import threading

    import ragcache_backend.cache.disk as disk_module
    from ragcache_backend.cache.knowledge_tree import KnowledgeTree, SegmentKey
    from ragcache_backend.cache.policy import NodeStats

    gate = threading.Event()
    real_fsync = disk_module.os.fsync

    def slow_fsync(fd):  # the writer waits here until the delete is in
        gate.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(disk_module.os, "fsync", slow_fsync)
    store = disk_store(tmp_path, 1 << 20)
    arena = SimArena(num_blocks=2, block_size=BLOCK)
    arena.write([0], list(range(BLOCK)))
    kv = arena.swap_out([0], BLOCK)
    tree = KnowledgeTree()
    node = tree.add_child(tree.root, SegmentKey("a"), BLOCK)
    assert store.put(node.path_key, "", "a", kv.k, kv.v, NodeStats(1, 0.0, BLOCK, 0))
    assert store.contains(node.path_key)
    store.delete(node.path_key)
    assert not store.contains(node.path_key)
    gate.set()
    assert store.flush(30) and len(store) == 0 and store.stats.writes == 0 and store.stats.skipped == 1
    assert not list(tmp_path.rglob("*.kv.safetensors"))
    store.close()
