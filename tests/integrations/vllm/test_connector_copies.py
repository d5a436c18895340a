"""The connector worker's block copies: host saves on the CPU saver thread (completed before the
next step, failures raised there), every vLLM KV layout byte for byte through the host arena, the
disk tier and a restart, and on CUDA the copy stream's ordering with the forward pass. Fixtures and
the scheduler-side tests: ``test_connector_parts.py``."""

from __future__ import annotations

import pytest
import torch

from ragcache_backend.cache.disk import DiskStore, store_folder
from ragcache_integrations.vllm.layout import BlockLayout
from ragcache_integrations.vllm.plan import StepPlan
from ragcache_integrations.vllm.scheduler import ConnectorScheduler
from ragcache_integrations.vllm.worker import ConnectorWorker
from tests.integrations.vllm.test_connector_parts import (BLOCK_BYTES, BS, HEADS, HS, LAYERS, disk_worker,
                                                          kv_tensors, run_prefill)

def test_cpu_saves_run_on_the_saver_thread_and_complete_before_the_next_step(tmp_path, monkeypatch) -> None:
    import threading

    src, disk, sched, worker = disk_worker(tmp_path, seed=5, slots=64)
    copied_on: list[str] = []
    copy = worker._copy_blocks

    def spy(*args, **kwargs):
        copied_on.append(threading.current_thread().name)
        return copy(*args, **kwargs)

    monkeypatch.setattr(worker, "_copy_blocks", spy)
    tokens = list(range(13))
    _, plan = run_prefill(sched, "a", tokens, [2, 5, 7, 1])
    worker.load(plan)
    for name in src:  # vLLM's save_kv_layer: nothing copied on the forward pass's thread
        worker.save_layer(plan, name)
    assert copied_on == []
    worker.save(plan)  # returns at once; the saver copies every layer
    worker.settle()
    assert len(copied_on) == LAYERS and all(n.startswith("ragcache-save") for n in copied_on)
    assert worker.host_keys == {s.path_key for s in plan.saves}
    # the next step loads them back (load settles first when the caller did not)
    _, plan2 = run_prefill(sched, "b", tokens, [9, 10, 11, 12])
    worker.save(StepPlan())
    assert {ld.tier for ld in plan2.loads} == {"host"} and worker.load(plan2).failed_block_ids == set()
    for name in src:
        assert torch.equal(src[name][[9, 10, 11]], src[name][[2, 5, 7]])
    # close() completes the last step's saves before it stops the writers: they reach the disk
    _, plan3 = run_prefill(sched, "c", list(range(50, 59)), [13, 14, 15])
    worker.load(plan3)
    worker.save(plan3)
    worker.close()
    assert all(disk.lookup(s.path_key) is not None for s in plan3.saves)


