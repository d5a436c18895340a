"""The chunk mode's native measurements (``kernels/chunk_stats.py``) against their torch forms:
attention mass per context segment on a bf16 arena (AVX512-BF16, keys read unpacked for up to 4
rows, packed above; AMX tiles of 16 rows for 64-dim heads where AMX runs) and the quality guard's
K/V deviation in float32 and bf16."""

from __future__ import annotations

import pytest
import torch

from ragcache_backend.model.kernels import amx_gemm, chunk_stats, library, segment_attention_mass
from ragcache_backend.model.kernels.native import NativeKernelError

_BF16 = library.load() is not None and torch.bfloat16 in library.instruction_sets()
_F32 = library.load() is not None and torch.float32 in library.instruction_sets()


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)


@pytest.mark.skipif(not _BF16, reason="the bf16 kernels need AVX512-BF16")
@pytest.mark.parametrize("context,rows,lengths,hkv,d,explicit", [
    (1, 1, [1], 3, 64, False), (1041, 1, [100, 41, 900], 3, 64, False), (90, 3, [30, 60], 2, 16, True),
    (500, 4, [1, 498, 1], 3, 80, True), (700, 5, [350, 350], 3, 64, True), (33, 33, [16, 17], 1, 48, False),
    (2100, 300, [300] * 7, 3, 64, False), (64, 9, [20, 44], 4, 2, True), (300, 17, [299, 1], 1, 256, True)])
def test_bf16_segment_mass_reads_bf16_keys_and_matches_the_reference(context, rows, lengths, hkv, d, explicit):
    """The bf16 kernel (no float32 copy of the keys) gives the float32 reference's masses on the
    same bf16 values, for one row (the guard's), a few rows (read unpacked, head sizes with a tail
    of 16 dims), tiles of 8 rows and a short last tile; rows at the context's end or scattered."""
    g = torch.Generator().manual_seed(context + rows)
    kc = torch.randn(4096, hkv, d, generator=g).bfloat16()
    slots = torch.randperm(4096, generator=g)[:context]
    q = torch.randn(rows, hkv * 3, d, generator=g).bfloat16()[:, ::3]
    pos = (torch.sort(torch.randperm(context, generator=g)[:rows]).values if explicit
           else torch.arange(context - rows, context))
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ref = segment_attention_mass(q.float(), kc[slots].float(), pos, segments, len(lengths), scale=d**-0.5)
    got = chunk_stats.segment_mass(q, kc, slots, pos, _offsets(lengths), d**-0.5)
    assert got.shape == (rows, hkv, len(lengths)) and got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 2e-6
    assert torch.allclose(got.sum(-1), torch.ones(rows, hkv), atol=1e-5)


@pytest.mark.skipif(not _BF16, reason="the bf16 kernels need AVX512-BF16")
@pytest.mark.parametrize("rows", [5, 16, 17, 40, 300])
def test_bf16_segment_mass_on_amx_tiles_and_on_vdpbf16ps_agree_with_the_reference(rows):
    """64-dim heads take AMX tiles of 16 query rows where AMX runs (a short last tile configured
    with its own row count) and VDPBF16PS tiles of 8 rows where it does not (``bf16_amx(False)``):
    both give the reference's masses, for rows at the end of the context and scattered."""
    g = torch.Generator().manual_seed(rows)
    kc = torch.randn(4096, 3, 64, generator=g).bfloat16()
    slots = torch.randperm(4096, generator=g)[:1100]
    q = torch.randn(rows, 9, 64, generator=g).bfloat16()[:, ::3]
    lengths = [29, 300, 700, 71]
    segments = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    before = amx_gemm.bf16_amx()
    try:
        for amx in sorted({False, before}):
            amx_gemm.bf16_amx(amx)
            for pos in (torch.arange(1100 - rows, 1100), torch.sort(torch.randperm(1100, generator=g)[:rows]).values):
                ref = segment_attention_mass(q.float(), kc[slots].float(), pos, segments, 4, scale=0.125)
                got = chunk_stats.segment_mass(q, kc, slots, pos, _offsets(lengths), 0.125)
                assert (got - ref).abs().max().item() < 2e-6, amx
    finally:
        amx_gemm.bf16_amx(before)


