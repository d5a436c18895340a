"""The vLLM connector's two halves without vLLM: the scheduler side's lookup, admission, eviction and
plans (plain data), and the worker side's block copies over tensors laid out as vLLM's CPU KV
(``[num_blocks, kv_heads, block_size, 2*head_size]`` per layer), with a real disk tier. The saver
thread, every vLLM layout and the CUDA stream: ``test_connector_copies.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ragcache_backend.cache.disk import DiskStore, entry_file, store_folder
from ragcache_integrations.vllm.plan import StepPlan, block_path_keys
from ragcache_integrations.vllm.scheduler import ConnectorScheduler, RequestView, ScheduledRequest
from ragcache_integrations.vllm.settings import check_world_size, settings_from_extra_config
from ragcache_integrations.vllm.layout import BlockLayout
from ragcache_integrations.vllm.worker import ConnectorWorker, KVLayoutError
from ragcache_backend.errors import InvalidRequestError

BS = 4
LAYERS, HEADS, HS = 3, 2, 8
BLOCK_BYTES = LAYERS * HEADS * BS * 2 * HS * 4  # one float32 block over all layers
DISK_LAYOUT = (LAYERS, HEADS, HS)  # the tiers' (layers, kv_heads, head_size)


def kv_tensors(num_blocks: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn": torch.randn(num_blocks, HEADS, BS, 2 * HS, generator=g) for i in range(LAYERS)}


def view(req: str, tokens: list[int], salt: str = "") -> RequestView:
    return RequestView(req, tokens, salt)


def run_prefill(sched: ConnectorScheduler, req: str, tokens: list[int], block_ids: list[int], local_hit: int = 0,
                salt: str = "") -> tuple[int, StepPlan]:
    """What vLLM does for a new request computed in one step: match, allocate, schedule the rest."""
    v = view(req, tokens, salt)
    ext = sched.match(v, local_hit)
    sched.after_alloc(req, ext)
    plan = sched.plan([ScheduledRequest(v, local_hit + ext, len(tokens) - local_hit - ext, block_ids)])
    return ext, plan


def disk_worker(tmp_path, seed: int, slots: int):
    """vLLM-like KV tensors, a real disk tier, a scheduler side with ``slots`` host blocks, and a
    worker registered over them."""
    src = kv_tensors(seed=seed)
    disk = DiskStore(tmp_path, "fp", DISK_LAYOUT, torch.float32, 1 << 30)
    sched = ConnectorScheduler(BS, BLOCK_BYTES, slots * BLOCK_BYTES, store_folder(tmp_path, "fp"))
    worker = ConnectorWorker(BS, disk, host_slots=sched.num_slots)
    worker.register(src)
    return src, disk, sched, worker


def test_block_keys_chain_and_salt() -> None:
    a = block_path_keys(list(range(10)), BS)
    assert len(a) == 2  # full blocks only
    assert block_path_keys(list(range(10)), BS, start=a[:1]) == a
    b = block_path_keys([0, 1, 2, 3, 9, 9, 9, 9], BS)
    assert b[0] == a[0] and b[1] != a[1]  # a block's key depends on its own tokens
    c = block_path_keys([7, 1, 2, 3, 4, 5, 6, 7], BS)
    assert c[1] != a[1]  # ... and on every token before it
    assert block_path_keys(list(range(10)), BS, salt="tenant")[1] != a[1]  # a salt changes every key


def test_match_counts_whole_blocks_never_the_last_token_and_extends_vllms_hit() -> None:
    sched = ConnectorScheduler(BS, 100, 10_000, None)
    tokens = list(range(13))
    ext, plan = run_prefill(sched, "a", tokens, list(range(4)))
    assert ext == 0 and [s.block_id for s in plan.saves] == [0, 1, 2]  # 3 full blocks of 13 tokens
    assert all(s.to_host and not s.to_disk for s in plan.saves)
    # the same prompt: all full blocks but the one holding the last token's position
    assert sched.match(view("b", tokens), 0) == 12
    assert sched.match(view("c", tokens[:12]), 0) == 8  # 12 tokens: the last block holds the last token
    assert sched.match(view("d", tokens), 4) == 8  # vLLM's own hit of one block: ours extends it
    assert sched.match(view("e", tokens[:3]), 0) == 0
    assert sched.match(view("f", [99] + tokens[1:]), 0) == 0
    assert sched.match(view("g", tokens, salt="other"), 0) == 0


def test_plan_loads_the_matched_blocks_into_the_allocated_ids_and_saves_only_new_ones() -> None:
    sched = ConnectorScheduler(BS, 100, 10_000, None)
    tokens = list(range(20))
    run_prefill(sched, "a", tokens[:13], [0, 1, 2, 3])
    ext, plan = run_prefill(sched, "b", tokens, [5, 6, 7, 8, 9], local_hit=4)
    assert ext == 8
    assert [(ld.block_id, ld.tier, ld.tokens) for ld in plan.loads] == [(6, "host", tuple(range(4, 8))),
                                                                       (7, "host", tuple(range(8, 12)))]
    assert [s.block_id for s in plan.saves] == [8, 9]  # blocks 3 and 4 are new; 0 was vLLM's own hit


def test_host_tier_evicts_leaves_by_policy_and_keeps_parents() -> None:
    sched = ConnectorScheduler(BS, 100, 300, None, policy="lru")  # room for 3 blocks
    run_prefill(sched, "a", list(range(13)), [0, 1, 2, 3])  # blocks A0 A1 A2
    assert len(sched.host_keys()) == 3
    _, plan = run_prefill(sched, "b", list(range(100, 109)), [4, 5, 6])  # 2 new blocks: 2 evictions
    keys_a = block_path_keys(list(range(13)), BS)
    assert plan.host_drops == [keys_a[2], keys_a[1]]  # leaves first, then their parent: never an orphan
    assert sched.host_used_bytes <= 300
    assert sched.counters.host_evictions == 2


def test_planned_loads_are_pinned_against_the_same_steps_evictions() -> None:
    sched = ConnectorScheduler(BS, 100, 200, None, policy="lru")
    toks = list(range(9))
    run_prefill(sched, "a", toks, [0, 1, 2])  # 2 blocks fill the host tier
    va, vb = view("b", toks), view("c", list(range(50, 59)))
    ext = sched.match(va, 0)
    sched.after_alloc("b", ext)
    sched.match(vb, 0)
    sched.after_alloc("c", 0)
    plan = sched.plan([ScheduledRequest(vb, 0, 9, [7, 8, 9]), ScheduledRequest(va, ext, 9 - ext, [3, 4, 5])])
    assert [ld.block_id for ld in plan.loads] == [3, 4]
    assert plan.host_drops == []  # the loaded blocks stayed; c's blocks were not admitted
    assert not any(s.to_host for s in plan.saves)


def test_failed_blocks_leave_the_index() -> None:
    sched = ConnectorScheduler(BS, 100, 10_000, None)
    tokens = list(range(9))
    run_prefill(sched, "a", tokens, [0, 1, 2])
    keys = block_path_keys(tokens, BS)
    sched.failed([keys[1]])
    assert sched.match(view("b", tokens), 0) == 4


def test_disk_tier_is_found_by_file(tmp_path) -> None:
    folder = store_folder(tmp_path, "fp")
    sched = ConnectorScheduler(BS, 100, 0, folder)  # no host tier
    tokens = list(range(9))
    _, plan = run_prefill(sched, "a", tokens, [0, 1, 2])
    assert [(s.to_host, s.to_disk) for s in plan.saves] == [(False, True), (False, True)]
    assert sched.match(view("b", tokens), 0) == 0  # not written yet
    folder.mkdir(parents=True)
    for s in plan.saves:
        entry_file(folder, s.path_key).write_bytes(b"x")
    assert sched.match(view("c", tokens), 0) == 8
    _, plan = run_prefill(sched, "d", tokens, [3, 4, 5])
    assert [ld.tier for ld in plan.loads] == ["disk", "disk"] and plan.saves == []


def test_block_disk_format_round_trips_bytes() -> None:
    block = torch.randn(LAYERS, HEADS, BS, 2 * HS)
    cpu = BlockLayout.detect(torch.zeros(1, HEADS, BS, 2 * HS), BS)
    assert cpu.kind == "packed_cpu" and cpu.disk_layout(LAYERS) == DISK_LAYOUT
    k, v = cpu.to_kv(block)
    assert k.shape == (LAYERS, BS, HEADS, HS)
    # as cpu_attn.py views a block: [heads, 2 * block_size, head_size], K rows first, then V rows
    rows = block.reshape(LAYERS, HEADS, 2 * BS, HS)
    assert torch.equal(k[:, 3, 1], rows[:, 1, 3]) and torch.equal(v[:, 3, 1], rows[:, 1, BS + 3])
    assert torch.equal(cpu.from_kv(k, v), block)


@pytest.mark.parametrize("kind", ["packed", "split"])
def test_gpu_layouts_map_to_the_true_keys_and_values(kind) -> None:
    """On GPUs the tiers hold real K and V, as vLLM's attention reads them: FlashAttention's packed
    rows (``kv_cache.transpose(1, 2).split(head_size, -1)``), ROCm's split halves; exact both ways."""
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(LAYERS, BS, HEADS, HS, generator=g), torch.randn(LAYERS, BS, HEADS, HS, generator=g)
    if kind == "packed":  # [heads, bs, 2*hs] per block
        block = torch.randn(LAYERS, HEADS, BS, 2 * HS, generator=g)
        # flash_attn.py: key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
        keys, values = block.transpose(1, 2).split(HS, dim=-1)  # [layers, bs, heads, hs] each
        one = torch.zeros(1, HEADS, BS, 2 * HS)
    else:  # [2, bs, heads, hs]: rocm_aiter_fa.py's key_cache, value_cache = kv_cache.unbind(1)
        block = torch.stack([keys, values], dim=1)
        one = torch.zeros(1, 2, BS, HEADS, HS)
    layout = BlockLayout.detect(one, BS, kv_heads=HEADS, head_size=HS, platform="cuda")
    assert layout.kind == kind and layout.disk_layout(LAYERS) == DISK_LAYOUT
    k, v = layout.to_kv(block)
    assert torch.equal(k, keys) and torch.equal(v, values)
    assert torch.equal(layout.from_kv(k, v), block)


