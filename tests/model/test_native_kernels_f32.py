"""The native float32 CPU kernels (AVX2 + FMA) against the torch reference, and the row independence
they keep. They run on every x86-64 CPU since Haswell / Zen 1, so CI exercises them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ragcache_backend.model.kernels import (apply_rope, attention, native, position_mask, prefix_causal_mask, rope_cos_sin,
                                           segment_attention_mass)
from ragcache_backend.model.kernels import library
from ragcache_backend.model.kernels.native import NativeKernelError
from tests.model.explicit_positions import (EDGES, assert_forged_positions_fail_in_the_kernel,
                                            assert_mixed_step_rows_alone, scattered)

pytestmark = pytest.mark.skipif(not native.available(torch.float32, "cpu", 64),
                                reason=f"float32 native kernels: {native.unavailable_reason(torch.float32, 'cpu', 64)}")


def _arena(slots: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)


def _reference(q, kc, vc, slots, cached):
    new, d = q.shape[0], q.shape[2]
    return attention(q.double(), kc[slots].double(), vc[slots].double(), scale=d**-0.5,
                     mask=prefix_causal_mask(new, cached + new)).float()


@pytest.mark.parametrize("cached,new,hq,hkv,d", [(0, 1, 9, 3, 64), (0, 70, 9, 3, 64), (5, 3, 4, 4, 64), (130, 64, 8, 2, 128),
                                                   (63, 1, 9, 3, 64), (64, 65, 6, 3, 64), (300, 300, 9, 3, 64),
                                                   (17, 33, 4, 1, 32), (1024, 30, 9, 3, 64), (40, 9, 16, 1, 16)])
def test_paged_attention_matches_the_reference(cached, new, hq, hkv, d):
    kc, vc = _arena(2048, hkv, d, seed=cached + new)
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(2048, generator=g)[: cached + new]
    qkv = torch.randn(new, hq + 2 * hkv, d, generator=g)
    q = qkv[:, :hq]  # strided rows, as the runner passes them
    out = native.paged_prefill_attention(q, kc, vc, slots, cached, d**-0.5)
    assert out.shape == (new, hq, d) and out.dtype == torch.float32
    assert (out - _reference(q, kc, vc, slots, cached)).abs().max().item() < 2e-6


def test_paged_attention_rows_do_not_depend_on_the_other_rows():
    """Row t is bit-identical whether 0, 1, 17, 64 or 999 of the rows before it came from the
    cache, and whether later rows run in the same call."""
    kc, vc = _arena(2048, 3, 64, seed=1)
    g = torch.Generator().manual_seed(2)
    slots = torch.randperm(2048, generator=g)[:1000]
    q = torch.randn(1000, 9, 64, generator=g)
    cold = native.paged_prefill_attention(q, kc, vc, slots, 0, 0.125)
    for cached in (1, 17, 64, 500, 999):
        warm = native.paged_prefill_attention(q[cached:], kc, vc, slots, cached, 0.125)
        assert torch.equal(warm, cold[cached:]), cached
    head = native.paged_prefill_attention(q[:300], kc, vc, slots[:300], 0, 0.125)
    assert torch.equal(head, cold[:300])



def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)


@pytest.mark.parametrize("context,rows,lengths,hkv,d,explicit", [
    (1, 1, [1], 3, 64, False), (47, 15, [12, 20, 15], 2, 16, False), (2000, 2000, [200] * 10, 3, 64, False),
    (777, 60, [100, 1, 600, 76], 3, 64, True), (300, 299, [299, 1], 1, 128, True), (130, 7, [64, 66], 4, 32, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_mass_matches_the_torch_reference(context, rows, lengths, hkv, d, explicit, dtype):
    """Cache-Craft eq. 3-4 statistics read from the arena in place equal the reference (keys
    gathered, softmax over a masked [T, S] score matrix, one-hot segment sums), for strided query
    heads (one per KV group, as the runner passes them), rows at the end of the context or at
    explicit scattered positions, and segments of 1 token up to whole contexts; a bf16 arena's
    too (both compute in float32)."""
    kc, _ = _arena(4096, hkv, d, seed=context + rows)
    kc = kc.to(dtype)
    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(4096, generator=g)[:context]
    group = 3
    q = torch.randn(rows, hkv * group, d, generator=g).to(dtype)[:, ::group]
    pos = (torch.sort(torch.randperm(context, generator=g)[:rows]).values if explicit
           else torch.arange(context - rows, context))
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ref = segment_attention_mass(q, kc[slots], pos, segments, len(lengths), scale=d**-0.5)
    got = native.segment_mass(q, kc, slots, pos, _offsets(lengths), d**-0.5)
    assert got.shape == (rows, hkv, len(lengths)) and got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 2e-6
    assert torch.allclose(got.sum(-1), torch.ones(rows, hkv), atol=1e-5)


def test_segment_mass_refuses_what_would_read_outside_its_inputs():
    kc, _ = _arena(64, 3, 64, seed=0)
    q = torch.randn(4, 3, 64)
    slots, pos = torch.arange(10), torch.tensor([6, 7, 8, 9])
    assert native.segment_mass(q, kc, slots, pos, _offsets([5, 5]), 0.125).shape == (4, 3, 2)
    bad = [
        (q, kc, slots, torch.tensor([6, 7, 8, 10]), _offsets([5, 5])),  # a row past the context
        (q, kc, slots, torch.tensor([-1, 7, 8, 9]), _offsets([5, 5])),  # a negative position
        (q, kc, slots, pos, _offsets([5, 4])),  # segments that do not cover the context
        (q, kc, slots, pos, torch.tensor([0, 5, 5, 10])),  # an empty segment
        (q, kc, torch.tensor([0, 1, 64]), torch.tensor([0, 1, 2, 2]), _offsets([3])),  # a slot outside the arena
        (q, kc[:, :2], slots, pos, _offsets([5, 5])),  # heads that disagree
        (q.double(), kc, slots, pos, _offsets([5, 5])),  # not float32
        (q.bfloat16(), kc, slots, pos, _offsets([5, 5])),  # queries and arena of different dtypes
        (q, kc, slots, pos.int(), _offsets([5, 5])),  # int32 positions
    ]
    for args in bad:
        with pytest.raises(NativeKernelError):
            native.segment_mass(*args, 0.125)


@pytest.mark.parametrize("context,hq,hkv,d", [(1, 9, 3, 64), (15, 9, 3, 64), (16, 9, 3, 64), (511, 9, 3, 64), (512, 9, 3, 64),
                                              (513, 9, 3, 64), (1000, 9, 3, 64), (3000, 9, 3, 64), (77, 8, 1, 128),
                                              (600, 10, 1, 32), (300, 4, 4, 64), (700, 5, 1, 64)])
def test_decode_kernel_matches_the_reference(context, hq, hkv, d):
    """Contexts over 512 keys are split into chunks whose partial softmax sums are merged; query
    heads per KV head from 1 to 10 (value tiles of 1 to 4 heads)."""
    kc, vc = _arena(4096, hkv, d, seed=context)
    g = torch.Generator().manual_seed(9)
    slots = torch.randperm(4096, generator=g)[:context]
    q = torch.randn(1, hq, d, generator=g)
    out = native.paged_prefill_attention(q, kc, vc, slots, context - 1, d**-0.5, decode=True)
    assert (out - _reference(q, kc, vc, slots, context - 1)).abs().max().item() < 2e-6


_WIDE = native.available(torch.float32, "cpu", 64) and native.float32_wide()


@pytest.mark.skipif(not _WIDE, reason="this CPU has no AVX-512F: the prompt attention runs on 256-bit registers only")
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 1, 32), (6, 2, 48), (16, 1, 16), (5, 5, 80)])
def test_prompt_attention_on_512_bit_registers_gives_the_256_bit_bits(hq, hkv, d):
    """Where the CPU has AVX-512F the prompt rows' QK^T and PV loops run on 512-bit registers
    (``rc32_wide``): the same bits as on 256-bit ones, for cold prompts, prompts over a cached prefix,
    rows at explicit positions and generated tokens in one call (head sizes with an odd 16-dim tail
    included), so an AVX2 machine and an AVX-512 one serve the same cache the same way."""
    kc, vc = _arena(8192, hkv, d, seed=d + hq)
    g = torch.Generator().manual_seed(hq)
    perm = torch.randperm(8192, generator=g)
    specs = [(0, 131, None), (1000, 45, None), (700, 1, "decode"), (513, 0, scattered(513, 70, 7, must=EDGES)), (63, 2, None)]
    contexts, new, decode, given, rows_at, at = [], [], [], [], [], 0
    for cached, n, kind in specs:
        pos = kind if isinstance(kind, torch.Tensor) else None
        size = cached if pos is not None else cached + n
        contexts.append(perm[at : at + size])
        at += size
        new.append(pos.numel() if pos is not None else n)
        decode.append(isinstance(kind, str))
        given.append(pos)
        rows_at.append(pos if pos is not None else torch.arange(size - n, size))
    q = torch.randn(sum(new), hq, d, generator=g)
    batch = native.attention_batch(contexts, new, decode, given)
    before = native.float32_wide()
    try:
        assert native.float32_wide(True)
        wide = native.paged_attention(q, kc, vc, batch, d**-0.5)
        assert not native.float32_wide(False)
        narrow = native.paged_attention(q, kc, vc, batch, d**-0.5)
    finally:
        native.float32_wide(before)
    assert torch.equal(wide, narrow)
    row = 0
    for ctx, n, pos in zip(contexts, new, rows_at):  # and both are right
        ref = attention(q[row : row + n].double(), kc[ctx].double(), vc[ctx].double(), scale=d**-0.5,
                        mask=position_mask(pos, ctx.numel())).float()
        assert (wide[row : row + n] - ref).abs().max().item() < 2e-5
        row += n


def test_one_call_for_a_mixed_step_equals_one_call_per_sequence():
    """Prompts (cold and over a cached prefix) and generated tokens in one call give the same rows,
    bit for bit, as each sequence alone: no row depends on the batch."""
    kc, vc = _arena(8192, 3, 64, seed=10)
    g = torch.Generator().manual_seed(11)
    perm = torch.randperm(8192, generator=g)
    specs = [(0, 130, False), (500, 1, True), (200, 7, False), (63, 1, False), (1, 1, True), (2000, 1, True)]
    contexts, at = [], 0
    for cached, new, _ in specs:
        contexts.append(perm[at : at + cached + new])
        at += cached + new
    q = torch.randn(sum(n for _, n, _ in specs), 9, 64, generator=g)
    batch = native.attention_batch(contexts, [n for _, n, _ in specs], [dec for _, _, dec in specs])
    together = native.paged_attention(q, kc, vc, batch, 0.125)
    row = 0
    for (cached, new, dec), ctx in zip(specs, contexts):
        alone = native.paged_prefill_attention(q[row : row + new], kc, vc, ctx, cached, 0.125, decode=dec)
        assert torch.equal(together[row : row + new], alone)
        row += new


@pytest.mark.parametrize("context", [300, 513, 700, 767, 768, 1000, 1024, 1025, 2100])
def test_a_generated_row_has_the_same_bits_alone_and_in_a_batch(context):
    """Alone, a generated token's keys are split over its KV heads or read whole per chunk,
    depending on its context (whole rows from 3/4 of a chunk per thread); in a batch of eight
    they are read whole. Either way the row is the same bits, and right."""
    kc, vc = _arena(16384, 3, 64, seed=12)
    g = torch.Generator().manual_seed(context)
    perm = torch.randperm(16384, generator=g)
    lengths = [context] + [900] * 7
    contexts = [perm[sum(lengths[:i]) : sum(lengths[: i + 1])] for i in range(8)]
    q = torch.randn(8, 9, 64, generator=g)
    together = native.paged_attention(q, kc, vc, native.attention_batch(contexts, [1] * 8, [True] * 8), 0.125)
    alone = native.paged_prefill_attention(q[:1], kc, vc, contexts[0], context - 1, 0.125, decode=True)
    assert torch.equal(together[:1], alone)
    assert (alone - _reference(q[:1], kc, vc, contexts[0], context - 1)).abs().max().item() < 2e-6






@pytest.mark.parametrize("context,new,hq,hkv,d", [(1, 1, 9, 3, 64), (64, 64, 9, 3, 64), (65, 5, 9, 3, 64), (200, 17, 4, 4, 64),
                                                    (300, 45, 9, 3, 64), (513, 40, 8, 2, 128), (1000, 150, 9, 3, 64),
                                                    (129, 33, 4, 1, 32), (700, 9, 16, 1, 16), (260, 260, 6, 3, 64)])
def test_paged_attention_at_explicit_positions_matches_the_masked_reference(context, new, hq, hkv, d):
    """Rows at scattered positions inside the context (the recomputed tokens of reused chunks,
    rows on both sides of 64-key block boundaries among them) attend to keys ``0 .. position``."""
    kc, vc = _arena(2048, hkv, d, seed=context + new)
    g = torch.Generator().manual_seed(12)
    slots = torch.randperm(2048, generator=g)[:context]
    pos = scattered(context, new, seed=context, must=EDGES + (context - 1,))
    new = pos.numel()  # the block edges inside the context come on top
    q = torch.randn(new, hq + 2 * hkv, d, generator=g)[:, :hq]  # strided rows, as the runner passes them
    batch = native.attention_batch([slots], [new], [False], [pos])
    out = native.paged_attention(q, kc, vc, batch, d**-0.5)
    ref = attention(q.double(), kc[slots].double(), vc[slots].double(), scale=d**-0.5, mask=position_mask(pos, context)).float()
    assert (out - ref).abs().max().item() < 1e-5


def test_a_row_at_an_explicit_position_is_the_ordinary_row_at_that_position():
    """Row independence carries over: a row at position p gives the bits of row p of a cold prefill
    over the same keys, whichever other rows share the call."""
    kc, vc = _arena(2048, 3, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    slots = torch.randperm(2048, generator=g)[:900]
    q = torch.randn(900, 9, 64, generator=g)
    cold = native.paged_prefill_attention(q, kc, vc, slots, 0, 0.125)
    for count, seed in ((1, 1), (37, 2), (300, 3)):
        pos = scattered(900, count, seed, must=(63, 64, 899))
        out = native.paged_attention(q[pos], kc, vc, native.attention_batch([slots], [pos.numel()], [False], [pos]), 0.125)
        assert torch.equal(out, cold[pos]), count


def test_explicit_positions_in_a_mixed_step_equal_each_sequence_alone():
    """A call with sequences at explicit positions next to ordinary prompts and generated tokens
    gives every row the bits it has alone."""
    assert_mixed_step_rows_alone(*_arena(8192, 3, 64, seed=13))


def test_bad_explicit_positions_raise_a_typed_error():
    kc, vc = _arena(64, 3, 64, seed=0)
    q, ctx = torch.randn(3, 9, 64), torch.arange(20)
    for bad in ([5, 3, 9], [2, 2, 9], [-1, 3, 9], [3, 9, 20], [1, 2]):
        with pytest.raises(NativeKernelError):
            native.attention_batch([ctx], [3], [False], [torch.tensor(bad)])
    with pytest.raises(NativeKernelError):  # not int64
        native.attention_batch([ctx], [3], [False], [torch.tensor([1, 2, 3], dtype=torch.int32)])
    with pytest.raises(NativeKernelError):  # a generated token has no explicit position
        native.attention_batch([ctx], [1], [True], [torch.tensor([19])])
    with pytest.raises(NativeKernelError):
        native.attention_batch([ctx], [3], [False], [None, None])
    # the C kernel checks the positions itself: a batch built around attention_batch's checks fails cleanly
    assert_forged_positions_fail_in_the_kernel(q, kc, vc)
    assert native.takes_positions(torch.float32) and native.takes_positions(torch.bfloat16)
    assert not native.takes_positions(torch.float16)


def test_rope_write_matches_apply_rope_and_writes_the_arena():
    n, hq, hkv, d = 37, 9, 3, 64
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=g)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    cos, sin = rope_cos_sin(inv_freq, torch.arange(100, 100 + n), dtype=torch.float32)
    ref = apply_rope(qkv[:, : hq + hkv].clone(), cos, sin)
    kc, vc = torch.zeros(256, hkv, d), torch.zeros(256, hkv, d)
    slots = torch.randperm(256, generator=g)[:n]
    values = qkv[:, hq + hkv :].clone()
    native.rope_write(qkv, hq, hkv, cos, sin, kc, vc, slots)
    assert (qkv[:, : hq + hkv] - ref).abs().max().item() < 1e-5
    assert torch.equal(kc[slots], qkv[:, hq : hq + hkv]) and torch.equal(vc[slots], values)
    untouched = torch.ones(256, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()


def test_add_rms_norm_matches_the_transformers_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(5)
    h = torch.randn(33, 576, generator=g)
    delta = torch.randn(33, 576, generator=g)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.rand(576, generator=g) + 0.5
    expect_h = h + delta
    expect = norm(expect_h)
    got = native.add_rms_norm(h, delta, norm.weight.data, 1e-5)
    assert torch.equal(h, expect_h)  # the residual is updated in place
    assert (got - expect).abs().max().item() < 1e-5
    assert torch.equal(native.add_rms_norm(h.clone(), None, norm.weight.data, 1e-5), got)


def test_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(9, 2 * 1536, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expect = F.silu(gate) * up
    assert (native.silu_mul(gate_up) - expect).abs().max().item() < 1e-5 * expect.abs().max().item()


@pytest.mark.parametrize("n,k,bias", [(576, 576, False), (960, 576, True), (1, 1536, False), (7, 8, True), (49152, 64, False)])
def test_linear_rows_matches_f_linear_and_rows_do_not_depend_on_the_batch(n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(16, k, generator=g)
    full = native.linear_rows(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert (full - ref).abs().max().item() < 1e-5 * max(1.0, k**0.5)
    for m in (1, 2, 3, 4, 5, 13):
        assert torch.equal(native.linear_rows(x[:m], w, b), full[:m]), m
        assert torch.equal(native.linear_rows(x[m:], w, b), full[m:]), m


def test_linear_layers_take_the_rows_kernel_for_few_rows_only():
    from ragcache_backend.model.kernels.linear import pack_linear

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 64, generator=g), torch.randn(100, 64, generator=g)
    lin = pack_linear(w)
    assert lin.rows_kernel and lin.rows_max == native.LINEAR_PROMPT_ROWS_F32 == 64
    assert torch.equal(lin(x[:4]), native.linear_rows(x[:4], w))
    assert torch.equal(lin(x[:64]), native.linear_rows(x[:64], w))  # up to 64 rows: one call of the kernel
    many = lin(x)
    if lin.packed is not None:  # more rows: oneDNN's GEMM
        assert torch.equal(many, lin.gemm(x))
    assert (many - F.linear(x, w)).abs().max().item() < 1e-5
    assert not pack_linear(torch.randn(96, 60)).rows_kernel  # K not a multiple of 8
    assert not native.linear_rows_available(torch.randn(96, 0))  # no inputs: nothing to tile


def test_a_mixed_steps_layer_gemm_reads_its_weight_once_where_its_prompt_rows_come_first(monkeypatch):
    """A step's generated tokens' rows keep the few-row kernel's bits in any company; with the prompt
    rows first, up to 64 of them share one kernel call with such rows (up to 80 rows in all; the same bits
    as apart), and more
    run in one oneDNN GEMM over every row whose generated tokens' rows are then overwritten."""
    from ragcache_backend.model.kernels.linear import StepRowClasses, pack_linear, step_rows

    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 64, generator=g), torch.randn(108, 64, generator=g)
    lin = pack_linear(w)
    assert lin.rows_kernel and lin.decode_rows
    calls: list[int] = []
    real = native.linear_rows
    monkeypatch.setattr(native, "linear_rows", lambda a, *args: calls.append(a.shape[0]) or real(a, *args))
    for prompt in (0, 1, 40, 60, 64, 100):
        rows = x[: prompt + 8]
        calls.clear()
        with step_rows(StepRowClasses.of([prompt] * bool(prompt) + [1] * 8, [False] * bool(prompt) + [True] * 8)):
            mixed = lin(rows)
        assert torch.equal(mixed[prompt:], real(rows[prompt:], w))  # generated tokens: the kernel's bits
        if prompt <= 64:  # one pass over the weight for every row (up to 64 + 16 rows a call)
            assert calls == [prompt + 8] and (not prompt or torch.equal(mixed[:prompt], real(rows[:prompt], w)))
        else:  # one oneDNN call over all 108 rows, then the 8 generated tokens' rows overwritten
            assert calls == [8]
            if lin.packed is not None:
                assert torch.equal(mixed[:prompt], lin.gemm(rows)[:prompt])
            assert (mixed[:prompt] - F.linear(rows[:prompt], w)).abs().max().item() < 1e-5
    calls.clear()
    with step_rows(StepRowClasses.of([60] + [1] * 30, [False] + [True] * 30)):  # more than 16 such rows: 64-row calls
        wide = lin(x[:90])
    assert calls == [64, 26] and torch.equal(wide, real(x[:90], w))
    calls.clear()
    with step_rows(StepRowClasses.of([1] * 8 + [100], [True] * 8 + [False])):  # prompt rows not first
        apart = lin(torch.cat((x[100:108], x[:100])))
    assert calls == [8] and torch.equal(apart[:8], real(x[100:108], w))