def test_a_failure_on_the_saver_thread_is_raised_to_the_next_step() -> None:
    from dataclasses import replace

    src = kv_tensors(seed=6)  # 16 blocks per layer
    sched = ConnectorScheduler(BS, BLOCK_BYTES, 64 * BLOCK_BYTES, None)
    worker = ConnectorWorker(BS, None, host_slots=sched.num_slots)
    worker.register(src)
    _, plan = run_prefill(sched, "a", list(range(9)), [0, 1, 2])
    bad = StepPlan(saves=[replace(s, block_id=999) for s in plan.saves])  # a block vLLM's KV does not have
    worker.save(bad)  # returns: the copy fails on the saver thread
    with pytest.raises(IndexError, match="999"):
        worker.settle()
    worker.settle()  # raised once, then nothing pending
    assert worker.host_keys == set()
    worker.close()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def vllm_kv(kind: str, device: str, num_blocks: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors in one of vLLM's layouts: ``packed`` (contiguous), ``packed-nhd`` (a
    permuted view of ``[num_blocks, block_size, kv_heads, 2*head_size]`` storage, vLLM's NHD stride
    order) or ``split`` (ROCm's ``[num_blocks, 2, block_size, kv_heads, head_size]``)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        if kind == "packed":
            t = torch.randn(num_blocks, HEADS, BS, 2 * HS, generator=g)
        elif kind == "packed-nhd":
            t = torch.randn(num_blocks, BS, HEADS, 2 * HS, generator=g).permute(0, 2, 1, 3)
        else:
            t = torch.randn(num_blocks, 2, BS, HEADS, HS, generator=g)
        out[f"model.layers.{i}.self_attn"] = t.to(device)
    return out


@pytest.mark.parametrize("device", DEVICES + ["cpu-as-gpu"])
@pytest.mark.parametrize("kind", ["packed", "packed-nhd", "split"])
def test_worker_copies_every_layout_exactly_through_host_disk_and_a_restart(tmp_path, kind, device) -> None:
    """vLLM's KV in each layout it registers, on the CPU and (where one is visible) a GPU, and CPU
    tensors read as a GPU backend lays them out (``cpu-as-gpu``, so CI sends GPU layouts through the
    worker): blocks saved through the host arena and the disk tier come back byte for byte into
    other block ids, in this process (host tier) and in a fresh one (disk tier); with a GPU layout
    the disk holds the true K, as vLLM's attention splits it."""
    platform = "cuda" if device == "cpu-as-gpu" else None
    device = "cpu" if device == "cpu-as-gpu" else device
    src = vllm_kv(kind, device, seed=5)
    layout = BlockLayout.detect(next(iter(src.values())), BS, kv_heads=HEADS, head_size=HS, platform=platform)
    gpu_kind = platform is not None or device != "cpu"
    assert layout.kind == ("split" if kind == "split" else "packed" if gpu_kind else "packed_cpu")
    disk = DiskStore(tmp_path, "fp", layout.disk_layout(LAYERS), torch.float32, 1 << 30)
    sched = ConnectorScheduler(BS, BLOCK_BYTES, 64 * BLOCK_BYTES, store_folder(tmp_path, "fp"))
    worker = ConnectorWorker(BS, disk, host_slots=sched.num_slots)
    worker.register(src, layout)
    tokens = list(range(13))
    _, plan = run_prefill(sched, "a", tokens, [2, 5, 7, 1])
    assert worker.load(plan).failed_block_ids == set()
    worker.save_layer(plan, list(src)[0])
    worker.save(plan)
    worker.settle()  # as vLLM's next step does (bind): the saves are complete
    assert disk.flush(10)
    sched.written(worker.take_written())
    if gpu_kind:  # the tiers' k and v are the K and V vLLM's attention reads
        k, v = disk.load(disk.lookup(plan.saves[0].path_key))
        first = src["model.layers.0.self_attn"][2:3].cpu()
        if kind == "split":
            key, value = first.unbind(1)  # [1, bs, heads, hs]
        else:
            key, value = first.transpose(1, 2).split(HS, dim=-1)  # flash_attn.py's split
        assert torch.equal(k[0], key[0]) and torch.equal(v[0], value[0])
    # the host tier, into other block ids of fresh tensors in the same layout
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    worker.register(dst, layout)
    _, plan2 = run_prefill(sched, "b", tokens, [3, 4, 6, 8])
    assert {ld.tier for ld in plan2.loads} == {"host"} and worker.load(plan2).failed_block_ids == set()
    worker.wait_loads()  # as vLLM's wait_for_layer_load before each layer (on a GPU the copies are queued)
    # a restart: only the disk tier is left
    dst2 = {n: torch.zeros_like(t) for n, t in src.items()}
    worker2 = ConnectorWorker(BS, DiskStore(tmp_path, "fp", disk.layout, torch.float32, 1 << 30))
    worker2.register(dst2, layout)
    ext, plan3 = run_prefill(ConnectorScheduler(BS, 1, 1 << 30, store_folder(tmp_path, "fp")), "c", tokens, [9, 10, 11, 12])
    assert ext == 12 and {ld.tier for ld in plan3.loads} == {"disk"}
    assert worker2.load(plan3).failed_block_ids == set()
    worker2.wait_loads()
    for name in src:
        assert torch.equal(dst[name][[3, 4, 6]], src[name][[2, 5, 7]])
        assert torch.equal(dst2[name][[9, 10, 11]], src[name][[2, 5, 7]])
        assert not dst[name][[0, 1, 2, 5]].any() and not dst2[name][:9].any()  # nothing else written
    worker.close()
    worker2.close()


class SlowKernels:
    """Queues ~0.2 s of GPU work on the current stream when called (ten float32 8192^3 products,
    ~21 ms each on an H100): a forward pass still running when the connector is called. The
    operands are allocated and cuBLAS initialised here (its first product blocked the CPU for
    0.11 s on an H100): nothing in the timed part may wait for the GPU but the connector."""

    def __init__(self) -> None:
        self.a = torch.ones(8192, 8192, device="cuda")
        self.out = torch.empty_like(self.a)
        torch.mm(self.a, self.a, out=self.out)
        torch.cuda.synchronize()

    def __call__(self) -> None:
        for _ in range(10):
            torch.mm(self.a, self.a, out=self.out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams: needs a GPU (benchmarks/gpu_check.sh)")
def test_cuda_copies_are_ordered_with_the_forward_pass_without_waiting_for_it(tmp_path) -> None:
    """On a GPU the worker queues its copies on its own stream: a save reads a block only after the
    kernels queued before it (which wrote the block) have run, a load writes after them, and a layer
    read after ``wait_layer`` sees the loaded block, while ``save_layer`` and ``load`` return
    before the slow kernel ends (the CPU does not wait for the GPU)."""
    import time

    src = vllm_kv("packed", "cuda", seed=3)
    names = list(src)
    layout = BlockLayout.detect(src[names[0]], BS, kv_heads=HEADS, head_size=HS)
    disk = DiskStore(tmp_path, "fp", layout.disk_layout(LAYERS), torch.float32, 1 << 30)
    sched = ConnectorScheduler(BS, BLOCK_BYTES, 64 * BLOCK_BYTES, store_folder(tmp_path, "fp"))
    worker = ConnectorWorker(BS, disk, host_slots=sched.num_slots)
    worker.register(src, layout)
    tokens = list(range(9))
    _, plan = run_prefill(sched, "a", tokens, [2, 5, 7])
    assert worker.load(plan).failed_block_ids == set()
    written = torch.tensor([2, 5], device="cuda")  # the blocks the step completes
    slow_kernels = SlowKernels()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, name in enumerate(names):  # "the forward pass": a slow kernel, then the layer writes its KV
        slow_kernels()
        src[name].index_fill_(0, written, float(i + 1))
        worker.save_layer(plan, name)
    queued = time.perf_counter() - t0
    worker.save(plan)
    worker.settle()  # as vLLM's next step does (bind): the saves are complete
    assert queued < 0.05, f"save_layer waited for the GPU ({queued:.3f} s)"
    assert disk.flush(10)
    sched.written(worker.take_written())
    k, _ = disk.load(disk.lookup(plan.saves[0].path_key))
    assert torch.equal(k, torch.arange(1, LAYERS + 1, dtype=torch.float32).view(LAYERS, 1, 1, 1).expand_as(k))
    # a load into fresh tensors, queued behind a slow kernel that writes the same blocks first
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    worker.register(dst, layout)
    _, plan2 = run_prefill(sched, "b", tokens, [8, 9, 10])
    assert {ld.tier for ld in plan2.loads} == {"host"}
    stale = torch.tensor([8, 9], device="cuda")
    slow_kernels()
    for t in dst.values():
        t.index_fill_(0, stale, -1.0)
    t0 = time.perf_counter()
    assert worker.load(plan2).failed_block_ids == set()
    assert time.perf_counter() - t0 < 0.05, "load waited for the GPU"
    reader = torch.cuda.Stream()  # a stream that waits for nothing but wait_layer: without it, it
    with torch.cuda.stream(reader):  # would read before the copies, which are behind the slow kernel
        for i, name in enumerate(names):
            worker.wait_layer(i)  # as vLLM's wait_for_layer_load, on the forward pass's stream
            assert torch.equal(dst[name][[8, 9]], src[name][[2, 5]])
    worker.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams: needs a GPU (benchmarks/gpu_check.sh)")
def test_cuda_loads_from_scattered_slots_and_the_disk_in_one_step(tmp_path) -> None:
    """Host-tier blocks in slots that are not consecutive (several runs, out of order) and blocks
    read from the disk tier, loaded in one step into block ids in another order: each lands
    exactly where the plan says, and nothing else is written."""
    from ragcache_integrations.vllm.plan import BlockLoad, BlockSave

    src = vllm_kv("packed", "cuda", num_blocks=12, seed=4)
    layout = BlockLayout.detect(next(iter(src.values())), BS, kv_heads=HEADS, head_size=HS)
    disk = DiskStore(tmp_path, "fp", layout.disk_layout(LAYERS), torch.float32, 1 << 30)
    worker = ConnectorWorker(BS, disk, host_slots=8)
    worker.register(src, layout)

    def toks(j: int) -> tuple[int, ...]:
        return tuple(range(j * BS, (j + 1) * BS))

    slots = {0: 5, 1: 2, 2: 3, 3: 7, 4: 0}  # source block -> host slot: runs (5), (2, 3), (7), (0)
    saves = [BlockSave(f"h{b}", "", f"s{b}", toks(b), b, True, False, 1.0, "a", slot=slot) for b, slot in slots.items()]
    saves += [BlockSave(f"d{b}", "", f"t{b}", toks(b), b, False, True, 1.0, "a") for b in (5, 6)]
    worker.save(StepPlan(saves=saves))
    worker.settle()  # as vLLM's next step does (bind): the saves are complete
    assert disk.flush(10)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    worker.register(dst, layout)
    where = {3: 1, 1: 3, 2: 4, 4: 11, 0: 9}  # source block -> destination block id; slots 7, 2, 3, 0, 5
    loads = [BlockLoad(f"h{b}", toks(b), where[b], "host", "b", slot=slots[b]) for b in where]
    loads += [BlockLoad(f"d{b}", toks(b), dest, "disk", "b") for b, dest in ((6, 6), (5, 2))]
    for max_runs in (8, 0):  # runs copied one by one; gathered on the CPU first (more runs than MAX_RUNS)
        for t in dst.values():
            t.zero_()
        worker.MAX_RUNS = max_runs
        assert worker.load(StepPlan(loads=loads)).failed_block_ids == set()
        worker.wait_loads()
        written = set()
        for name in src:
            for b, dest in list(where.items()) + [(6, 6), (5, 2)]:
                assert torch.equal(dst[name][dest], src[name][b]), (max_runs, name, b, dest)
                written.add(dest)
            assert not dst[name][[j for j in range(12) if j not in written]].any()
    # saves into scattered slots, gathered and scattered on the CPU, come back exactly
    worker.MAX_RUNS = 0
    back = {5: 6, 2: 9, 7: 3}  # slot -> block id to save from dst (which now holds src's blocks)
    worker.save(StepPlan(saves=[BlockSave(f"x{slot}", "", f"y{slot}", toks(slot), b, True, False, 1.0, "c", slot=slot)
                                for slot, b in back.items()]))
    fresh = {n: torch.zeros_like(t) for n, t in src.items()}
    worker.register(fresh, layout)
    worker.MAX_RUNS = 8
    assert worker.load(StepPlan(loads=[BlockLoad(f"x{slot}", toks(slot), b, "host", "d", slot=slot)
                                       for slot, b in back.items()])).failed_block_ids == set()
    worker.wait_loads()
    for name in src:
        assert torch.equal(fresh[name][[6, 9, 3]], src[name][[6, 0, 1]])  # dst held them there
    worker.close()