def test_worker_saves_and_loads_blocks_exactly_through_host_and_disk(tmp_path) -> None:
    src, disk, sched, worker = disk_worker(tmp_path, seed=1, slots=64)
    tokens = list(range(13))
    _, plan = run_prefill(sched, "a", tokens, [2, 5, 7, 1])
    assert worker.load(plan).failed_block_ids == set()
    worker.save_layer(plan, list(src)[1])  # as vLLM's save_kv_layer, for some layers; save() does the rest
    worker.save(plan)
    worker.settle()  # as vLLM's next step does (bind): the saves are complete
    assert disk.flush(10)
    # the writers encoded the blocks from their host slots and are done with them: reported once
    written = worker.take_written()
    assert written == {s.slot for s in plan.saves} and worker.take_written() == set()
    sched.written(written)
    # a fresh vLLM KV (another process after a restart: only the disk tier is left)
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    worker2 = ConnectorWorker(BS, DiskStore(tmp_path, "fp", disk.layout, torch.float32, 1 << 30))
    worker2.register(dst)
    sched2 = ConnectorScheduler(BS, 1, 1 << 30, store_folder(tmp_path, "fp"))
    ext, plan2 = run_prefill(sched2, "b", tokens, [9, 10, 11, 12])
    assert ext == 12 and {ld.tier for ld in plan2.loads} == {"disk"}
    assert worker2.load(plan2).failed_block_ids == set()
    for name in src:
        assert torch.equal(dst[name][[9, 10, 11]], src[name][[2, 5, 7]])
    # the first worker serves from its host tier
    dst1 = {name: torch.zeros_like(t) for name, t in src.items()}
    worker.register(dst1)
    _, plan3 = run_prefill(sched, "c", tokens, [3, 4, 6, 8])
    assert {ld.tier for ld in plan3.loads} == {"host"}
    assert worker.load(plan3).failed_block_ids == set()
    for name in src:
        assert torch.equal(dst1[name][[3, 4, 6]], src[name][[2, 5, 7]])
    worker.close()
    worker2.close()


