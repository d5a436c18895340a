"""The KV arena's memory: the device part committed (zeroed) up front, the shared pool's host part
left to be committed as it fills or committed by a background thread, both advised onto transparent
huge pages where Linux has them."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from ragcache_backend.model.arena import KVArena, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_THP_ON = sys.platform == "linux" and THP.exists() and "[never]" not in THP.read_text()


def _arena(committed: int | None, blocks: int = 64) -> KVArena:
    return KVArena(num_layers=2, num_blocks=blocks, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                   device=torch.device("cpu"), inv_freq=torch.ones(32), committed_blocks=committed)


def resident_share(t: torch.Tensor) -> float:
    """Share of ``t``'s whole pages that Linux has in memory (``mincore``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    lo = -(-t.data_ptr() // page) * page
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / len(vec)


@pytest.mark.parametrize("committed", [None, 0, 10, 64])
def test_the_committed_blocks_start_zeroed_and_the_arena_has_its_shape(committed):
    arena = _arena(committed)
    assert arena.k_cache.shape == arena.v_cache.shape == (2, 64 * 16, 2, 64)
    upto = 64 * 16 if committed is None else committed * 16
    assert not arena.k_cache[:, :upto].any() and not arena.v_cache[:, :upto].any()
    arena.k_cache[:, upto:] = 1  # the rest is ordinary memory, written on first use
    assert arena.k_cache[:, upto:].eq(1).all()


@pytest.mark.skipif(not _THP_ON, reason="transparent huge pages are off here (or not Linux)")
def test_large_cpu_tensors_are_advised_onto_huge_pages_and_small_ones_left_alone():
    big = torch.empty(16 << 20, dtype=torch.uint8)  # spans whole 2 MiB pages
    assert advise_huge_pages(big)
    big.fill_(1)
    assert big.eq(1).all()
    assert not advise_huge_pages(torch.empty(4096, dtype=torch.uint8))  # inside one huge page: nothing to advise


def test_no_advice_off_the_cpu():
    assert not advise_huge_pages(torch.empty(16 << 20, dtype=torch.uint8, device="meta"))


