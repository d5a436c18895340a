"""A real ``ragcache serve`` process on loopback (the default SmolLM2 model), started once per module."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

RAGCACHE = Path(sys.executable).with_name("ragcache")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    """A started server: its process, base URL (``http://127.0.0.1:PORT``) and log file."""

    process: subprocess.Popen
    url: str
    log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(tmp: Path, *extra: str, timeout: float = 240.0) -> RunningServer:
    """Start ``ragcache serve`` on a free loopback port and wait until ``/health`` answers 200. In
    float32, as the engines the tests compare it with (``--dtype`` in ``extra`` overrides it; the
    default, ``auto``, is bf16 on an AVX512-BF16 CPU: ``test_startup.py`` serves with it)."""
    port = free_port()
    log = tmp / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    process = subprocess.Popen(
        [str(RAGCACHE), "serve", "--dtype", "float32", "--port", str(port), "--cache-dir", str(tmp / "kv"), "--threads", "2",
         "--drain-timeout", "60", "--learned-documents", str(tmp / "learned_documents.jsonl"), *extra],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return RunningServer(process, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"the server did not start in {timeout} s:\n{log.read_text()}")


def stop_server(server: RunningServer) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(60)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@pytest.fixture(autouse=True)
def _learned_documents_in_tmp(tmp_path, monkeypatch):
    """In-process apps keep the documents they learn in the test's folder, not in ~/.cache/ragcache."""
    monkeypatch.setenv("RAGCACHE_LEARNED_DOCUMENTS", str(tmp_path / "learned_documents.jsonl"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_server(tmp_path_factory.mktemp("serve"))
    yield running
    stop_server(running)