def test_worker_refuses_foreign_tokens_damaged_files_and_missing_blocks(tmp_path) -> None:
    src = kv_tensors(seed=2)
    disk = DiskStore(tmp_path, "fp", DISK_LAYOUT, torch.float32, 1 << 30)
    worker = ConnectorWorker(BS, disk)
    worker.register(src)
    folder = store_folder(tmp_path, "fp")
    sched = ConnectorScheduler(BS, 1, 0, folder)
    tokens = list(range(9))
    _, plan = run_prefill(sched, "a", tokens, [0, 1, 2])
    worker.save(plan)
    worker.settle()  # as vLLM's next step does (bind): the saves are complete
    disk.flush(10)
    # damage the second block's file: only the first block loads, the second is reported
    path = entry_file(folder, plan.saves[1].path_key)
    path.write_bytes(path.read_bytes()[:-7])
    _, plan2 = run_prefill(sched, "b", tokens, [3, 4, 5])
    before = {n: t.clone() for n, t in src.items()}
    result = worker.load(plan2)
    assert result.failed_block_ids == {4} and result.failed_keys == {plan.saves[1].path_key}
    assert not path.exists()  # the damaged file is deleted, never served
    for n in src:
        assert torch.equal(src[n][3], src[n][0]) and torch.equal(src[n][4], before[n][4])
    # a plan whose tokens differ from the file's (a key is never trusted alone)
    from dataclasses import replace
    bad = StepPlan(loads=[replace(plan2.loads[0], tokens=(9, 9, 9, 9), block_id=6)])
    assert worker.load(bad).failed_block_ids == {6}
    # a host block the worker does not hold
    gone = StepPlan(loads=[replace(plan2.loads[0], tier="host", path_key="0" * 32, block_id=7)])
    assert worker.load(gone).failed_block_ids == {7}
    worker.close()


