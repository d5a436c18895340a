"""The native bf16 CPU kernels against the torch reference, and the exactness they exist for."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ragcache_backend.model.kernels import apply_rope, attention, native, prefix_causal_mask, rope_cos_sin
from ragcache_backend.model.kernels.native import NativeKernelError

pytestmark = pytest.mark.skipif(not native.available(torch.bfloat16, "cpu", 64),
                                reason="native kernels need a C compiler and a CPU with AVX512-BF16")


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


@pytest.mark.parametrize("context,hq,hkv,d", [(1, 9, 3, 64), (15, 9, 3, 64), (16, 9, 3, 64), (1000, 9, 3, 64), (77, 8, 1, 128)])
def test_decode_kernel_matches_the_reference(context, hq, hkv, d):
    kc, vc = _arena(2048, hkv, d, seed=context)
    g = torch.Generator().manual_seed(9)
    slots = torch.randperm(2048, generator=g)[:context]
    q = torch.randn(1, hq, d, generator=g).bfloat16()
    out = native.paged_prefill_attention(q, kc, vc, slots, context - 1, d**-0.5, decode=True)
    ref = attention(q.float(), kc[slots].float(), vc[slots].float(), scale=d**-0.5)
    assert (out.float() - ref).abs().max().item() < 1e-2  # float32 probabilities: tighter than the prompt kernel


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


@pytest.fixture(scope="module")
def tiny_bf16_llama():
    """A random 2-layer Llama with head size 64 (the native kernels' size), bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ragcache_backend.model.loader import LoadedModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=3,
                      num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    return LoadedModel(model=model, tokenizer=None, name="tiny-bf16-64", fingerprint="tiny-bf16-64", dtype=torch.bfloat16,
                       device=torch.device("cpu"), context_window=2048)


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
