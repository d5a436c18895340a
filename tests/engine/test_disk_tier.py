"""The disk tier (checksummed safetensors files below host memory), tenant salts and the engine's
fault tolerance (RAGCache §6), on the random tiny Llama.

A "restart" is a second engine over the same folder with nothing in memory: what it reuses can only
come from the files.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from ragcache_backend.cache.disk import FORMAT, DiskStore, path_key
from ragcache_backend.cache.policy import NodeStats
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.sampling import SamplingParams
from tests.engine.test_engine import DOCS, assert_no_leak, make_engine

GREEDY = SamplingParams(max_tokens=8)
Q = "What is the GIL?"


def disk_engine(tiny_model, fixed_profile, folder: Path, **kw):
    return make_engine(tiny_model, fixed_profile, disk_dir=folder, **kw)


def files(engine) -> list[Path]:
    return sorted(engine.cache.disk.directory.glob("*.kv.safetensors"))


def path_nodes(engine, question, docs) -> int:
    """Tree nodes on an exact repeat's path: block nodes, documents and the prompt's last block."""
    segs, _ = engine.segments_for(question, docs, GREEDY)
    return len(engine.prompt_plan(segs).with_repeat().lead)


def written(engine) -> None:
    """Wait for the writer: what a finished request inserted is on disk (its last step hands the
    nodes to the writer after the result is set: wait for that step first)."""
    assert engine.wait_idle(30)
    assert engine.cache.disk.flush(30)


def test_restart_serves_the_prompt_from_disk_exactly(tiny_model, fixed_profile, tmp_path):
    first = disk_engine(tiny_model, fixed_profile, tmp_path)
    segs, _ = first.segments_for(Q, DOCS, GREEDY)
    reference, _ = first.first_token_logits(segs, use_cache=False)
    r1 = first.generate(Q, DOCS, GREEDY)
    assert r1.cached_tokens == 0 and r1.disk_hits == 0
    written(first)
    nodes = len(first.cache.tree)
    assert len(files(first)) == nodes >= 4  # system prompt, 3 documents, question
    first.close()

    second = disk_engine(tiny_model, fixed_profile, tmp_path)
    assert len(second.cache.tree) == 0 and len(second.cache.disk) == nodes
    logits, cached = second.first_token_logits(segs)
    assert cached == r1.prompt_tokens - 1  # everything but the last token, read back from disk
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    r2 = second.generate(Q, DOCS, GREEDY)
    assert r2.token_ids == r1.token_ids and r2.cached_tokens == cached
    path = path_nodes(second, Q, DOCS)  # the prompt's nodes (the other files: blocks of the first answer)
    assert second.cache.stats.disk_hits == path and second.cache.disk.stats.loaded == path
    assert_no_leak(second)
    second.close()


def test_a_repeat_after_restart_reports_disk_hits(tiny_model, fixed_profile, tmp_path):
    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        e.generate(Q, DOCS[:2], GREEDY)
    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        r = e.generate(Q, DOCS[:2], GREEDY)
        path = path_nodes(e, Q, DOCS[:2])
        assert r.disk_hits == path and r.host_hits == 0 and r.device_hits == 0
        r = e.generate(Q, DOCS[:2], GREEDY)  # now in memory
        assert r.disk_hits == 0 and r.device_hits + r.host_hits == path


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "empty"])
def test_a_damaged_file_is_dropped_and_recomputed(tiny_model, fixed_profile, tmp_path, damage):
    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        reference = e.generate(Q, DOCS, GREEDY)
        written(e)
        doc_file = next(p for p in files(e) if p.stat().st_size > 20_000)
        victim_key = doc_file.name.split(".")[0]
    data = bytearray(doc_file.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x40  # one bit of one KV value
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "foreign":  # same name and a valid file, but another model's metadata
        with safe_open(doc_file, "pt") as fh:
            meta = dict(fh.metadata(), fingerprint="another-model")
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        data = bytearray(st_save(tensors, metadata=meta))
    else:
        data = bytearray()
    doc_file.write_bytes(bytes(data))
    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        r = e.generate(Q, DOCS, GREEDY)
        assert r.token_ids == reference.token_ids  # never served: recomputed from there on
        assert 0 < r.cached_tokens < reference.prompt_tokens - 1
        assert e.cache.disk.stats.corrupt == 1
        written(e)
        assert e.cache.disk.lookup(victim_key) is not None  # rewritten from the recomputed KV
        r = e.generate(Q, DOCS, GREEDY)
        assert r.cached_tokens == reference.prompt_tokens - 1


def test_leftovers_of_a_killed_write_and_other_models_are_ignored(tiny_model, fixed_profile, tmp_path):
    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        e.generate(Q, DOCS[:1], GREEDY)
        folder = e.cache.disk.directory
    (folder / ".deadbeef.123.tmp").write_bytes(b"half a file")  # kill -9 before the rename
    other = tmp_path / f"v{FORMAT}-another-model"
    other.mkdir()
    (other / ("0" * 32 + ".kv.safetensors")).write_bytes(b"\x00" * 64)
    (tmp_path / f"v{FORMAT + 1}-{folder.name.split('-', 1)[1]}").mkdir()  # a future format: never read
    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        assert not (folder / ".deadbeef.123.tmp").exists()
        assert e.generate(Q, DOCS[:1], GREEDY).disk_hits == path_nodes(e, Q, DOCS[:1])
    assert (other / ("0" * 32 + ".kv.safetensors")).exists()  # another model's folder is left alone


def test_budget_evicts_leaves_by_policy_and_never_orphans(tiny_model, fixed_profile, tmp_path):
    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        e.generate(Q, DOCS[:1], GREEDY)
        written(e)
        one = e.cache.disk.used_bytes
    budget = int(one * 2.5)
    docs = [f"Document {i} is about subject {i} and nothing else. " * 8 for i in range(6)]
    with disk_engine(tiny_model, fixed_profile, tmp_path / "b", disk_budget_bytes=budget) as e:
        for i, d in enumerate(docs):
            e.generate(f"q{i}", [d], GREEDY)
            written(e)
            disk = e.cache.disk
            assert disk.used_bytes <= budget
            keys = {x.path_key for x in disk}
            assert all(x.parent == "" or x.parent in keys for x in disk)  # leaves go first
        assert disk.stats.evictions > 0
        assert sum(p.stat().st_size for p in files(e)) == disk.used_bytes


def test_salts_never_share_kv_in_any_tier(tiny_model, fixed_profile, tmp_path):
    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        a1 = e.generate(Q, DOCS, GREEDY, cache_salt="tenant-a")
        b1 = e.generate(Q, DOCS, GREEDY, cache_salt="tenant-b")
        a2 = e.generate(Q, DOCS, GREEDY, cache_salt="tenant-a")
        plain = e.generate(Q, DOCS, GREEDY)
        assert a1.cached_tokens == 0 and b1.cached_tokens == 0 and plain.cached_tokens == 0
        assert a2.cached_tokens == a1.prompt_tokens - 1
        assert a1.token_ids == b1.token_ids == plain.token_ids  # the salt changes keys, not answers
        for mode in ("chunk", "auto"):  # chunk caches are salted too
            r = e.generate("Another question?", DOCS[::-1], GREEDY, cache_salt="tenant-c", reuse=mode)
            assert r.chunk_hits == 0 or mode == "auto"
        written(e)
        n = len(files(e))
    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        assert len(e.cache.disk) == n
        assert e.generate(Q, DOCS, GREEDY, cache_salt="tenant-z").cached_tokens == 0
        assert e.generate(Q, DOCS, GREEDY, cache_salt="tenant-b").disk_hits == path_nodes(e, Q, DOCS)
    with pytest.raises(InvalidRequestError):
        e2 = make_engine(tiny_model, fixed_profile)
        e2.generate(Q, DOCS, GREEDY, cache_salt="x" * 1000)


def test_a_one_segment_prompt_is_salted_too(tiny_model, fixed_profile):
    """A prompt of one segment (a plain chat message with no recognised document) is cached as its
    own leading node: that node's key carries the salt, so another tenant never reuses it."""
    e = make_engine(tiny_model, fixed_profile)
    (segment,) = e.prompts.build(Q, [])[-1:]  # the question alone: one segment
    a1 = e.generate_segments([segment], GREEDY, cache_salt="tenant-a")
    b1 = e.generate_segments([segment], GREEDY, cache_salt="tenant-b")
    a2 = e.generate_segments([segment], GREEDY, cache_salt="tenant-a")
    assert a1.cached_tokens == 0 and b1.cached_tokens == 0
    assert a2.cached_tokens == a2.prompt_tokens - 1
    assert_no_leak(e)