def test_worker_refuses_a_layout_it_does_not_copy() -> None:
    worker = ConnectorWorker(BS, None)
    with pytest.raises(KVLayoutError, match="block_size=4"):
        worker.register({"l0": torch.zeros(2, 8, BS, HEADS, HS)})
    with pytest.raises(KVLayoutError, match="block_size=4"):
        worker.register({"l0": torch.zeros(2, HEADS, BS + 1, 2 * HS)})  # another block size
    with pytest.raises(KVLayoutError):
        worker.register({})
    with pytest.raises(KVLayoutError, match="differ"):
        worker.register({"l0": torch.zeros(2, HEADS, BS, 2 * HS), "l1": torch.zeros(2, HEADS, BS, 2 * HS, dtype=torch.float16)})
    # Triton pads each head (2 * (head_size + pad)): refused against the model's head size, not copied as another layout
    with pytest.raises(KVLayoutError, match="padded"):
        BlockLayout.detect(torch.zeros(2, HEADS, BS, 2 * (HS + 4)), BS, kv_heads=HEADS, head_size=HS)


def test_settings_take_serves_names_env_and_extra_config(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RAGCACHE_HOST_MIB", "64")
    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path))
    s = settings_from_extra_config({})
    assert s.host_mib == 64 and s.disk_dir == tmp_path / "kv" and s.policy == "pgdsf" and s.disk_enabled
    s = settings_from_extra_config({"host_mib": 8, "disk_cache": False})
    assert s.host_bytes == 8 << 20 and not s.disk_enabled
    with pytest.raises(InvalidRequestError, match="host_mb"):
        settings_from_extra_config({"host_mb": 8})
    with pytest.raises(InvalidRequestError, match="host_mib"):
        settings_from_extra_config({"host_mib": -1})


