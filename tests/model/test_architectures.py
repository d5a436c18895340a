"""Qwen3 and Gemma 3 on our own forward pass, against the transformers models' own forward (fp32).

Tiny random models (a few layers, GQA, random norm weights so that Gemma's ``1 + w`` and the
QK-norms matter); Gemma 3 with a window of 8 tokens, local and global layers mixed, prompts of 40
tokens, so every local layer masks. Each model is checked cold, with a cached prefix (shorter and
longer than the window), over several decode steps, at explicit positions (chunk recomputation),
and through re-rotation of a moved chunk (per-layer RoPE bases).
"""

from __future__ import annotations

import pytest
import torch

from ragcache_backend.errors import ModelLoadError
from ragcache_backend.model.arch import describe, native_gaps
from ragcache_backend.model.loader import SUPPORTED_MODEL_TYPES, LoadedModel
from ragcache_backend.model.runner import ForwardInput, ModelRunner
from tests.model.test_chunk_runner import Blocks

VOCAB = 512
TOL = 1e-4


def _randomize_norms(model: torch.nn.Module) -> None:
    """RMSNorm weights drawn at random (they are initialised to 1, or to 0 for Gemma's ``1 + w``)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (0.0 if "gemma" in type(model).__name__.lower() else 1.0))


def _loaded(model: torch.nn.Module, name: str) -> LoadedModel:
    model.eval()
    _randomize_norms(model)
    return LoadedModel(model=model, tokenizer=None, name=name, fingerprint=name, dtype=torch.float32,
                       device=torch.device("cpu"), context_window=describe(model).context_window)


def _qwen3(windows: bool = False) -> LoadedModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                      use_sliding_window=windows, sliding_window=8, max_window_layers=1)
    return _loaded(Qwen3ForCausalLM(cfg), "tiny-qwen3" + ("-windows" if windows else ""))


def _gemma3(softcap: float | None = None) -> LoadedModel:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                           sliding_window=8, max_position_embeddings=512, final_logit_softcapping=softcap,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                           rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    return _loaded(Gemma3ForCausalLM(cfg), "tiny-gemma3" + ("-softcap" if softcap else ""))


MODELS = {"qwen3": _qwen3, "qwen3-windows": lambda: _qwen3(windows=True), "gemma3": _gemma3}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request) -> LoadedModel:
    return MODELS[request.param]()


@pytest.fixture()
def runner(tiny) -> ModelRunner:
    return ModelRunner(tiny, num_device_blocks=64, block_size=16)


def _toks(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def _reference(loaded: LoadedModel, toks) -> torch.Tensor:
    """float32 ``[T, vocab]`` logits of the transformers model's own forward."""
    with torch.inference_mode():
        return loaded.model(torch.tensor([list(toks)])).logits[0].float()


def test_cold_prompt_matches_transformers(tiny, runner):
    toks = _toks(40, 1)
    ours = runner.forward([ForwardInput(toks, (), (Blocks().run(40),))], all_logits=True)[0]
    assert (ours - _reference(tiny, toks)).abs().max().item() <= TOL


def test_final_logit_softcapping_matches_transformers():
    """Gemma 3 has none, Gemma 2 had it: ``c * tanh(logits / c)`` when the config sets it."""
    loaded = _gemma3(softcap=0.5)
    toks = _toks(40, 1)
    ours = ModelRunner(loaded, 8, 16).forward([ForwardInput(toks, (), (Blocks().run(40),))], all_logits=True)[0]
    ref = _reference(loaded, toks)
    assert (ours - ref).abs().max().item() <= TOL and ref.abs().max().item() < 0.5


@pytest.mark.parametrize("cached", [5, 21, 37])
def test_prompt_after_a_cached_prefix_matches_transformers(tiny, runner, cached):
    """The prefix's KV in the arena, the rest computed over it: shorter than the window (5), and
    longer (21, 37: the window skips part of the prefix)."""
    toks = _toks(40, 2)
    b = Blocks()
    prefix, rest = b.run(cached), b.run(40 - cached)
    runner.forward([ForwardInput(toks[:cached], (), (prefix,))])
    ours = runner.forward([ForwardInput(toks[cached:], (prefix,), (rest,))], all_logits=True)[0]
    assert (ours - _reference(tiny, toks)[cached:]).abs().max().item() <= TOL


def test_decode_steps_match_transformers(tiny, runner):
    toks = list(_toks(40, 3))
    b = Blocks()
    runs = [b.run(40)]
    logits = runner.forward([ForwardInput(tuple(toks), (), (runs[0],))])[0]
    for _ in range(6):
        toks.append(int(logits.argmax()))
        runs.append(b.run(1))
        logits = runner.forward([ForwardInput((toks[-1],), tuple(runs[:-1]), (runs[-1],), decode=True)])[0]
        assert (logits - _reference(tiny, toks)[-1]).abs().max().item() <= TOL


def test_tokens_at_explicit_positions_match_transformers(tiny, runner):
    """Chunk recomputation: new tokens at explicit positions inside a context (window masks on
    the explicit-position path too)."""
    toks = _toks(40, 4)
    b = Blocks()
    prefix, rest = b.run(24), b.run(16)
    runner.forward([ForwardInput(toks[:24], (), (prefix,))])
    ours = runner.forward([ForwardInput(toks[24:], (prefix, rest), (), positions=tuple(range(24, 40)))])[0]
    assert (ours - _reference(tiny, toks)[-1]).abs().max().item() <= TOL


