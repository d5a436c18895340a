"""The native bf16 CPU kernels against the torch reference, and the exactness they exist for."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ragcache_backend.model.kernels import apply_rope, attention, native, position_mask, prefix_causal_mask, rope_cos_sin
from ragcache_backend.model.kernels.native import NativeKernelError
from tests.model.explicit_positions import (EDGES, assert_forged_positions_fail_in_the_kernel,
                                            assert_mixed_step_rows_alone, scattered)

pytestmark = pytest.mark.skipif(not native.available(torch.bfloat16, "cpu", 64),
                                reason="native kernels need a C compiler and a CPU with AVX512-BF16")


_AMX = native.available(torch.bfloat16, "cpu", 64) and native.bf16_amx()  # a CPU without the library: no call at import


def _arena(slots: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, hkv, d, generator=g).bfloat16(), torch.randn(slots, hkv, d, generator=g).bfloat16()


@pytest.mark.parametrize("cached,new,hq,hkv,d", [(0, 1, 9, 3, 64), (0, 70, 9, 3, 64), (5, 3, 4, 4, 64), (130, 64, 8, 2, 128),
                                                   (63, 1, 9, 3, 64), (64, 65, 6, 3, 64), (300, 300, 9, 3, 64)])
def test_paged_attention_matches_the_reference(cached, new, hq, hkv, d):
    kc, vc = _arena(1024, hkv, d, seed=cached + new)
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(1024, generator=g)[: cached + new]
    qkv = torch.randn(new, hq + 2 * hkv, d, generator=g).bfloat16()
    q = qkv[:, :hq]  # strided rows, as the runner passes them
    out = native.paged_prefill_attention(q, kc, vc, slots, cached, d**-0.5)
    ref = attention(q.float(), kc[slots].float(), vc[slots].float(), scale=d**-0.5, mask=prefix_causal_mask(new, cached + new))
    assert out.shape == (new, hq, d) and out.dtype == torch.bfloat16
    # bf16 probabilities in PV, as FlashAttention: about the error of PyTorch's own bf16 kernel
    assert (out.float() - ref).abs().max().item() < 2e-2
    torch_bf16 = attention(q, kc[slots], vc[slots], scale=d**-0.5, mask=prefix_causal_mask(new, cached + new))
    assert (out.float() - ref).abs().mean() <= 1.5 * (torch_bf16.float() - ref).abs().mean() + 1e-4


def test_paged_attention_rows_do_not_depend_on_the_other_rows():
    """The cache-exactness property: row t is bit-identical whether 0, 1, 17, 64 or 999 of the
    rows before it came from the cache, and whether later rows run in the same call."""
    kc, vc = _arena(2048, 3, 64, seed=1)
    g = torch.Generator().manual_seed(2)
    slots = torch.randperm(2048, generator=g)[:1000]
    q = torch.randn(1000, 9, 64, generator=g).bfloat16()
    cold = native.paged_prefill_attention(q, kc, vc, slots, 0, 0.125)
    for cached in (1, 17, 64, 500, 999):
        warm = native.paged_prefill_attention(q[cached:], kc, vc, slots, cached, 0.125)
        assert torch.equal(warm, cold[cached:]), cached
    head = native.paged_prefill_attention(q[:300], kc, vc, slots[:300], 0, 0.125)
    assert torch.equal(head, cold[:300])


@pytest.mark.skipif(not _AMX, reason="AMX prompt attention needs a CPU with AMX-BF16 (and Linux's tile state)")
@pytest.mark.parametrize("cached,new,hq,hkv,d", [(0, 1, 9, 3, 64), (0, 70, 9, 3, 64), (63, 1, 9, 3, 64), (64, 65, 6, 3, 64),
                                                   (130, 64, 8, 2, 128), (10, 40, 8, 1, 256), (300, 300, 9, 3, 64)])
def test_prompt_attention_on_amx_tiles_matches_the_reference_and_the_avx512_kernel(cached, new, hq, hkv, d):
    """Where the CPU has AMX both prompt kernels run: each as close to the float32 reference as
    PyTorch's own bf16 attention, the two within a bf16 rounding of each other, each keeping every
    row's bits whatever came from the cache."""
    kc, vc = _arena(1024, hkv, d, seed=cached + new + 1)
    g = torch.Generator().manual_seed(11)
    slots = torch.randperm(1024, generator=g)[: cached + new]
    q = torch.randn(new, hq + 2 * hkv, d, generator=g).bfloat16()[:, :hq]
    ref = attention(q.float(), kc[slots].float(), vc[slots].float(), scale=d**-0.5, mask=prefix_causal_mask(new, cached + new))
    torch_err = (attention(q, kc[slots], vc[slots], scale=d**-0.5, mask=prefix_causal_mask(new, cached + new)).float() - ref).abs()
    out, before = {}, native.bf16_amx()
    try:
        for amx in (True, False):
            assert native.bf16_amx(amx) == amx
            out[amx] = native.paged_prefill_attention(q, kc, vc, slots, cached, d**-0.5)
            err = (out[amx].float() - ref).abs()
            assert err.max().item() < 2e-2 and err.mean() <= 1.5 * torch_err.mean() + 1e-4, amx
            for more in {1, new // 2, new - 1} - {0, new}:  # rows 0 .. more - 1 cached too: the rest the same bits
                warm = native.paged_prefill_attention(q[more:], kc, vc, slots, cached + more, d**-0.5)
                assert torch.equal(warm, out[amx][more:]), (amx, more)
    finally:
        native.bf16_amx(before)
    a, b = out[True].float(), out[False].float()
    # within a bf16 rounding of the terms each output sums (sum_k p_k |v_k|, not the output itself,
    # which may be a cancellation of larger terms): the kernels round different probabilities to
    # bf16 (another exponential: the AMX item's exp2_neg) and sum in another order
    terms = attention(q.float(), kc[slots].float(), vc[slots].float().abs(), scale=d**-0.5, mask=prefix_causal_mask(new, cached + new))
    assert bool(((a - b).abs() <= terms * 2**-7 + 1e-3).all())


@pytest.mark.skipif(not _AMX, reason="AMX prompt attention needs a CPU with AMX-BF16 (and Linux's tile state)")
def test_ragcache_amx_0_keeps_prompt_attention_on_avx512_bf16():
    code = "import torch; from ragcache_backend.model.kernels import native; print(native.bf16_amx(), native.instruction_set(torch.bfloat16))"
    for env, expect in (("0", "False AVX512-BF16"), ("1", "True AVX512-BF16, prompt attention and layer GEMMs on AMX")):
        run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RAGCACHE_AMX": env}, capture_output=True, text=True,
                             timeout=120, check=True)
        assert run.stdout.strip() == expect, run.stderr[-2000:]