def test_ragcache_huge_pages_0_leaves_the_arena_on_small_pages(monkeypatch):
    monkeypatch.setenv("RAGCACHE_HUGE_PAGES", "0")
    assert not advise_huge_pages(torch.empty(16 << 20, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_layer", [False, True])
def test_a_chunk_moved_by_the_native_kernel_has_the_bits_of_the_torch_ops(dtype, per_layer, monkeypatch):
    """copy_rerotated (a reused chunk's KV to its new place, keys re-rotated by the position delta)
    on the native kernel (csrc/rerotate.c) writes the bits the PyTorch ops write (float32 products
    and sum, one rounding to the arena's dtype), for every layer, one RoPE table or one per layer
    (layers with different bases), a move up and one down; values copied as they are, nothing else
    touched; the same blocks as source and destination keep the torch path."""
    from ragcache_backend.cache.blocks import KVRun
    from ragcache_backend.model.kernels import native

    if not native.rerotate_copy_available(torch.zeros(1, 16, 2, 64, dtype=dtype)):
        pytest.skip(f"no native kernel library here: {native.unavailable_reason(dtype, 'cpu', 64)}")
    g = torch.Generator().manual_seed(7)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    inv_freq = torch.stack([inv, inv * 0.5, inv * 2.0]) if per_layer else inv
    arenas = [KVArena(3, 12, 16, 2, 64, dtype, torch.device("cpu"), inv_freq) for _ in range(2)]
    for c in ("k_cache", "v_cache"):
        data = torch.randn(3, 12 * 16, 2, 64, generator=g).to(dtype)
        for a in arenas:
            getattr(a, c).copy_(data)
    src, dst = KVRun((1, 4), 5, 20), KVRun((7, 8, 9), 11, 20)
    real = native.rerotate_copy_available
    for delta in (37, -211):
        calls = []
        monkeypatch.setattr(native, "rerotate_copy_available", lambda k: calls.append(k) or real(k))
        arenas[0].copy_rerotated(src, dst, delta)  # native
        assert calls
        monkeypatch.setattr(native, "rerotate_copy_available", lambda k: False)
        arenas[1].copy_rerotated(src, dst, delta)  # the torch ops
        assert torch.equal(arenas[0].k_cache, arenas[1].k_cache) and torch.equal(arenas[0].v_cache, arenas[1].v_cache)
    moved = arenas[0].slots([dst])
    assert not torch.equal(arenas[0].k_cache[:, moved], arenas[0].k_cache[:, arenas[0].slots([src])])  # keys did move
    kernel = native.rerotate_copy
    monkeypatch.setattr(native, "rerotate_copy", lambda *a: pytest.fail("overlapping runs must keep the torch path"))
    monkeypatch.setattr(native, "rerotate_copy_available", real)
    arenas[0].copy_rerotated(KVRun((1, 2), 0, 16), KVRun((2, 3), 0, 16), 5)
    with pytest.raises(native.NativeKernelError):
        kernel(arenas[0].k_cache, arenas[0].v_cache, torch.tensor([0, 1]), torch.tensor([12 * 16, 2]),
                             torch.ones(64), torch.zeros(64))  # a slot past the arena
    with pytest.raises(native.NativeKernelError):
        kernel(arenas[0].k_cache, arenas[0].v_cache, torch.tensor([0, 1]), torch.tensor([1, 2]), torch.ones(64),
               torch.zeros(64))  # slot 1 both read and written


_LINUX = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE and mincore are Linux's")


@_LINUX
def test_the_host_part_is_committed_in_the_background_without_touching_what_is_written():
    arena = _arena(4, blocks=12288)  # 4 committed blocks, 12,284 of the host part: 96 MiB each of K and V
    host = arena.k_cache[:, 4 * 16:]
    # usually fresh pages (not resident yet); after a long run of other tests the allocator may hand
    # back memory already resident, and then the residency check below shows nothing new
    fresh = resident_share(arena.v_cache[:, 4 * 16:]) < 0.5
    arena.k_cache[:, 100 * 16:110 * 16] = 3  # blocks the engine wrote before the thread reached them
    before = arena.v_cache[:, 4 * 16:].clone()  # whatever the uncommitted memory holds (never read unwritten)
    commit = arena.commit_in_background()
    assert commit is not None and commit.join(timeout=30)
    if commit.error is not None and "errno 22" in commit.error:
        pytest.skip(f"this kernel is older than 5.14 ({commit.error})")
    host_bytes = 2 * host.numel() * host.element_size()  # K and V; less a page at each layer's edge
    assert commit.error is None and commit.committed_bytes == commit.total_bytes >= host_bytes - 4 * os.sysconf("SC_PAGE_SIZE")
    assert resident_share(arena.k_cache[:, 4 * 16:]) == 1.0 and resident_share(arena.v_cache[:, 4 * 16:]) == 1.0, fresh
    assert arena.k_cache[:, 100 * 16:110 * 16].eq(3).all()  # written blocks kept
    assert torch.equal(arena.v_cache[:, 4 * 16:].view(torch.int16), before.view(torch.int16))  # contents unchanged


def test_nothing_to_commit_when_the_whole_arena_is_committed_or_off_the_cpu():
    assert _arena(None).commit_in_background() is None
    assert _arena(64).commit_in_background() is None
    off_cpu = KVArena(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                      device=torch.device("meta"), inv_freq=torch.ones(32), committed_blocks=4)
    assert off_cpu.commit_in_background() is None  # another device's memory: nothing of the host's to commit


@_LINUX
def test_a_background_commit_stops_when_asked():
    arena = KVArena(num_layers=4, num_blocks=4096, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                    device=torch.device("cpu"), inv_freq=torch.ones(32), committed_blocks=1)  # 128 MiB each of K, V
    commit = arena.commit_in_background()
    t = time.perf_counter()
    commit.stop()
    assert not commit.running and time.perf_counter() - t < 10
    assert commit.committed_bytes <= commit.total_bytes
