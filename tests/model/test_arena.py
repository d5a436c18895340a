"""The KV arena's memory: the device part committed (zeroed) up front, the shared pool's host part
left to be committed as it fills, both advised onto transparent huge pages where Linux has them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ragcache_backend.model.arena import KVArena, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_THP_ON = sys.platform == "linux" and THP.exists() and "[never]" not in THP.read_text()


def _arena(committed: int | None) -> KVArena:
    return KVArena(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                   device=torch.device("cpu"), inv_freq=torch.ones(32), committed_blocks=committed)


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