def test_a_failed_block_is_saved_again_when_vllm_recomputes_it() -> None:
    sched = ConnectorScheduler(BS, 100, 10_000, None)
    tokens = list(range(13))
    v = view("a", tokens)
    assert len(sched.plan([ScheduledRequest(v, 0, 13, [0, 1, 2, 3])]).saves) == 3
    keys = block_path_keys(tokens, BS)
    sched.failed([keys[1]])  # the worker could not serve block 1: it and its child leave the host tier
    assert sched.host_keys() == {keys[0]}
    # vLLM truncates the request to block 1 and recomputes from there: both are saved again
    plan = sched.plan([ScheduledRequest(v, 4, 9, [0, 1, 2, 3])])
    assert [s.path_key for s in plan.saves] == keys[1:3]
    assert set(plan.host_drops) == {keys[1], keys[2]}  # the worker drops what it may still hold


def test_a_step_saving_more_than_the_host_tier_holds_keeps_the_index_and_the_worker_equal() -> None:
    sched = ConnectorScheduler(BS, 100, 200, None, policy="lru")  # 2 blocks
    tokens = list(range(21))  # 5 full blocks in one step
    _, plan = run_prefill(sched, "a", tokens, [0, 1, 2, 3, 4, 5])
    held = set()
    for k in plan.host_drops:  # what the worker does: drops first, then saves
        held.discard(k)
    held |= {s.path_key for s in plan.saves if s.to_host}
    assert held == sched.host_keys() and len(held) <= 2


def test_a_request_whose_load_failed_saves_nothing_of_that_step(tmp_path) -> None:
    src = kv_tensors(seed=3)
    sched = ConnectorScheduler(BS, BLOCK_BYTES, 64 * BLOCK_BYTES, None)
    worker = ConnectorWorker(BS, None, host_slots=sched.num_slots)
    worker.register(src)
    tokens = list(range(9))
    _, plan = run_prefill(sched, "a", tokens, [0, 1, 2])
    worker.save(plan)
    worker.settle()  # as vLLM's next step does (bind): the saves are complete
    # b loads block 0 from the host tier, but the worker lost it; c, in the same step, is unrelated
    worker.load(StepPlan(host_drops=[plan.saves[0].path_key]))
    vb, vc = view("b", tokens + [50, 51, 52, 53]), view("c", list(range(100, 109)))
    ext = sched.match(vb, 0)
    sched.after_alloc("b", ext)
    sched.match(vc, 0)
    sched.after_alloc("c", 0)
    step = sched.plan([ScheduledRequest(vb, ext, 13 - ext, [3, 4, 5, 6]), ScheduledRequest(vc, 0, 9, [7, 8, 9])])
    assert {s.req_id for s in step.saves} == {"b", "c"}
    result = worker.load(step)
    assert result.failed_block_ids == {3}
    worker.save(step)
    worker.settle()  # as vLLM's next step does (bind): the saves are complete
    assert worker.counters.skipped_saves == sum(s.req_id == "b" for s in step.saves) >= 1
    assert {s.path_key for s in step.saves if s.req_id == "c"} <= worker.host_keys
    assert not {s.path_key for s in step.saves if s.req_id == "b"} & worker.host_keys


