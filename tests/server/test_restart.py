"""The disk tier across server restarts: a graceful stop, a kill -9, a corrupted file.

Each step starts a real ``ragcache serve`` (the default SmolLM2 model) over the same cache folder
and drives it with the ``openai`` client; what a fresh process reuses can only come from disk.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from openai import OpenAI

from tests.server.conftest import start_server, stop_server

pytestmark = [pytest.mark.model, pytest.mark.slow]

DOCS = [
    "The global interpreter lock, or GIL, is a mutex that protects access to Python objects, preventing "
    "multiple threads from executing Python bytecodes at once. The GIL prevents race conditions and ensures "
    "thread safety. In CPython the lock is released around blocking I/O, so threads still help I/O-bound "
    "programs, while CPU-bound work is better spread over processes with multiprocessing.",
    "A list is a mutable sequence: items can be appended, removed or replaced in place, and two names can "
    "refer to the same list object. A tuple is an immutable sequence, so it can be used as a dictionary key "
    "when all of its items are hashable. Lists are usually homogeneous and tuples heterogeneous records.",
]
QUESTION = "Why can a tuple be a dictionary key?"


def ask(url: str, question: str = QUESTION):
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0.0,
        extra_body={"documents": DOCS},
    )
    info = response.model_extra["ragcache"]
    return response, info


def kv_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.kv.safetensors"))


def wait_files(folder: Path, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(kv_files(folder)) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(kv_files(folder)) >= count, f"{len(kv_files(folder))} KV files, expected {count}"


def test_kv_survives_stop_kill_and_corruption(tmp_path):
    kv = tmp_path / "kv"
    # 1. a first server computes everything and is stopped gracefully (queued files are written)
    server = start_server(tmp_path)
    try:
        first, info = ask(server.url)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert len(info["documents"]) == 2
    finally:
        stop_server(server)
    assert server.process.returncode == 0
    nodes = len(kv_files(kv))  # template blocks, document, separator, document, question blocks, answer blocks
    path = 2 * len(DOCS) + 1  # at least: text before, document, separator, document, question
    assert nodes >= path

    # 2. a new process serves the repeat from disk; then it is killed with SIGKILL
    server = start_server(tmp_path)
    try:
        again, info = ask(server.url)
        full = first.usage.prompt_tokens - 1
        assert again.usage.prompt_tokens_details.cached_tokens == full
        assert info["disk_hits"] >= path  # the prompt's path (the answer's blocks are not on it)
        assert again.choices[0].message.content == first.choices[0].message.content
        other, _ = ask(server.url, "Does the GIL make threads useless?")  # new question: one more file
        wait_files(kv, nodes + 1)
    finally:
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()

    # 3. after the kill -9 the new file is there and is served; a corrupted one is dropped and recomputed
    victim = max(kv_files(kv), key=lambda p: p.stat().st_size)  # a document's KV
    data = bytearray(victim.read_bytes())
    data[-64] ^= 0xFF
    victim.write_bytes(bytes(data))
    server = start_server(tmp_path)
    try:
        after_kill, info = ask(server.url, "Does the GIL make threads useless?")
        assert info["disk_hits"] >= 1 and after_kill.choices[0].message.content == other.choices[0].message.content
        assert 0 < after_kill.usage.prompt_tokens_details.cached_tokens < after_kill.usage.prompt_tokens - 1
        assert "unusable" in server.logs() and "checksum" in server.logs()
        repeat, info = ask(server.url, "Does the GIL make threads useless?")
        assert repeat.usage.prompt_tokens_details.cached_tokens == repeat.usage.prompt_tokens - 1
        assert repeat.choices[0].message.content == other.choices[0].message.content
    finally:
        stop_server(server)