@pytest.mark.skipif(not _BF16, reason="the bf16 kernels need AVX512-BF16")
def test_bf16_segment_mass_refuses_what_would_read_outside_its_inputs():
    kc = torch.randn(64, 3, 64).bfloat16()
    q = torch.randn(4, 3, 64).bfloat16()
    slots, pos = torch.arange(10), torch.tensor([6, 7, 8, 9])
    assert chunk_stats.segment_mass(q, kc, slots, pos, _offsets([5, 5]), 0.125).shape == (4, 3, 2)
    for args in [(q, kc, slots, torch.tensor([6, 7, 8, 10]), _offsets([5, 5])),  # a row past the context
                 (q, kc, slots, pos, _offsets([5, 4])),  # segments that do not cover the context
                 (q, kc, torch.tensor([0, 1, 64]), torch.tensor([0, 1, 2, 2]), _offsets([3])),  # a slot outside the arena
                 (q[..., :63], kc[..., :63].contiguous(), slots, pos, _offsets([5, 5])),  # an odd head size
                 (q, kc.float(), slots, pos, _offsets([5, 5]))]:  # queries and arena of different dtypes
        with pytest.raises(NativeKernelError):
            chunk_stats.segment_mass(*args, 0.125)


def _reference_deviation(kc, vc, slots, old_k, old_v):
    new = torch.cat((kc[slots].float().flatten(1), vc[slots].float().flatten(1)), 1)
    old = torch.cat((old_k.float().flatten(1), old_v.float().flatten(1)), 1)
    ref = old.norm(dim=1)
    return torch.where(ref > 0, (new - old).norm(dim=1) / ref.clamp_min(1e-6), torch.zeros_like(ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hkv,d", [(1, 3, 64), (441, 3, 64), (7, 1, 16), (200, 4, 128)])
def test_kv_deviation_matches_the_torch_form(dtype, rows, hkv, d):
    """Relative L2 of each row's new K and V (one vector) against the old: the torch form's value
    within float32 rounding; a row that did not move gives 0, a row whose old K/V were zero gives 0."""
    if not (_BF16 if dtype == torch.bfloat16 else _F32):
        pytest.skip(f"no native kernels for {dtype} here")
    g = torch.Generator().manual_seed(rows + d)
    kc, vc = torch.randn(2048, hkv, d, generator=g).to(dtype), torch.randn(2048, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(2048, generator=g)[:rows]
    old_k = (kc[slots].float() + 0.1 * torch.randn(rows, hkv, d, generator=g)).to(dtype)
    old_v = (vc[slots].float() + 0.1 * torch.randn(rows, hkv, d, generator=g)).to(dtype)
    old_k[0], old_v[0] = kc[slots[0]], vc[slots[0]]  # did not move
    if rows > 1:
        old_k[-1], old_v[-1] = 0, 0  # nothing there before
    got = chunk_stats.kv_deviation(kc, vc, slots, old_k, old_v)
    ref = _reference_deviation(kc, vc, slots, old_k, old_v)
    assert got.shape == (rows,) and got.dtype == torch.float32
    assert got[0].item() == 0.0 and (rows == 1 or got[-1].item() == 0.0)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-7)
    if rows > 2:
        assert got[1:-1].min().item() > 0.05


@pytest.mark.skipif(not _F32, reason="no native float32 kernels here")
def test_kv_deviation_refuses_bad_arguments():
    kc, vc = torch.randn(64, 3, 64), torch.randn(64, 3, 64)
    slots = torch.tensor([1, 5, 9])
    old = torch.zeros(3, 3, 64)
    assert chunk_stats.kv_deviation(kc, vc, slots, old, old).shape == (3,)
    for args in [(kc, vc, torch.tensor([1, 5, 64]), old, old),  # a slot outside the arena
                 (kc, vc, slots.int(), old, old),  # int32 slots
                 (kc, vc, slots, old[:2], old),  # fewer old rows than slots
                 (kc, vc, slots, old.bfloat16(), old),  # another dtype
                 (kc, vc[:, :2].contiguous(), slots, old, old),  # K and V of different shapes
                 (kc.double(), vc.double(), slots, old.double(), old.double())]:  # no kernel for float64
        with pytest.raises(NativeKernelError):
            chunk_stats.kv_deviation(*args)