def test_rerotated_keys_equal_keys_computed_at_the_new_position_in_every_layer(tiny, runner):
    """A chunk moved by re-rotation: in layer 0, K depends only on the token and its position, so
    it equals the chunk computed at the new position, whatever RoPE base the layer uses (Gemma 3:
    layer 0 is local, base 10,000; layer 1 global, 1,000,000)."""
    b = Blocks()
    chunk, a_prefix, b_prefix = _toks(20, 5), _toks(7, 6), _toks(30, 7)
    pa, ca, pb, cb, moved = b.run(7), b.run(20), b.run(30), b.run(20), b.run(20)
    runner.forward([ForwardInput(a_prefix + chunk, (), (pa, ca))])
    runner.forward([ForwardInput(b_prefix + chunk, (), (pb, cb))])
    runner.copy_rerotated(ca, moved, 30 - 7)
    sl_m, sl_b = runner.slots([moved]), runner.slots([cb])
    assert (runner.k_cache[0, sl_m] - runner.k_cache[0, sl_b]).abs().max().item() < TOL
    # every layer rotated with its own table: compare against each layer's own rotation
    arch = runner.layers.arch
    for layer in range(runner.num_layers):
        inv = arch.ropes[arch.layer_rope[layer]].inv_freq
        from ragcache_backend.model.kernels import rerotate

        expect = rerotate(runner.k_cache[layer, runner.slots([ca])], 23, inv)
        assert (runner.k_cache[layer, sl_m] - expect).abs().max().item() < 1e-5


def test_recomputing_every_token_of_moved_chunks_equals_the_cold_prompt(tiny, runner):
    """Chunk reuse with recompute share 1 (Cache-Craft): chunks computed in another context and
    position, moved by per-layer re-rotation, every token recomputed at explicit positions over
    the merged context, give transformers' logits of the cold prompt (windows and all)."""
    b = Blocks()
    sys_, c1, c2, q = _toks(6, 8), _toks(13, 9), _toks(15, 10), _toks(5, 11)
    other = _toks(9, 12)
    ov, v2 = b.run(6 + 9), b.run(15)
    runner.forward([ForwardInput(sys_ + other + c2, (), (ov, v2))])  # c2 after another document
    sv, v1 = b.run(6), b.run(13)
    runner.forward([ForwardInput(sys_ + c1, (), (sv, v1))])
    r1, r2, rq = b.run(13), b.run(15), b.run(5)
    runner.copy_rerotated(v1, r1, 0)
    runner.copy_rerotated(v2, r2, (6 + 13) - (6 + 9))
    out = runner.forward([ForwardInput(c1 + c2 + q, (sv, r1, r2, rq), (), positions=tuple(range(6, 39)))])[0]
    assert (out - _reference(tiny, sys_ + c1 + c2 + q)[-1]).abs().max().item() <= TOL


def test_gemma3_description_and_native_gaps():
    spec = describe(_gemma3().model)
    assert spec.windows == (8, None, 8, 8) and spec.layer_rope == (1, 0, 1, 1)
    assert spec.embed_scale == pytest.approx(8.0) and spec.attn_scale == pytest.approx(24**-0.5)
    assert spec.context_window == 512  # global layers: the windows are masks, the context is not capped
    assert spec.act == "gelu_pytorch_tanh" and spec.family.norm_offset and spec.family.sandwich_norms
    gaps = native_gaps(spec)
    assert gaps.attention == ("sliding-window layers",) and "QK-norm" in gaps.fused
    assert native_gaps(describe(_qwen3().model)).attention == ()  # native attention could run Qwen3
    assert {"qwen3", "gemma3_text", "llama", "mistral", "qwen2"} <= SUPPORTED_MODEL_TYPES


def test_native_kernels_are_gated_off_for_what_they_lack(monkeypatch):
    """Where the native kernels exist (bf16 on AVX512-BF16, soon fp32 on AVX2), a Gemma 3 model
    still runs the torch path: the kernels have no windows, QK-norm, (1 + w) norms or GeGLU."""
    from ragcache_backend.model.kernels import native

    monkeypatch.setattr(native, "available", lambda *a, **k: True)
    monkeypatch.setattr(native, "fused_available", lambda *a, **k: True)
    runner = ModelRunner(_gemma3(), num_device_blocks=8, block_size=16)
    assert not runner.native_attention and not runner.native_fused and runner.kernel_tag == "torch"
    qwen = ModelRunner(_qwen3(), num_device_blocks=8, block_size=16)
    assert qwen.native_attention and not qwen.native_fused


def test_features_we_do_not_run_are_refused():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_logit_softcapping=50.0)
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        describe(Gemma3ForCausalLM(cfg))
    # Mistral: one window on every layer caps the context (no query reaches past it), no masks
    mistral = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, sliding_window=64,
                                               max_position_embeddings=512))
    spec = describe(mistral)
    assert spec.context_window == 64 and spec.windows == (None,)