def test_a_full_disk_loses_files_not_requests(tiny_model, fixed_profile, tmp_path, monkeypatch):
    real_replace = os.replace

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    with disk_engine(tiny_model, fixed_profile, tmp_path) as e:
        monkeypatch.setattr(os, "replace", no_space)
        r = e.generate(Q, DOCS, GREEDY)
        written(e)
        assert e.cache.disk.stats.write_failures >= 1 and len(e.cache.disk) == 0
        assert not list(e.cache.disk.directory.iterdir())  # no temporary file left behind
        monkeypatch.setattr(os, "replace", real_replace)
        assert e.generate(Q, DOCS, GREEDY).cached_tokens == r.prompt_tokens - 1  # memory tiers unaffected


def test_disk_store_rejects_bad_input(tmp_path):
    layout = (2, 2, 8)
    store = DiskStore(tmp_path, "fp", layout, torch.float32, 1 << 20)
    k = torch.zeros(2, 4, 2, 8)
    with pytest.raises(InvalidRequestError):
        store.put(path_key("", "a"), "", "a", k.to(torch.bfloat16), k.to(torch.bfloat16), NodeStats(1, 0.0, 4, 0))
    with pytest.raises(InvalidRequestError):
        store.put(path_key("", "a"), "", "a", torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8), NodeStats(1, 0.0, 4, 0))
    assert store.put(path_key("", "a"), "", "a", k, k, NodeStats(1, 0.0, 4, 0))
    assert not store.put(path_key("", "a"), "", "a", k, k, NodeStats(1, 0.0, 4, 0))  # already queued or written
    big = torch.zeros(2, 20_000, 2, 8)
    assert not store.put(path_key("", "b"), "", "b", big, big, NodeStats(1, 0.0, 4, 0))  # over the budget
    store.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidRequestError):
        DiskStore(tmp_path / "file", "fp", layout, torch.float32, 1 << 20)
    with pytest.raises(InvalidRequestError):
        DiskStore(tmp_path, "fp", layout, torch.float32, 0)