@pytest.mark.parametrize("context,hq,hkv,d", [(1, 9, 3, 64), (15, 9, 3, 64), (16, 9, 3, 64), (1000, 9, 3, 64), (77, 8, 1, 128),
                                               # every group size 1..8 (each has its own inlined loop), key counts
                                               # around the four-key tiles, head sizes up to 256
                                               (5, 2, 2, 64), (6, 4, 2, 192), (7, 4, 1, 64), (9, 10, 2, 256),
                                               (2, 12, 2, 64), (3, 14, 2, 128), (513, 16, 2, 64),
                                               # key chunks of DECODE_CHUNK (256): one exactly, one past, many
                                               (256, 9, 3, 64), (257, 9, 3, 64), (2000, 9, 3, 64)])
def test_decode_kernel_matches_the_reference(context, hq, hkv, d):
    kc, vc = _arena(2048, hkv, d, seed=context)
    g = torch.Generator().manual_seed(9)
    slots = torch.randperm(2048, generator=g)[:context]
    q = torch.randn(1, hq, d, generator=g).bfloat16()
    out = native.paged_prefill_attention(q, kc, vc, slots, context - 1, d**-0.5, decode=True)
    ref = attention(q.float(), kc[slots].float(), vc[slots].float(), scale=d**-0.5)
    assert (out.float() - ref).abs().max().item() < 1e-2  # float32 probabilities: tighter than the prompt kernel