def test_two_replicas_share_blocks_through_a_real_redis(redis_server) -> None:
    from ragcache_backend.cache.remote import RemoteStore

    layout = DISK_LAYOUT
    src, dst = kv_tensors(seed=4), {n: torch.zeros_like(t) for n, t in kv_tensors().items()}
    remote_a = RemoteStore(redis_server.url, "fp", layout, torch.float32)
    remote_b = RemoteStore(redis_server.url, "fp", layout, torch.float32)
    worker_a, worker_b = ConnectorWorker(BS, None, remote_a), ConnectorWorker(BS, None, remote_b)
    worker_a.register(src)
    worker_b.register(dst)
    sched_a = ConnectorScheduler(BS, 1, 0, None, remote_exists=remote_a.exists)
    sched_b = ConnectorScheduler(BS, 1, 0, None, remote_exists=remote_b.exists)
    tokens = list(range(13))
    _, plan = run_prefill(sched_a, "a", tokens, [2, 5, 7, 1])
    assert [s.to_remote for s in plan.saves] == [True, True, True]
    worker_a.save(plan)
    worker_a.settle()  # as vLLM's next step does (bind): the saves are complete
    assert remote_a.flush(10)
    _, again = run_prefill(sched_a, "a2", tokens + [1, 2, 3, 4], [3, 4, 6, 8, 9])  # already there: not sent again
    assert not any(s.to_remote for s in again.saves if s.path_key in {p.path_key for p in plan.saves})
    ext, plan_b = run_prefill(sched_b, "b", tokens, [9, 10, 11, 12])
    assert ext == 12 and {ld.tier for ld in plan_b.loads} == {"remote"}
    assert worker_b.load(plan_b).failed_block_ids == set()
    for n in src:
        assert torch.equal(dst[n][[9, 10, 11]], src[n][[2, 5, 7]])
    assert sched_b.counters.hit_tokens_remote == 12 and worker_b.counters.loaded_remote == 3
    # Redis goes away: lookups find nothing, loads fail over to recomputation, nothing raises
    redis_server.stop()
    _, plan_c = run_prefill(ConnectorScheduler(BS, 1, 0, None, remote_exists=remote_b.exists), "c", tokens, [1, 2, 3, 4])
    assert plan_c.loads == []
    assert worker_b.load(StepPlan(loads=plan_b.loads)).failed_block_ids == {9, 10, 11}
    for s in (remote_a, remote_b):
        s.close(timeout=1)


def test_host_blocks_live_in_slots_and_a_slot_being_written_is_not_evicted_until_reported() -> None:
    sched = ConnectorScheduler(BS, 100, 200, Path("/nonexistent-disk-tier"), policy="lru")  # 2 slots, a disk tier
    assert sched.num_slots == 2
    _, plan = run_prefill(sched, "a", list(range(9)), [0, 1, 2])
    assert sorted(s.slot for s in plan.saves) == [0, 1] and all(s.to_disk for s in plan.saves)
    # both slots wait for their disk writes: nothing can be evicted, so b's blocks are not admitted
    _, plan_b = run_prefill(sched, "b", list(range(50, 59)), [3, 4, 5])
    assert plan_b.host_drops == [] and not any(s.to_host or s.slot is not None for s in plan_b.saves)
    sched.written([s.slot for s in plan.saves])  # the worker's writers are done with both slots
    _, plan_c = run_prefill(sched, "c", list(range(70, 79)), [6, 7, 8])
    assert len(plan_c.host_drops) == 2 and sorted(s.slot for s in plan_c.saves) == [0, 1]  # slots reused


def test_a_removed_entry_still_being_written_frees_its_slot_only_when_reported() -> None:
    sched = ConnectorScheduler(BS, 100, 200, Path("/nonexistent-disk-tier"), policy="lru")
    tokens = list(range(9))
    _, plan = run_prefill(sched, "a", tokens, [0, 1, 2])
    keys = block_path_keys(tokens, BS)
    sched.failed([keys[0]])  # both leave the index while their writes are queued
    assert sched.host_keys() == set()
    _, plan_b = run_prefill(sched, "b", list(range(50, 59)), [3, 4, 5])
    assert not any(s.to_host for s in plan_b.saves)  # their slots are still read by the writers
    sched.written([s.slot for s in plan.saves])
    _, plan_c = run_prefill(sched, "c", list(range(70, 79)), [6, 7, 8])
    assert sorted(s.slot for s in plan_c.saves) == [0, 1]


def test_blocks_pinned_by_a_load_are_evictable_again_after_the_step() -> None:
    sched = ConnectorScheduler(BS, 100, 200, None, policy="lru")
    toks = list(range(9))
    run_prefill(sched, "a", toks, [0, 1, 2])
    run_prefill(sched, "b", toks, [3, 4, 5])  # loads (pins) both, then unpins them
    _, plan = run_prefill(sched, "c", list(range(50, 59)), [6, 7, 8])
    assert len(plan.host_drops) == 2 and all(s.to_host for s in plan.saves)


