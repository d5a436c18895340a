"""RoPE and attention kernels against straightforward reference math."""

from __future__ import annotations

import math

import pytest
import torch

from ragcache_backend.model.kernels import (apply_rope, attention, prefix_causal_bias, prefix_causal_mask, rerotate, rope_cos_sin,
                                           segment_attention_mass)


def _inv_freq(dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def test_rope_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    pos = torch.arange(3, 10)
    cos, sin = rope_cos_sin(_inv_freq(16), pos)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.allclose(apply_rope(q, cos, sin), ref_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(apply_rope(k, cos, sin), ref_k[0].transpose(0, 1), atol=1e-6)


@pytest.mark.parametrize("delta", [5, -3, 100])
def test_rerotate_composes_with_rope(delta):
    torch.manual_seed(1)
    k = torch.randn(6, 2, 32)
    inv = _inv_freq(32)
    pos = torch.arange(10, 16)
    at_old = apply_rope(k, *rope_cos_sin(inv, pos))
    at_new = apply_rope(k, *rope_cos_sin(inv, pos + delta))
    assert torch.allclose(rerotate(at_old, delta, inv), at_new, atol=1e-5)


def test_apply_rope_rejects_mismatched_tables():
    cos, sin = rope_cos_sin(_inv_freq(8), torch.arange(3))
    with pytest.raises(ValueError):
        apply_rope(torch.randn(4, 1, 8), cos, sin)


def test_prefix_causal_mask_hand_case():
    m = prefix_causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    with pytest.raises(ValueError):
        prefix_causal_mask(5, 4)


def _naive(q, k, v, mask):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("t,s", [(5, 5), (3, 9), (1, 9)])
def test_attention_matches_naive_gqa(t, s):
    torch.manual_seed(2)
    q, k, v = torch.randn(t, 6, 16), torch.randn(s, 2, 16), torch.randn(s, 2, 16)
    out = attention(q, k, v, scale=16**-0.5)
    assert torch.allclose(out, _naive(q, k, v, prefix_causal_mask(t, s)), atol=1e-5)


def test_attention_arbitrary_mask():
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 4, 8), torch.randn(6, 4, 8), torch.randn(6, 4, 8)
    mask = torch.tensor([[1, 0, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.allclose(attention(q, k, v, scale=8**-0.5, mask=mask), _naive(q, k, v, mask), atol=1e-5)


def test_prefix_causal_bias_equals_the_boolean_mask():
    torch.manual_seed(1)
    t, s = 5, 9
    q, k, v = torch.randn(t, 4, 8), torch.randn(s, 2, 8), torch.randn(s, 2, 8)
    bias = prefix_causal_bias(t, s, torch.float32)
    assert bias.shape == (t, s) and bias.dtype == torch.float32
    assert torch.equal(bias == 0, prefix_causal_mask(t, s))
    assert torch.equal(attention(q, k, v, scale=0.3, mask=bias), attention(q, k, v, scale=0.3, mask=prefix_causal_mask(t, s)))
    with pytest.raises(ValueError):
        attention(q, k, v, scale=0.3, mask=bias[:, :-1])


@pytest.mark.parametrize("cached,new", [(0, 7), (3, 40), (40, 40), (90, 12), (50, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_prefix_matches_the_masked_reference(cached, new, dtype):
    from ragcache_backend.model.kernels import attention_over_prefix, attention_plan, prefix_causal_mask

    g = torch.Generator().manual_seed(cached * 100 + new)
    q = torch.randn(new, 6, 16, generator=g).to(dtype)
    k = torch.randn(cached + new, 2, 16, generator=g).to(dtype)
    v = torch.randn(cached + new, 2, 16, generator=g).to(dtype)
    plan = attention_plan(cached, new, dtype)
    assert plan.padded_causal == (0 < cached <= new and new > 1)
    out = attention_over_prefix(q, k, v, scale=0.25, plan=plan)
    ref = attention(q.float(), k.float(), v.float(), scale=0.25, mask=prefix_causal_mask(new, cached + new))
    assert out.shape == (new, 6, 16) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref).abs().max().item() < tol
    with pytest.raises(ValueError):
        attention_over_prefix(q[:1], k, v, scale=0.25, plan=plan) if new > 1 else attention_plan(0, 0, dtype)


def test_prompt_rows_are_bit_identical_with_or_without_a_cached_prefix():
    """bf16 exactness: a prompt token's attention does not depend on which other rows run with it
    (cold causal prefill, padded causal over a short prefix, masked over a long one, one row)."""
    from ragcache_backend.model.kernels import attention_over_prefix, attention_plan

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(700, h, 64, generator=g).bfloat16() for h in (9, 3, 3))
    cold = attention(q, k, v, scale=0.125)  # the whole prompt, cache off
    for cached in (20, 400, 699):
        plan = attention_plan(cached, 700 - cached, torch.bfloat16)
        warm = attention_over_prefix(q[cached:], k, v, scale=0.125, plan=plan)
        assert torch.equal(warm, cold[cached:]), cached
    decode = attention_over_prefix(q[-1:], k, v, scale=0.125, plan=attention_plan(699, 1, torch.bfloat16, decode=True))
    assert (decode.float() - cold[-1:].float()).abs().max().item() < 2e-2  # generated tokens: a faster form


@pytest.mark.parametrize("hq,hkv,block", [(4, 4, 512), (6, 2, 7), (3, 1, 1)])
def test_segment_attention_mass_matches_a_per_head_softmax(hq, hkv, block):
    torch.manual_seed(0)
    t, s, d, nseg = 23, 40, 16, 5
    q, k = torch.randn(t, hq, d), torch.randn(s, hkv, d)
    positions = torch.sort(torch.randperm(s)[:t]).values  # explicit positions, not a contiguous run
    segments = torch.randint(0, nseg, (s,))  # not ascending: any key -> segment map
    got = segment_attention_mass(q, k, positions, segments, nseg, scale=0.3, block_rows=block)
    want = torch.zeros(t, hq, nseg)
    for h in range(hq):
        kh = k[:, h // (hq // hkv)]
        for i in range(t):
            p = int(positions[i])
            w = torch.softmax((kh[: p + 1] @ q[i, h]) * 0.3, dim=0)
            want[i, h].index_add_(0, segments[: p + 1], w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(t, hq))
    with pytest.raises(ValueError):
        segment_attention_mass(q, k, positions, segments, nseg, scale=0.3, block_rows=0)