def test_a_generated_token_is_the_same_bits_alone_in_a_batch_and_on_any_thread_count():
    """A generated token's attention is split in key chunks fixed by position and merged in order: its
    bits depend on its context only, not on the other sequences, their contexts or the threads."""
    kc, vc = _arena(8192, 3, 64, seed=12)
    g = torch.Generator().manual_seed(13)
    perm = torch.randperm(8192, generator=g)
    lengths = [1, 256, 300, 1025, 4000]
    contexts = [perm[sum(lengths[:i]) : sum(lengths[: i + 1])] for i in range(len(lengths))]
    q = torch.randn(len(lengths), 9, 64, generator=g).bfloat16()
    batch = native.attention_batch(contexts, [1] * len(lengths), [True] * len(lengths))
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(native.paged_attention(q, kc, vc, batch, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    for i, ctx in enumerate(contexts):
        alone = native.paged_prefill_attention(q[i : i + 1], kc, vc, ctx, ctx.numel() - 1, 0.125, decode=True)
        assert torch.equal(alone, runs[0][i : i + 1]), lengths[i]
        ref = attention(q[i : i + 1].float(), kc[ctx].float(), vc[ctx].float(), scale=0.125)
        assert (alone.float() - ref).abs().max().item() < 1e-2, lengths[i]


def test_one_call_for_a_mixed_step_equals_one_call_per_sequence():
    """Prompts (cold and over a cached prefix) and generated tokens in one call give the same rows
    as each sequence alone."""
    kc, vc = _arena(4096, 3, 64, seed=10)
    g = torch.Generator().manual_seed(11)
    perm = torch.randperm(4096, generator=g)
    specs = [(0, 130, False), (500, 1, True), (200, 7, False), (63, 1, False), (1, 1, True)]  # (cached, new, decode)
    contexts, at = [], 0
    for cached, new, _ in specs:
        contexts.append(perm[at : at + cached + new])
        at += cached + new
    q = torch.randn(sum(n for _, n, _ in specs), 9, 64, generator=g).bfloat16()
    batch = native.attention_batch(contexts, [n for _, n, _ in specs], [dec for _, _, dec in specs])
    together = native.paged_attention(q, kc, vc, batch, 0.125)
    row = 0
    for (cached, new, dec), ctx in zip(specs, contexts):
        alone = native.paged_prefill_attention(q[row : row + new], kc, vc, ctx, cached, 0.125, decode=dec)
        assert torch.equal(together[row : row + new], alone)
        row += new
    with pytest.raises(NativeKernelError):
        native.attention_batch(contexts[:1], [2], [True])  # a generated token comes one at a time




_KERNELS = (True, False) if _AMX else (False,)  # prompt attention on AMX tiles, on AVX512-BF16


@pytest.fixture(params=_KERNELS, ids=lambda amx: "amx" if amx else "avx512bf16")
def prompt_kernel(request):
    """Each prompt kernel this CPU runs, switched on for the test (and back after)."""
    before = native.bf16_amx()
    assert native.bf16_amx(request.param) == request.param
    yield request.param
    native.bf16_amx(before)


@pytest.mark.parametrize("context,new,hq,hkv,d", [(1, 1, 9, 3, 64), (64, 64, 9, 3, 64), (65, 5, 9, 3, 64), (200, 17, 4, 4, 64),
                                                    (300, 45, 9, 3, 64), (513, 40, 8, 2, 128), (1000, 150, 9, 3, 64),
                                                    (260, 260, 6, 3, 64), (90, 20, 8, 1, 256)])
def test_paged_attention_at_explicit_positions_matches_the_masked_reference(context, new, hq, hkv, d, prompt_kernel):
    """Rows at scattered positions inside the context (the recomputed tokens of reused chunks; rows
    on both sides of 64-key blocks and 16-row items among them) attend to keys ``0 .. position``,
    as close to the float32 reference as PyTorch's own bf16 attention."""
    kc, vc = _arena(2048, hkv, d, seed=context + new)
    g = torch.Generator().manual_seed(12)
    slots = torch.randperm(2048, generator=g)[:context]
    pos = scattered(context, new, seed=context, must=EDGES + (context - 1,))
    new = pos.numel()  # the block edges inside the context come on top
    q = torch.randn(new, hq + 2 * hkv, d, generator=g).bfloat16()[:, :hq]  # strided rows, as the runner passes them
    out = native.paged_attention(q, kc, vc, native.attention_batch([slots], [new], [False], [pos]), d**-0.5)
    mask = position_mask(pos, context)
    ref = attention(q.float(), kc[slots].float(), vc[slots].float(), scale=d**-0.5, mask=mask)
    torch_err = (attention(q, kc[slots], vc[slots], scale=d**-0.5, mask=mask).float() - ref).abs()
    err = (out.float() - ref).abs()
    assert out.dtype == torch.bfloat16 and err.max().item() < 2e-2
    assert err.mean() <= 1.5 * torch_err.mean() + 1e-4


def test_a_row_at_an_explicit_position_is_the_ordinary_row_at_that_position(prompt_kernel):
    """Row independence carries over: a row at position p gives the bits of row p of a cold prefill
    over the same keys, whichever other rows share the call (what makes a recomputed token on the
    kernel the token a full prefill computes, given the same keys)."""
    kc, vc = _arena(2048, 3, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    slots = torch.randperm(2048, generator=g)[:900]
    q = torch.randn(900, 9, 64, generator=g).bfloat16()
    cold = native.paged_prefill_attention(q, kc, vc, slots, 0, 0.125)
    for count, seed in ((1, 1), (16, 5), (37, 2), (300, 3)):
        pos = scattered(900, count, seed, must=(15, 16, 63, 64, 899))
        out = native.paged_attention(q[pos], kc, vc, native.attention_batch([slots], [pos.numel()], [False], [pos]), 0.125)
        assert torch.equal(out, cold[pos]), count


def test_explicit_positions_in_a_mixed_step_equal_each_sequence_alone(prompt_kernel):
    """A call with sequences at explicit positions next to ordinary prompts and generated tokens
    gives every row the bits it has alone."""
    assert_mixed_step_rows_alone(*_arena(8192, 3, 64, seed=13))


def test_explicit_positions_the_kernel_is_handed_are_checked_by_the_kernel():
    """A batch built around :func:`attention_batch`'s checks fails cleanly in the C kernel (code 1),
    never reads outside the context."""
    assert_forged_positions_fail_in_the_kernel(torch.randn(3, 9, 64).bfloat16(), *_arena(64, 3, 64, seed=0))


@pytest.mark.skipif(not _AMX, reason="our AMX GEMM needs a CPU with AMX-BF16 (and Linux's tile state)")
@pytest.mark.parametrize("n,k,bias", [(32, 32, False), (960, 576, True), (3072, 576, False), (576, 1536, False), (96, 64, True)])
def test_amx_linear_rows_are_their_own_whatever_the_call(n, k, bias):
    """Our AMX GEMM: float32 sums of exact bf16 products, the bias, one bf16 rounding (as close to
    the float32 product as oneDNN's bf16 GEMM); a row's bits the same in a call of any row count
    (1, 31, 33, 128, 300), beside any rows, from a strided input; the LM-head-like bias in float32."""
    from ragcache_backend.model.kernels.linear import pack_linear

    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    aw = native.amx_pack(w, b)
    x = torch.randn(300, 2 * k, generator=g).bfloat16()[:, :k]  # strided rows
    y = native.amx_linear(x, aw)
    ref = x.float() @ w.float().t() + (b.float() if bias else 0)
    onednn = pack_linear(w, b, per_step=False).gemm(x.contiguous()).float()
    err, err_onednn = (y.float() - ref).abs(), (onednn - ref).abs()
    assert y.shape == (300, n) and y.dtype == torch.bfloat16
    assert err.max().item() <= 1.01 * err_onednn.max().item() + 1e-6 and err.mean() <= 1.1 * err_onednn.mean() + 1e-6
    for a, z in ((0, 1), (5, 36), (40, 73), (100, 228), (299, 300), (0, 300)):
        assert torch.equal(native.amx_linear(x[a:z].contiguous(), aw), y[a:z]), (a, z)


@pytest.mark.skipif(not _AMX, reason="our AMX GEMM needs a CPU with AMX-BF16 (and Linux's tile state)")
@pytest.mark.parametrize("i,k,bias", [(1536, 576, False), (48, 64, True), (16, 32, False)])
def test_amx_linear_silu_is_silu_mul_over_the_gemm_bit_for_bit(i, k, bias):
    """The gated AMX GEMM (SiLU(gate) * up without writing the [M, 2 I] product) gives the bits of
    :func:`native.silu_mul` over :func:`native.amx_linear`'s product, for every row count (a partial
    32-row block, one row, several work items), a strided input, a bias (gate's and up's apart), and
    through :meth:`Linear.silu_gated` in a step's rows or outside one; close to the float32 reference."""
    from ragcache_backend.model.kernels.linear import StepRowClasses, pack_linear, step_rows

    g = torch.Generator().manual_seed(i + k)
    w = (torch.randn(2 * i, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(2 * i, generator=g).bfloat16() if bias else None
    aw = native.amx_pack(w, b)
    x = torch.randn(300, 2 * k, generator=g).bfloat16()[:, :k]  # strided rows
    for a, z in ((0, 300), (0, 1), (7, 40), (100, 228)):
        got = native.amx_linear_silu(x[a:z], aw)
        assert got.shape == (z - a, i) and got.dtype == torch.bfloat16
        assert torch.equal(got, native.silu_mul(native.amx_linear(x[a:z], aw))), (a, z)
    gu = x.float() @ w.float().t() + (b.float() if bias else 0)
    ref = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    assert ((native.amx_linear_silu(x, aw).float() - ref).abs() <= 0.03 * ref.abs() + 0.02).all()
    lin = pack_linear(w, b)
    assert lin.amx is not None
    with step_rows(StepRowClasses.of([300], [False])):
        assert torch.equal(lin.silu_gated(x), native.silu_mul(lin(x)))
    assert torch.equal(lin.silu_gated(x[:3]), native.silu_mul(native.amx_linear(x[:3], aw)))
    with pytest.raises(NativeKernelError):
        native.amx_linear_silu(x[:, :32].contiguous(), aw) if k != 32 else native.amx_linear_silu(x.float(), aw)


@pytest.mark.skipif(not _AMX, reason="our AMX GEMM needs a CPU with AMX-BF16 (and Linux's tile state)")
def test_amx_linear_rejects_what_it_cannot_run():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g).bfloat16()
    assert not native.amx_linear_available(w[:48]) and not native.amx_linear_available(w[:, :40])
    assert not native.amx_linear_available(w.float())
    with pytest.raises(NativeKernelError):
        native.amx_pack(w[:, :40])
    with pytest.raises(NativeKernelError):
        native.amx_pack(w, torch.zeros(32))
    aw = native.amx_pack(w)
    with pytest.raises(NativeKernelError):
        native.amx_linear(torch.randn(3, 32).bfloat16(), aw)  # input size
    with pytest.raises(NativeKernelError):
        native.amx_linear(torch.randn(3, 64), aw)  # float32
    with pytest.raises(NativeKernelError):
        native.amx_linear(torch.randn(0, 64).bfloat16(), aw)  # no rows
    # a layer GEMM packed on AMX takes it; the switch off (RAGCACHE_AMX=0's) keeps oneDNN's 128-row calls
    from ragcache_backend.model.kernels.linear import pack_linear

    assert pack_linear(w, per_step=True).amx is not None and pack_linear(w, per_step=False).amx is None
    before = native.bf16_amx()
    try:
        native.bf16_amx(False)
        assert pack_linear(w, per_step=True).amx is None
    finally:
        native.bf16_amx(before)


def test_rope_write_matches_apply_rope_and_writes_the_arena():
    n, hq, hkv, d = 37, 9, 3, 64
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=g).bfloat16()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    positions = torch.arange(100, 100 + n)
    cos, sin = rope_cos_sin(inv_freq, positions, dtype=torch.float32)
    ref = apply_rope(qkv[:, : hq + hkv].float(), cos, sin)
    kc, vc = torch.zeros(256, hkv, d).bfloat16(), torch.zeros(256, hkv, d).bfloat16()
    slots = torch.randperm(256, generator=g)[:n]
    values = qkv[:, hq + hkv :].clone()
    native.rope_write(qkv, hq, hkv, cos, sin, kc, vc, slots)
    # float32 math rounded once to bf16 (fused multiply-adds: at most one bf16 ulp from torch's)
    ulps = (qkv[:, : hq + hkv].float() - ref.bfloat16().float()).abs() / ref.abs().clamp_min(1e-2)
    assert ulps.max().item() <= 2**-7
    assert torch.equal(kc[slots], qkv[:, hq : hq + hkv]) and torch.equal(vc[slots], values)
    untouched = torch.ones(256, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()


def test_add_rms_norm_matches_the_transformers_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(5)
    h = torch.randn(33, 576, generator=g).bfloat16()
    delta = torch.randn(33, 576, generator=g).bfloat16()
    norm = LlamaRMSNorm(576, eps=1e-5).bfloat16()
    norm.weight.data = torch.rand(576, generator=g).bfloat16() + 0.5
    expect_h = h + delta
    expect = norm(expect_h)
    got = native.add_rms_norm(h, delta, norm.weight.data, 1e-5)
    assert torch.equal(h, expect_h)  # the residual is updated in place, rounded as torch rounds
    ulps = (got.float() - expect.float()).abs() / expect.float().abs().clamp_min(1e-3)
    assert ulps.max().item() <= 2 ** -7  # at most one bf16 ulp apart (sum order of the variance)
    assert torch.equal(native.add_rms_norm(h.clone(), None, norm.weight.data, 1e-5), got)


def test_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(9, 2 * 1536, generator=g) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    expect = F.silu(gate) * up
    got = native.silu_mul(gate_up)
    diff = (got.float() - expect.float()).abs() / expect.float().abs().clamp_min(1e-2)
    assert diff.max().item() <= 2 ** -7


def test_bad_arguments_raise_a_typed_error():
    kc, vc = _arena(64, 3, 64, seed=0)
    q = torch.randn(4, 9, 64).bfloat16()
    with pytest.raises(NativeKernelError):
        native.paged_prefill_attention(q.float(), kc, vc, torch.arange(4), 0, 0.125)  # not bf16
    with pytest.raises(NativeKernelError):
        native.paged_prefill_attention(q, kc, vc, torch.arange(5), 0, 0.125)  # slots != cached + new
    with pytest.raises(NativeKernelError):
        native.silu_mul(torch.randn(2, 30).bfloat16())  # 2I not a multiple of 32
    with pytest.raises(NativeKernelError):
        native.add_rms_norm(torch.randn(2, 64).bfloat16(), None, torch.ones(32).bfloat16(), 1e-5)


def _random_bf16_llama(name: str, seed: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                       head_dim: int | None = None):
    """A random 2-layer Llama in bf16 (vocabulary 512), as a :class:`LoadedModel` named ``name``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ragcache_backend.model.loader import LoadedModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                      tie_word_embeddings=False, head_dim=head_dim or hidden // heads)
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    return LoadedModel(model=model, tokenizer=None, name=name, fingerprint=name, dtype=torch.bfloat16,
                       device=torch.device("cpu"), context_window=2048)


@pytest.fixture(scope="module")
def tiny_bf16_llama():
    """A random 2-layer Llama with head size 64 (the native kernels' size), bf16."""
    return _random_bf16_llama("tiny-bf16-64", seed=0, hidden=192, intermediate=384, heads=3, kv_heads=1)


@pytest.fixture(scope="module")
def wide_bf16_llama():
    """A random 2-layer Llama of SmolLM2-135M's layer shapes (hidden 576, MLP 1,536, 9 / 3 heads),
    bf16: long enough sums that oneDNN's GEMM and the few-row kernel round differently."""
    return _random_bf16_llama("wide-bf16-64", seed=2, hidden=576, intermediate=1536, heads=9, kv_heads=3)


@pytest.fixture(scope="module")
def odd_bf16_llama():
    """A random 2-layer Llama whose O and down projections have 224 outputs (7 x 32, not a multiple
    of 64: the AMX decode GEMM's last group of columns is a half one), head size 64, bf16."""
    return _random_bf16_llama("odd-bf16-64", seed=3, hidden=224, intermediate=352, heads=4, kv_heads=2, head_dim=64)


def test_runner_native_path_is_exact_across_the_cache_and_close_to_transformers(tiny_bf16_llama):
    from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner

    runner = ModelRunner(copy.deepcopy(tiny_bf16_llama), num_device_blocks=64, block_size=16)
    assert runner.native_attention and runner.native_fused
    g = torch.Generator().manual_seed(8)
    toks = tuple(torch.randint(0, 512, (300,), generator=g).tolist())
    cold = runner.forward([ForwardInput(toks, (), (KVRun(tuple(range(19)), 0, 300),))], all_logits=True)[0]
    # the same prompt with its first 200 tokens from the cache (computed in another call, other blocks)
    runner.forward([ForwardInput(toks[:200], (), (KVRun(tuple(range(20, 33)), 0, 200),))])
    warm = runner.forward([ForwardInput(toks[200:], (KVRun(tuple(range(20, 33)), 0, 200),),
                                        (KVRun(tuple(range(40, 47)), 0, 100),))], all_logits=True)[0]
    assert torch.equal(warm, cold[200:])
    with torch.inference_mode():
        ref = tiny_bf16_llama.model(torch.tensor([toks])).logits[0].float()
    assert (cold - ref).abs().max().item() < 0.1 * ref.abs().max().item()
    assert (cold.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.95


def test_a_bf16_chunk_reuse_step_runs_its_explicit_positions_on_the_kernel(tiny_bf16_llama, monkeypatch):
    """Chunk reuse in bf16 (Cache-Craft's recomputation): rows at explicit positions take the native
    kernel, not the masked torch attention; recomputing every token of a moved chunk gives the cold
    prefill's logits bit for bit; a scattered recompute agrees with the torch path within bf16's error,
    and its attention statistics and guard mass come from the native statistics kernel as well."""
    import ragcache_backend.model.chunk_rows as chunk_rows
    import ragcache_backend.model.llama as llama
    from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner

    runner = ModelRunner(copy.deepcopy(tiny_bf16_llama), num_device_blocks=130, block_size=16)
    assert runner.layers.native_positions
    g = torch.Generator().manual_seed(21)
    toks = tuple(torch.randint(0, 512, (150,), generator=g).tolist())
    other = tuple(torch.randint(0, 512, (17,), generator=g).tolist())
    at = iter(range(0, 130, 10))  # a fresh 10-block range per run

    def run(n: int) -> KVRun:
        first = next(at)
        return KVRun(tuple(range(first, first + -(-n // 16))), 0, n)

    cold = runner.forward([ForwardInput(toks, (), (run(150),))], all_logits=True)[0]

    def moved() -> tuple[KVRun, ...]:
        """toks[:40] computed in place; toks[40:100] computed after 17 other tokens, moved to position 40."""
        head, elsewhere, chunk, rest = run(40), run(17 + 60), run(60), run(50)
        runner.forward([ForwardInput(toks[:40], (), (head,))])
        runner.forward([ForwardInput(other + toks[40:100], (), (elsewhere,))])
        src = KVRun(elsewhere.blocks, 17, 60)  # the chunk's 60 tokens inside that run
        runner.copy_rerotated(src, chunk, 40 - 17)
        return head, chunk, rest

    calls = []
    real = llama.attention
    monkeypatch.setattr(llama, "attention", lambda *a, **kw: calls.append(kw.get("mask") is not None) or real(*a, **kw))
    ref_mass = chunk_rows.segment_attention_mass
    monkeypatch.setattr(chunk_rows, "segment_attention_mass", lambda *a, **kw: calls.append(True) or ref_mass(*a, **kw))
    every = runner.forward([ForwardInput(toks[40:], moved(), (), positions=tuple(range(40, 150)))], all_logits=True)[0]
    assert not any(calls) and torch.equal(every, cold[40:])
    rows = sorted(set(range(40, 100, 4)) | set(range(100, 150)))
    picked = tuple(toks[p] for p in rows)
    stats = dict(stat_segments=(40, 60, 50), guard_segments=(40, 60, 50), guard=True)
    step = runner.forward_step([ForwardInput(picked, moved(), (), positions=tuple(rows), **stats)], all_logits=True)
    assert not any(calls)
    fast = step.logits[0]
    mass = torch.tensor(step.attention[0].mass)
    assert mass.shape == (len(rows), 3) and torch.allclose(mass.sum(-1), torch.ones(len(rows)), atol=1e-3)
    assert step.last_mass[0] is not None and abs(sum(step.last_mass[0]) - 1.0) < 1e-3
    runner.layers.native_positions = False
    try:
        slow = runner.forward([ForwardInput(picked, moved(), (), positions=tuple(rows))], all_logits=True)[0]
    finally:
        runner.layers.native_positions = True
    assert any(calls)
    assert (fast - slow).abs().max().item() < 0.1 * slow.abs().max().item()
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean().item() > 0.9


def test_linear_rows_bf16_rounds_once_and_a_row_never_depends_on_the_others():
    """The few-row bf16 GEMM of the whole-step decode (``rc_linear_rows``): float32 sums of exact
    bf16 products, the bias added, one bf16 rounding; a row's bits are the same whatever rows and
    how many are beside it (a generated token's answer must not depend on the batch it ran in)."""
    g = torch.Generator().manual_seed(21)
    w = torch.randn(72, 96, generator=g).bfloat16()
    b = torch.randn(72, generator=g).bfloat16()
    x = torch.randn(16, 96, generator=g).bfloat16()
    full = native.linear_rows(x, w, b)
    assert full.dtype == torch.bfloat16 and full.shape == (16, 72)
    ref = x.double() @ w.double().T + b.double()
    # one round-to-nearest to bf16: within half an ulp (2^-8 of the value) plus float32 summation noise
    assert ((full.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-4).all()
    assert torch.equal(full, native.linear_rows(x, w, b))  # deterministic
    for m in range(1, 16):
        assert torch.equal(native.linear_rows(x[:m], w, b), full[:m]), m
        assert torch.equal(native.linear_rows(x[m:], w, b), full[m:]), m
    no_bias = native.linear_rows(x, w)
    assert ((no_bias.double() - (ref - b.double())).abs() <= (ref - b.double()).abs() * 2.0**-8 + 1e-4).all()
    assert not native.linear_rows_available(torch.randn(72, 48).bfloat16())  # K not a multiple of 32
    assert not native.linear_rows_available(torch.randn(6, 96).bfloat16())  # N not a multiple of 4
    with pytest.raises(NativeKernelError):
        native.linear_rows(x, torch.randn(72, 48).bfloat16())
    with pytest.raises(NativeKernelError):
        native.linear_rows(x.float(), w)  # dtypes differ
    with pytest.raises(NativeKernelError):
        native.linear_rows(x, w, b.float())


@pytest.fixture(scope="module")
def tiny_bf16_qwen2():
    """A random 2-layer Qwen2 (Q/K/V biases) with head size 64, bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ragcache_backend.model.loader import LoadedModel

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # biases are initialised to zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return LoadedModel(model=model.to(torch.bfloat16), tokenizer=None, name="tiny-bf16-qwen2", fingerprint="tiny-bf16-qwen2",
                       dtype=torch.bfloat16, device=torch.device("cpu"), context_window=2048)


@pytest.mark.parametrize("model", ["tiny_bf16_llama", "tiny_bf16_qwen2", "wide_bf16_llama", "odd_bf16_llama"])
def test_a_bf16_decode_step_in_one_native_call(model, request, monkeypatch):
    """Decode-only bf16 steps run every layer in one call (rc_decode_step); a sequence's logits and
    K/V are the same bits alone or in a batch, through the per-operation path (whose GEMMs give
    generated tokens' rows the same kernel), and in a step mixed with a prompt chunk. Qwen2: the
    Q/K/V biases. On AMX CPUs every GEMM of all of these runs on our AMX GEMM (the whole-step
    decode's on tiles of as many rows as the step has)."""
    from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner

    loaded = request.getfixturevalue(model)
    calls = []
    one_call = native.decode_step

    def counted(*args):
        calls.append(len(args[1]))  # the step's rows
        return one_call(*args)

    monkeypatch.setattr(native, "decode_step", counted)
    whole = ModelRunner(copy.deepcopy(loaded), num_device_blocks=240, block_size=16)
    alone = ModelRunner(copy.deepcopy(loaded), num_device_blocks=240, block_size=16)
    per_op = ModelRunner(copy.deepcopy(loaded), num_device_blocks=240, block_size=16)
    mixed = ModelRunner(copy.deepcopy(loaded), num_device_blocks=260, block_size=16)
    assert whole.layers.whole_step_decode and alone.layers.whole_step_decode
    assert whole.layers.gemms_on_amx == _AMX
    per_op.layers.whole_step_decode = False
    g = torch.Generator().manual_seed(13)
    seqs = [tuple(torch.randint(0, 512, (n,), generator=g).tolist()) for n in (5, 300, 700)]
    blocks = [tuple(range(i * 80, i * 80 + 80)) for i in range(len(seqs))]
    prompt = tuple(torch.randint(0, 512, (160,), generator=g).tolist())  # prefilled in chunks beside the decodes
    for runner in (whole, alone, per_op, mixed):
        for toks, b in zip(seqs, blocks):
            runner.forward([ForwardInput(toks, (), (KVRun(b, 0, len(toks)),))])

    def step(runner, batch, nxt):
        return runner.forward([ForwardInput((nxt[i],), (KVRun(blocks[i], 0, len(seqs[i])),), (KVRun(blocks[i], len(seqs[i]), 1),),
                                            decode=True) for i in batch])

    prompt_blocks = tuple(range(240, 251))  # mixed's own blocks past the sequences'
    for r in range(4):
        nxt = {i: int(torch.randint(0, 512, (1,), generator=g)) for i in range(3)}
        got = step(whole, [0, 1, 2], nxt)
        ref = step(per_op, [0, 1, 2], nxt)
        one_by_one = [step(alone, [i], nxt)[0] for i in (2, 0, 1)]
        chunk = ForwardInput(prompt[40 * r : 40 * r + 40], (KVRun(prompt_blocks, 0, 40 * r),) if r else (),
                             (KVRun(prompt_blocks, 40 * r, 40),))
        beside = mixed.forward([chunk] + [ForwardInput((nxt[i],), (KVRun(blocks[i], 0, len(seqs[i])),),
                                                       (KVRun(blocks[i], len(seqs[i]), 1),), decode=True) for i in (1, 0, 2)])
        for i in range(3):
            assert torch.equal(got[i], one_by_one[(1, 2, 0)[i]])  # alone or batched: the same bits
            assert torch.equal(got[i], ref[i])  # the per-operation path: the same bits
            assert torch.equal(got[i], beside[1 + (1, 0, 2).index(i)])  # beside a prompt chunk: the same bits
        for i in range(3):
            seqs[i] += (nxt[i],)
    for other in (alone, per_op):
        assert torch.equal(whole.arena.k_cache, other.arena.k_cache) and torch.equal(whole.arena.v_cache, other.arena.v_cache)
    assert calls == [3, 1, 1, 1] * 4  # the batched and the one-by-one steps took the one call (per_op, mixed never)


def test_a_bf16_decode_plan_and_step_reject_what_they_cannot_run():
    g = torch.Generator().manual_seed(5)
    w = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    layer = native.DecodeLayer(w(5 * 64, 192), None, w(192, 192), None, w(2 * 384, 192), w(192, 384), None, w(192), 1e-5,
                               w(192), 1e-5)
    plan = native.decode_plan([layer])
    assert plan is not None and plan.dtype == torch.bfloat16 and (plan.hidden, plan.intermediate) == (192, 384)
    mixed = native.DecodeLayer(*(t.float() if i == 2 else t for i, t in enumerate(
        (layer.qkv, layer.qkv_bias, layer.o, layer.o_bias, layer.gate_up, layer.down, layer.down_bias, layer.post_norm))),
        layer.post_eps, layer.next_norm, layer.next_eps)
    assert native.decode_plan([mixed]) is None  # one dtype for every weight
    odd = native.DecodeLayer(w(5 * 64, 176), None, w(176, 192), None, w(2 * 384, 176), w(176, 384), None, w(176), 1e-5,
                             w(176), 1e-5)
    assert native.decode_plan([odd]) is None  # hidden size not a multiple of 32
    k = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    batch = native.attention_batch([torch.tensor([0, 1]), torch.tensor([2])], [1, 1], [True, True])
    h, cos = w(2, 192), torch.ones(2, 64)
    with pytest.raises(NativeKernelError):  # a float32 residual stream for a bf16 plan
        native.decode_step(plan, h.float(), h.float(), 3, 1, cos, cos, k, k.clone(), torch.tensor([1, 2]), batch, 0.125)
    with pytest.raises(NativeKernelError):  # a float32 arena
        native.decode_step(plan, h, h.clone(), 3, 1, cos, cos, k.float(), k.float(), torch.tensor([1, 2]), batch, 0.125)
    with pytest.raises(NativeKernelError):  # more rows than the batch has
        native.decode_step(plan, w(3, 192), w(3, 192), 3, 1, torch.ones(3, 64), torch.ones(3, 64), k, k.clone(),
                           torch.tensor([1, 2, 3]), batch, 0.125)
    x = h.clone()
    native.decode_step(plan, h, x, 3, 1, cos, cos, k, k.clone(), torch.tensor([1, 2]), batch, 0.125)  # and it runs
    assert torch.isfinite(x.float()).all()