def test_bad_arguments_raise_a_typed_error():
    kc, vc = _arena(64, 3, 64, seed=0)
    q = torch.randn(4, 9, 64)
    with pytest.raises(NativeKernelError):
        native.paged_prefill_attention(q.double(), kc, vc, torch.arange(4), 0, 0.125)  # no float64 kernel
    with pytest.raises(NativeKernelError):
        native.paged_prefill_attention(q, kc.bfloat16(), vc.bfloat16(), torch.arange(4), 0, 0.125)  # dtypes differ
    with pytest.raises(NativeKernelError):
        native.paged_prefill_attention(q, kc, vc, torch.arange(5), 0, 0.125)  # slots != cached + new
    with pytest.raises(NativeKernelError):
        native.silu_mul(torch.randn(2, 24))  # 2I not a multiple of 16
    with pytest.raises(NativeKernelError):
        native.add_rms_norm(torch.randn(2, 64), None, torch.ones(32), 1e-5)
    with pytest.raises(NativeKernelError):
        native.linear_rows(torch.randn(2, 64), torch.randn(8, 32))  # K differs
    assert "float16" in native.unavailable_reason(torch.float16, "cpu", 64)
    assert "head size" in native.unavailable_reason(torch.float32, "cpu", 72)


@pytest.fixture(scope="module")
def tiny_llama():
    """A random 2-layer Llama with head size 64 and GQA, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ragcache_backend.model.loader import LoadedModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=3,
                      num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    return LoadedModel(model=model, tokenizer=None, name="tiny-f32-64", fingerprint="tiny-f32-64", dtype=torch.float32,
                       device=torch.device("cpu"), context_window=2048)


def test_runner_native_path_matches_transformers_across_the_cache(tiny_llama):
    from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner

    runner = ModelRunner(copy.deepcopy(tiny_llama), num_device_blocks=64, block_size=16)
    assert runner.native_attention and runner.native_fused and runner.kernel_tag == "native-fused"
    g = torch.Generator().manual_seed(8)
    toks = tuple(torch.randint(0, 512, (300,), generator=g).tolist())
    cold = runner.forward([ForwardInput(toks, (), (KVRun(tuple(range(19)), 0, 300),))], all_logits=True)[0]
    # the same prompt with its first 200 tokens from the cache (computed in another call, other blocks)
    runner.forward([ForwardInput(toks[:200], (), (KVRun(tuple(range(20, 33)), 0, 200),))])
    warm = runner.forward([ForwardInput(toks[200:], (KVRun(tuple(range(20, 33)), 0, 200),),
                                        (KVRun(tuple(range(40, 47)), 0, 100),))], all_logits=True)[0]
    with torch.inference_mode():
        ref = tiny_llama.model(torch.tensor([toks])).logits[0]
    assert (cold - ref).abs().max().item() < 1e-4
    assert (warm - cold[200:]).abs().max().item() < 1e-5
    # decode steps (the decode kernel) against transformers' forward over the growing sequence
    seq, blocks = list(toks), tuple(range(19)) + (19, 50, 51)
    for _ in range(3):
        nxt = int(torch.argmax(ref[-1]))
        got = runner.forward([ForwardInput((nxt,), (KVRun(blocks, 0, len(seq)),), (KVRun(blocks, len(seq), 1),), decode=True)])[0]
        seq.append(nxt)
        with torch.inference_mode():
            ref = tiny_llama.model(torch.tensor([seq])).logits[0]
        assert (got - ref[-1]).abs().max().item() < 1e-4


def test_a_decode_step_in_one_native_call_equals_the_per_operation_kernels(tiny_llama):
    """Decode-only steps run every layer in one call (rc32_decode_step): the same bits as the
    per-operation kernels, logits and KV written, for one and several sequences of any length."""
    from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner

    whole = ModelRunner(copy.deepcopy(tiny_llama), num_device_blocks=240, block_size=16)
    per_op = ModelRunner(copy.deepcopy(tiny_llama), num_device_blocks=240, block_size=16)
    assert whole.layers.whole_step_decode
    per_op.layers.whole_step_decode = False
    assert not per_op.layers.whole_step_decode
    g = torch.Generator().manual_seed(12)
    lengths = (5, 600, 1100)  # one over two decode chunks of 512 keys
    seqs = [tuple(torch.randint(0, 512, (n,), generator=g).tolist()) for n in lengths]
    blocks = [tuple(range(i * 80, i * 80 + 80)) for i in range(len(seqs))]
    for runner in (whole, per_op):
        for toks, b in zip(seqs, blocks):
            runner.forward([ForwardInput(toks, (), (KVRun(b, 0, len(toks)),))])
    for batch in ([0], [0, 1, 2], [2, 1]):
        nxt = {i: int(torch.randint(0, 512, (1,), generator=g)) for i in batch}
        outs = []
        for runner in (whole, per_op):
            items = [ForwardInput((nxt[i],), (KVRun(blocks[i], 0, len(seqs[i])),), (KVRun(blocks[i], len(seqs[i]), 1),),
                                  decode=True) for i in batch]
            outs.append(runner.forward(items))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        for i in batch:
            seqs[i] += (nxt[i],)
    assert torch.equal(whole.arena.k_cache, per_op.arena.k_cache) and torch.equal(whole.arena.v_cache, per_op.arena.v_cache)


def test_a_cache_hits_one_new_token_runs_as_a_generated_tokens_row(tiny_llama, monkeypatch):
    """A prompt's one new token over a cached context (a full cache hit's last token) takes the
    generated tokens' kernels: beside a decode the step is one whole-step decode call, and its logits
    and K/V are the same bits whatever shares its step (alone, beside a decode, beside a long prompt
    chunk, per-operation kernels), and agree with the cold prompt's last row within float32 rounding."""
    from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner

    runner = ModelRunner(copy.deepcopy(tiny_llama), num_device_blocks=240, block_size=16)
    calls = []
    one_call = native.decode_step
    monkeypatch.setattr(native, "decode_step", lambda *a, **k: (calls.append(1), one_call(*a, **k))[1])
    g = torch.Generator().manual_seed(31)
    hit, other, long = (tuple(torch.randint(0, 512, (n,), generator=g).tolist()) for n in (600, 300, 90))
    bh, bo, bl = (tuple(range(i * 80, i * 80 + 80)) for i in range(3))
    cold = runner.forward([ForwardInput(hit, (), (KVRun(bh, 0, 600),))])[0]
    runner.forward([ForwardInput(other, (), (KVRun(bo, 0, 300),))])
    slot = runner.slots((KVRun(bh, 599, 1),))
    cold_kv = torch.cat((runner.arena.k_cache[:, slot], runner.arena.v_cache[:, slot]))

    def last(decode: bool = False) -> ForwardInput:
        return ForwardInput(hit[-1:], (KVRun(bh, 0, 599),), (KVRun(bh, 599, 1),), decode=decode)

    def step(items: list[ForwardInput]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = runner.forward(items)[0]
        return logits, torch.cat((runner.arena.k_cache[:, slot], runner.arena.v_cache[:, slot]))

    beside = ForwardInput((7,), (KVRun(bo, 0, 300),), (KVRun(bo, 300, 1),), decode=True)
    n0 = len(calls)
    alone = step([last()])
    with_decode = step([last(), beside])
    assert len(calls) == n0 + 2  # both steps: one whole-step decode call
    with_chunk = step([last(), ForwardInput(long, (), (KVRun(bl, 0, 90),))])  # 91 rows: the per-operation path
    assert len(calls) == n0 + 2
    as_decode = step([last(decode=True)])
    for got in (with_decode, with_chunk, as_decode):
        assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])
    runner.layers.whole_step_decode = False
    assert all(torch.equal(a, b) for a, b in zip(step([last(), beside]), alone))
    assert (alone[0] - cold).abs().max().item() < 1e-4 and int(alone[0].argmax()) == int(cold.argmax())
    assert (alone[1] - cold_kv).abs().max().item() < 1e-4