def test_k_and_v_sharing_memory_are_written_and_read_back(tmp_path):
    """The same tensor as K and V (or overlapping views) is written, not dropped by the writer
    (safetensors refuses to save tensors that share memory), and reads back exactly."""
    layout = (2, 2, 8)
    store = DiskStore(tmp_path, "fp", layout, torch.float32, 1 << 20)
    k = torch.randn(2, 4, 2, 8, generator=torch.Generator().manual_seed(0))
    assert store.put(path_key("", "a"), "", "a", k, k, NodeStats(1, 0.0, 4, 0))
    kv = torch.randn(2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(1))
    assert store.put(path_key("", "b"), "", "b", kv[0], kv[1], NodeStats(1, 0.0, 4, 0))  # disjoint views
    assert store.flush(10)
    assert store.stats.writes == 2
    got = store.load(store.lookup(path_key("", "a")))
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], k)
    got = store.load(store.lookup(path_key("", "b")))
    assert got is not None and torch.equal(got[0], kv[0]) and torch.equal(got[1], kv[1])
    store.close()


def test_failure_before_the_first_token_is_retried_by_recomputation(tiny_model, fixed_profile, tmp_path, monkeypatch):
    e = disk_engine(tiny_model, fixed_profile, tmp_path)
    reference = e.generate(Q, DOCS, GREEDY, use_cache=False)
    e.generate(Q, DOCS, GREEDY)
    real = e.runner.forward_step
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return real(batch)

    monkeypatch.setattr(e.runner, "forward_step", flaky)
    r = e.generate(Q, DOCS, GREEDY)
    assert r.token_ids == reference.token_ids and r.cached_tokens == 0  # recomputed, not reused
    assert e.stats.retried == 1
    assert_no_leak(e)

    def after_first_token(batch):  # decode steps fail: the request ends with the error, nothing poisoned
        if all(item.decode for item in batch):
            raise RuntimeError("simulated fault while decoding")
        return real(batch)

    monkeypatch.setattr(e.runner, "forward_step", after_first_token)
    with pytest.raises(RuntimeError, match="decoding"):
        e.generate("A new question?", DOCS, GREEDY)
    assert e.stats.retried == 1
    assert_no_leak(e)
    monkeypatch.setattr(e.runner, "forward_step", real)
    r = e.generate("A new question?", DOCS, GREEDY, use_cache=False)
    assert e.generate("A new question?", DOCS, GREEDY).token_ids == r.token_ids
    e.close()


def test_the_system_prompt_keeps_a_host_replica(tiny_model, fixed_profile):
    """Where host memory differs from the arena's (CUDA; here: the host tier outside the arena)."""
    e = make_engine(tiny_model, fixed_profile, host_in_arena=False)
    e.generate(Q, DOCS, GREEDY)
    top = list(e.cache.tree.root.children.values())
    assert len(top) == 1 and top[0].in_device and top[0].in_host
    assert e.cache.stats.host_replicas == 1
    # no other node has a replica (the prompt's last, shorter block is kept on host alone: an exact repeat's)
    assert all(not (n.in_host and n.in_device) for n in e.cache.tree if n not in top)
    assert_no_leak(e)