def test_block_cost_is_fitted_from_timed_steps_relative_to_a_first_block() -> None:
    from ragcache_integrations.vllm.cost import BlockCostModel, StepSample, attended_pairs

    model = BlockCostModel(BS, min_samples=8, refit_every=4)
    assert model.relative_cost(2048) == pytest.approx(2.0)  # the prior until steps are measured
    c0, a, b = 0.004, 2e-4, 1e-7
    shapes = [(alpha, beta) for alpha in (0, 300, 900, 2000) for beta in (1, 16, 200, 700)]
    model.observe([StepSample(c0 + a * beta + b * attended_pairs(alpha, beta), beta, attended_pairs(alpha, beta))
                   for alpha, beta in shapes])
    assert model.coefficients == pytest.approx((c0, a, b), rel=1e-6)
    half = (BS + 1) / 2
    assert model.relative_cost(0) == pytest.approx(1.0)
    assert model.relative_cost(1000) == pytest.approx((a + b * (1000 + half)) / (a + b * half))
    # steps that all look alike say nothing about position: no fit, the prior stays
    flat = BlockCostModel(BS, min_samples=8)
    flat.observe([StepSample(0.01, 16, attended_pairs(0, 16))] * 10 + [StepSample(0.0, 0, 0.0)])
    assert flat.coefficients is None and flat.relative_cost(2048) == pytest.approx(2.0)


def test_the_scheduler_prices_saved_blocks_with_the_measured_cost() -> None:
    from ragcache_integrations.vllm.cost import StepSample, attended_pairs

    sched = ConnectorScheduler(BS, 100, 10_000, None)
    tokens = list(range(13))
    _, plan = run_prefill(sched, "a", tokens, [0, 1, 2, 3])
    assert plan.new_tokens == 13 and plan.attended == attended_pairs(0, 13)
    assert [s.avg_cost for s in plan.saves] == [1.0 + i * BS / 2048 for i in range(3)]  # the prior
    a, b = 1e-4, 1e-6  # attention is costly here: later blocks are worth much more
    sched.timed([StepSample(a * beta + b * attended_pairs(alpha, beta), beta, attended_pairs(alpha, beta))
                 for alpha in (0, 64, 512) for beta in (1, 8, 64, 256) for _ in range(3)])
    _, plan = run_prefill(sched, "b", list(range(100, 113)), [4, 5, 6, 7])
    costs = [s.avg_cost for s in plan.saves]
    assert costs[0] == pytest.approx(1.0) and costs == sorted(costs)
    assert costs[2] == pytest.approx(sched.cost.relative_cost(2 * BS)) and costs[2] > 1.0 + 2 * BS / 2048


def test_a_block_back_in_a_new_slot_is_not_released_by_its_old_slots_write() -> None:
    sched = ConnectorScheduler(BS, 100, 300, Path("/nonexistent-disk-tier"), policy="lru")  # 3 slots
    tokens = list(range(9))
    _, plan = run_prefill(sched, "a", tokens, [0, 1, 2])
    old_slots = [s.slot for s in plan.saves]
    sched.failed([block_path_keys(tokens, BS)[0]])  # both leave while their writes read slots 0 and 1
    _, again = run_prefill(sched, "a2", tokens, [3, 4, 5])  # recomputed: the first block gets slot 2
    assert [s.slot for s in again.saves] == [2, None]
    sched.written(old_slots)  # the old writes are done: slots 0 and 1 are free, slot 2 is still read
    _, plan_c = run_prefill(sched, "c", list(range(50, 63)), [6, 7, 8, 9])
    assert sorted(s.slot for s in plan_c.saves if s.slot is not None) == [0, 1] and plan_c.host_drops == []
    sched.written([2])
    _, plan_d = run_prefill(sched, "d", list(range(70, 75)), [10, 11])
    assert plan_d.host_drops and [s.slot for s in plan_d.saves] == [2]  # now slot 2 may go (lru: a2's block)


def test_more_than_one_vllm_worker_is_refused() -> None:
    check_world_size(1, 1)
    with pytest.raises(InvalidRequestError, match="one vLLM worker"):
        check_world_size(2, 1)
    with pytest.raises(InvalidRequestError, match="1 x 2"):
        check_world_size(1, 2)