@pytest.mark.skipif(not _WIDE, reason="this CPU has no AVX-512F: the kernels run on 256-bit registers only")
def test_the_model_gives_the_same_bits_on_512_and_256_bit_registers(tiny_llama):
    """A prefill, a prefill over a cached prefix and decode steps (whole-step calls) give the same
    logits and KV, bit for bit, with the 512-bit inner loops and without them."""
    from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner

    g = torch.Generator().manual_seed(21)
    prompts = [tuple(torch.randint(0, 512, (n,), generator=g).tolist()) for n in (700, 90)]
    extra = tuple(torch.randint(0, 512, (40,), generator=g).tolist())
    nxt = [tuple(torch.randint(0, 512, (2,), generator=g).tolist()) for _ in prompts]
    blocks = [tuple(range(i * 80, i * 80 + 80)) for i in range(len(prompts))]
    results, before = [], native.float32_wide()
    try:
        for wide in (True, False):
            assert native.float32_wide(wide) == wide
            runner = ModelRunner(copy.deepcopy(tiny_llama), num_device_blocks=200, block_size=16)
            outs = [runner.forward([ForwardInput(p, (), (KVRun(b, 0, len(p)),)) for p, b in zip(prompts, blocks)])]
            outs.append(runner.forward([ForwardInput(extra, (KVRun(blocks[0], 0, 700),), (KVRun(blocks[0], 700, 40),))]))
            lengths = [740, 90]
            for step in range(2):
                items = [ForwardInput((nxt[i][step],), (KVRun(blocks[i], 0, lengths[i]),), (KVRun(blocks[i], lengths[i], 1),),
                                      decode=True) for i in range(2)]
                outs.append(runner.forward(items))
                lengths = [n + 1 for n in lengths]
            results.append((outs, runner.arena.k_cache.clone(), runner.arena.v_cache.clone()))
    finally:
        native.float32_wide(before)
    (wide_outs, wk, wv), (narrow_outs, nk, nv) = results
    for a, b in zip(wide_outs, narrow_outs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert torch.equal(wk, nk) and torch.equal(wv, nv)


def test_the_last_layer_runs_for_the_logit_rows_only_and_changes_no_kv(tiny_llama):
    """float32 fused path: the last layer's attention and MLP run for each sequence's last row only
    (``last_layer_pruning``, on by default). The K/V written is the same bits as without it, the
    logits agree within float32 rounding with the same argmax, a cached prompt's logits equal its
    cold ones, and ``all_logits`` still gives every row."""
    from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner

    pruned = ModelRunner(copy.deepcopy(tiny_llama), num_device_blocks=200, block_size=16)
    whole = ModelRunner(copy.deepcopy(tiny_llama), num_device_blocks=200, block_size=16)
    assert pruned.layers.last_layer_pruning
    whole.layers.last_layer_pruning = False
    g = torch.Generator().manual_seed(21)
    a, b, c = (tuple(torch.randint(0, 512, (n,), generator=g).tolist()) for n in (300, 70, 600))
    outs = []
    for runner in (pruned, whole):
        runner.forward([ForwardInput(c, (), (KVRun(tuple(range(100, 138)), 0, 600),))])  # a context to decode on
        step = [ForwardInput(a, (), (KVRun(tuple(range(19)), 0, 300),)),  # a cold prompt
                ForwardInput(b[40:], (KVRun(tuple(range(20, 25)), 0, 40),), (KVRun(tuple(range(20, 25)), 40, 30),)),
                ForwardInput((7,), (KVRun(tuple(range(100, 138)), 0, 600),), (KVRun(tuple(range(100, 138)), 600, 1),),
                             decode=True)]
        runner.forward([ForwardInput(b[:40], (), (KVRun(tuple(range(20, 25)), 0, 40),))])
        outs.append(runner.forward(step))
    for x, y in zip(*outs):
        assert x.shape == y.shape == (512,)
        assert (x - y).abs().max().item() < 1e-4 and int(x.argmax()) == int(y.argmax())
    assert torch.equal(pruned.arena.k_cache, whole.arena.k_cache) and torch.equal(pruned.arena.v_cache, whole.arena.v_cache)
    # the same prompt with its first 250 tokens cached: the same logits as cold (both pruned)
    warm = pruned.forward([ForwardInput(a[250:], (KVRun(tuple(range(19)), 0, 250),), (KVRun(tuple(range(40, 44)), 0, 50),))])[0]
    assert (warm - outs[0][0]).abs().max().item() < 1e-5
    every = pruned.forward([ForwardInput(a[:64], (), (KVRun(tuple(range(60, 64)), 0, 64),))], all_logits=True)[0]
    assert every.shape == (64, 512)
    assert (every[-1] - whole.forward([ForwardInput(a[:64], (), (KVRun(tuple(range(60, 64)), 0, 64),))])[0]).abs().max() < 1e-4


def test_the_torch_path_is_kept_when_the_kernels_are_off(tiny_llama, monkeypatch):
    from ragcache_backend.model.runner import ModelRunner

    monkeypatch.setattr(native, "unavailable_reason", lambda *a, **k: "RAGCACHE_NATIVE_KERNELS=0")
    runner = ModelRunner(copy.deepcopy(tiny_llama), num_device_blocks=8, block_size=16)
    assert runner.kernel_tag == "torch" and not runner.native_attention


def _fresh_library_state(monkeypatch):
    """The library module as before its first build (restored after the test)."""
    for name, value in (("_lib", None), ("_tried", False), ("_why_not", ""), ("_KERNEL_DTYPES", {})):
        monkeypatch.setattr(library, name, value)


def test_a_missing_compiler_is_one_warning_and_the_torch_path(monkeypatch, caplog):
    _fresh_library_state(monkeypatch)
    monkeypatch.setattr(library, "_compiler", lambda: None)
    with caplog.at_level("INFO", logger=library.log.name):
        reasons = [native.unavailable_reason(torch.float32, "cpu", 64, 3) for _ in range(3)]
    assert reasons == ["no C compiler found (set CC, or install gcc)"] * 3
    warnings = [r for r in caplog.records if r.name == library.log.name]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING" and "torch path" in warnings[0].message
    assert native.instruction_set(torch.float32) is None


def test_a_cpu_without_avx2_takes_the_torch_path_with_one_warning(monkeypatch, caplog, tmp_path):
    """The library builds, but its CPU checks say no: the same one warning and the torch path."""
    _fresh_library_state(monkeypatch)
    real_cdll = library.ctypes.CDLL

    def cdll_on_an_old_cpu(path):
        lib = real_cdll(path)
        lib.rc_supported = lambda: 0
        lib.rc32_supported = lambda: 0
        return lib

    monkeypatch.setattr(library.ctypes, "CDLL", cdll_on_an_old_cpu)
    with caplog.at_level("INFO", logger=library.log.name):
        reason = native.unavailable_reason(torch.float32, "cpu", 64, 3)
        assert native.unavailable_reason(torch.bfloat16, "cpu", 64, 3) == reason
    assert reason is not None and "neither AVX2+FMA" in reason
    warnings = [r for r in caplog.records if r.name == library.log.name]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"


def test_a_library_built_from_another_folder_runs_the_kernels_in_a_block_only(tmp_path, caplog):
    # benchmarks/kernel_ab.py compares kernel versions this way: the same sources give the same bits,
    # a block runs the kernels from its library, the package's comes back after it
    import shutil

    for p in (*native.SOURCES, *native.HEADERS):
        shutil.copy(p, tmp_path / p.name)
    lib = native.build_library(tmp_path)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.randn(12, 64, generator=g)
    want = native.linear_rows(x, w)
    with native.using_library(lib):
        assert torch.equal(native.linear_rows(x, w), want)

    class NoKernels:  # a "library" without a single function: any kernel call inside fails
        def __getattr__(self, name):
            raise AttributeError(name)

    with pytest.raises(AttributeError), native.using_library(NoKernels()):
        native.linear_rows(x, w)
    assert torch.equal(native.linear_rows(x, w), want)  # restored, after an error too
    # an older revision's folder lacks the sources added since (NEWER_SOURCES): it builds without them
    for name in library.NEWER_SOURCES:
        (tmp_path / name).unlink()
    older = native.build_library(tmp_path)
    assert not hasattr(older, "rc_amx_linear")
    with native.using_library(older):
        assert torch.equal(native.linear_rows(x, w), want)
        assert not native.amx_linear_available(torch.zeros(64, 64, dtype=torch.bfloat16))
    (tmp_path / "kernels_f32.c").unlink()
    with pytest.raises(OSError):
        native.build_library(tmp_path)
    (tmp_path / "kernels_f32.c").write_text("this is not C\n")
    with caplog.at_level("INFO", logger=library.log.name), pytest.raises(native.NativeKernelError, match="build with"):
        native.build_library(tmp_path)
    # the error says why; the package's "using the torch path" warning is not logged (it still runs its own)
    assert not [r for r in caplog.records if r.name == library.log.name]
    assert native.instruction_set(torch.float32) is not None