def test_a_shared_pool_keeps_no_replica_and_moves_nodes_without_copies(tiny_model, fixed_profile):
    """On a CPU the host tier lives in the arena (the default): a copy in the same memory
    protects nothing, and host hits are attended in place."""
    from ragcache_backend.model.runner import kv_bytes_per_token

    if tiny_model.device.type != "cpu":
        pytest.skip("the host tier shares the arena's memory on a CPU only (CUDA keeps copies: "
                    "test_engine.py::test_host_tier_swap_out_once_and_host_hits checks them)")
    e = make_engine(tiny_model, fixed_profile, device_budget_bytes=40 * 16 * kv_bytes_per_token(tiny_model))  # 40 blocks
    assert e.cache.tiers.shared_pool
    first = e.generate(Q, DOCS, GREEDY)
    assert e.cache.stats.host_replicas == 0
    for i in range(6):  # other documents push the first request's nodes to the host tier
        e.generate(Q, [f"Other document {i}: " + "filler words " * 60], GREEDY)
    assert e.cache.stats.moved_out > 0
    again = e.generate(Q, DOCS, GREEDY)
    assert again.host_hits > 0 and again.token_ids == first.token_ids
    assert e.cache.stats.moved_in > 0 and e.cache.stats.swap_ins == 0
    assert_no_leak(e)


def test_load_many_reads_several_files_at_once_with_the_same_results_as_load(tmp_path):
    """Files read by the reader threads come back in order and exactly; a file gone meanwhile, a
    truncated one and a foreign one are what ``load`` makes of them (a miss; the damaged ones
    deleted and counted), and a good file's frequency is counted once."""
    layout = (2, 2, 8)
    store = DiskStore(tmp_path, "fp", layout, torch.float32, 1 << 30)
    g = torch.Generator().manual_seed(0)
    keys, kvs = [], []
    for i in range(7):  # seven first segments (a missing file also drops the entries below it)
        k, v = torch.randn(2, 4, 2, 8, generator=g), torch.randn(2, 4, 2, 8, generator=g)
        pkey = path_key("", f"s{i}")
        assert store.put(pkey, "", f"s{i}", k, v, NodeStats(1, 0.0, 4, 0))
        keys.append(pkey)
        kvs.append((k, v))
    assert store.flush(10)
    entries = [store.lookup(p) for p in keys]
    os.remove(store.directory / f"{keys[1]}.kv.safetensors")  # gone
    damaged = store.directory / f"{keys[3]}.kv.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-10])  # truncated
    foreign = store.directory / f"{keys[5]}.kv.safetensors"
    foreign.write_bytes(st_save({"k": torch.zeros(1)}, metadata={"format": "0"}))
    got = store.load_many(entries)
    assert [x is None for x in got] == [False, True, False, True, False, True, False]
    for i in (0, 2, 4, 6):
        assert torch.equal(got[i][0], kvs[i][0]) and torch.equal(got[i][1], kvs[i][1])
    assert store.stats.loaded == 4 and store.stats.corrupt == 2
    assert [store.lookup(p) is not None for p in keys] == [True, False, True, False, True, False, True]
    assert store.lookup(keys[0]).frequency == entries[0].frequency == 2  # written with 1, read once
    assert store.load_many([]) == [] and store.load_many(entries[:1])[0] is not None
    assert any(t.name.startswith("ragcache-disk-read") for t in threading.enumerate())  # read by the pool
    # a chain whose first file is damaged: the files below it are misses, as one-by-one loads make them
    chain, parent = [], ""
    for i in range(3):
        k = torch.randn(2, 4, 2, 8, generator=g)
        pkey = path_key(parent, f"c{i}")
        assert store.put(pkey, parent, f"c{i}", k, k.clone(), NodeStats(1, 0.0, 4, 0))
        chain.append(pkey)
        parent = pkey
    assert store.flush(10)
    entries = [store.lookup(p) for p in chain]
    first = store.directory / f"{chain[0]}.kv.safetensors"
    first.write_bytes(first.read_bytes()[:-10])
    loaded = store.stats.loaded
    assert store.load_many(entries) == [None, None, None] and store.stats.loaded == loaded
    assert all(store.lookup(p) is None for p in chain) and not any(store.directory.glob(f"{chain[1]}*"))
    store.close()
    after = store.load_many([store.lookup(keys[0]), store.lookup(keys[2])])  # closed: read one by one
    assert torch.equal(after[0][0], kvs[0][0]) and torch.equal(after[1][1], kvs[2][1])
