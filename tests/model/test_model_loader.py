"""Loading local models: HF folders, GGUF files, and the errors for bad paths."""

from __future__ import annotations

import json

import pytest

from ragcache_backend.errors import ModelLoadError
from ragcache_backend.model.loader import default_model_path, load_model, model_architecture, parse_dtype


@pytest.fixture(scope="module")
def tiny_folder(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model.model.save_pretrained(folder)
    tiny_model.tokenizer.save_pretrained(folder)
    return folder


def test_load_hf_folder_and_generate(tiny_folder, fixed_profile):
    from ragcache_backend.config import EngineConfig
    from ragcache_backend.engine.engine import RAGCacheEngine
    from ragcache_backend.model.sampling import SamplingParams

    loaded = load_model(tiny_folder)
    assert loaded.name == tiny_folder.name and loaded.context_window == 2048
    engine = RAGCacheEngine(EngineConfig(device_budget_bytes=2**22), loaded=loaded, profile=fixed_profile)
    engine.generate("q", ["a document about lists " * 5], SamplingParams(max_tokens=4))
    r = engine.generate("q", ["a document about lists " * 5], SamplingParams(max_tokens=4))
    assert r.cached_tokens > 0
    # same weights, same dtype -> same fingerprint; another dtype -> another one
    assert load_model(tiny_folder).fingerprint == loaded.fingerprint
    assert load_model(tiny_folder, dtype="bfloat16").fingerprint != loaded.fingerprint


def test_bad_paths_and_architectures(tmp_path, tiny_folder):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read its architecture"):
        load_model(broken)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(gpt2)
    for f in tiny_folder.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (gpt2 / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(gpt2)
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        parse_dtype("int3")
    assert json.loads((tiny_folder / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.model
def test_the_default_model_is_the_packaged_llama_gguf():
    assert default_model_path().suffix == ".gguf"
    assert model_architecture(default_model_path()) == "llama"  # a GGUF's header, tensors unread


def test_an_unsupported_architecture_is_refused_before_any_weight_is_read(tmp_path):
    """A Gemma 2 folder whose weights are garbage: refused for its architecture (named, with the
    supported list) in well under a second, so the weights were never read."""
    import time

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    (tmp_path / "model.safetensors").write_bytes(b"not weights" * 1000)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="'gemma2' is not supported; supported: gemma3_text, llama, mistral, qwen2, qwen3"):
        load_model(tmp_path)
    assert time.perf_counter() - start < 1.0
    # a multimodal Gemma 3 folder is refused with the text-only form named
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ModelLoadError, match="text-only form, gemma3_text"):
        load_model(tmp_path)


def test_a_gguf_header_is_read_without_parsing_the_rest(tmp_path):
    """The architecture is the header's first key: a file cut right after it still answers, and
    llama.cpp's ``gemma3`` is transformers' ``gemma3_text``."""
    import struct

    def header(arch: str) -> bytes:
        key, value = b"general.architecture", arch.encode()
        return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)
                + struct.pack("<Q", len(value)) + value)

    (tmp_path / "g.gguf").write_bytes(header("gemma3"))
    assert model_architecture(tmp_path / "g.gguf") == "gemma3_text"
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + b"\0" * 20)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        model_architecture(tmp_path / "bad.gguf")


def test_choose_dtype_names_and_auto(tiny_folder):
    import torch

    from ragcache_backend.config import EngineConfig
    from ragcache_backend.model.kernels import native
    from ragcache_backend.model.loader import choose_dtype

    assert choose_dtype("bf16", tiny_folder).dtype == torch.bfloat16 and choose_dtype("float32").dtype == torch.float32
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        choose_dtype("int8", tiny_folder)
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(tiny_folder, dtype="float64")
    # the tiny model's head size (16) does not fit the bf16 kernel: float32, saying why
    tiny = choose_dtype("auto", tiny_folder, "cpu")
    assert tiny.dtype == torch.float32 and native.unavailable_reason(torch.bfloat16, "cpu", 16, 2) in tiny.reason
    assert load_model(tiny_folder).dtype == torch.float32
    # off the CPU, auto is float32 (bf16 answers with and without the cache would differ there)
    cuda = choose_dtype("auto", tiny_folder, "cuda")
    assert cuda.dtype == torch.float32 and "cuda" in cuda.reason
    # the default model (head size 64, 3 query heads per KV head): bf16 exactly where the native bf16 kernels run
    default = choose_dtype("auto", None, "cpu")
    bf16_native = native.available(torch.bfloat16, "cpu", 64, 3)
    assert default.dtype == (torch.bfloat16 if bf16_native else torch.float32)
    assert ("bf16 kernels (AVX512-BF16" in default.reason and "run this model" in default.reason if bf16_native
            else native.unavailable_reason(torch.bfloat16, "cpu", 64, 3) in default.reason)
    # the engine asks for float32 under auto wherever chunk reuse may run (its calibration and explicit positions)
    assert EngineConfig().load_dtype() == "auto" and EngineConfig(reuse="chunk").load_dtype() == "float32"
    assert EngineConfig(reuse="auto").load_dtype() == "float32" and EngineConfig(dtype="bfloat16", reuse="chunk").load_dtype() == "bfloat16"
