"""A server listens at once and loads its model behind: ``/health`` says ``starting`` (503) and
the API answers 503 ``starting`` until the engine is built; a model that fails to load in the
background stops the server with its error."""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest

from ragcache_backend.server.app import app_over
from ragcache_backend.server.service import CompletionService
from ragcache_backend.server.settings import ServerSettings
from ragcache_backend.server.startup import ServiceSlot
from tests.server.conftest import RAGCACHE, free_port

HI = [{"role": "user", "content": "hi"}]


async def test_routes_answer_starting_until_the_service_is_set(tiny_model, fixed_profile):
    from ragcache_backend.config import EngineConfig
    from ragcache_backend.engine.engine import RAGCacheEngine

    slot = ServiceSlot(model="tiny-llama")
    settings = ServerSettings(default_max_tokens=2)
    transport = httpx.ASGITransport(app=app_over(slot, settings))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as api:
        health = await api.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "starting"
        busy = await api.post("/v1/chat/completions", json={"messages": HI})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "starting"
        assert busy.headers["retry-after"] == "5"
        assert (await api.post("/tokenize", json={"prompt": "x"})).status_code == 503
        engine = RAGCacheEngine(EngineConfig(device_budget_bytes=4 << 20), loaded=tiny_model, profile=fixed_profile)
        try:
            slot.set(CompletionService(engine, settings))
            assert (await api.get("/health")).json()["status"] == "ok"
            assert (await api.post("/v1/chat/completions", json={"messages": HI})).status_code == 200
            slot.begin_drain()
            assert (await api.get("/health")).status_code == 503
        finally:
            engine.close(cancel=True)


def launch(tmp_path, *argv: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", RAGCACHE_HOME=str(tmp_path / "home"))
    process = subprocess.Popen([str(RAGCACHE), "serve", *argv, "--port", str(port), "--threads", "2",
                                "--no-disk-cache", "--no-remember-documents"],
                               stdout=(tmp_path / "log").open("wb"), stderr=subprocess.STDOUT, env=env)
    return process, f"http://127.0.0.1:{port}"


@pytest.mark.model
def test_a_fresh_server_answers_health_in_seconds_then_serves(tmp_path):
    """A fresh $RAGCACHE_HOME: the model is converted and loaded (seconds to minutes); /health
    answers long before, with "starting", then "ok"."""
    process, url = launch(tmp_path)
    start, statuses = time.monotonic(), []
    try:
        while time.monotonic() - start < 300:
            assert process.poll() is None, (tmp_path / "log").read_text()
            try:
                response = httpx.get(f"{url}/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            statuses.append((time.monotonic() - start, response.json()["status"]))
            if response.status_code == 200:
                break
            time.sleep(0.5)
        first_at, first = statuses[0]
        assert first_at < 30 and first == "starting", statuses
        assert statuses[-1][1] == "ok", (statuses, (tmp_path / "log").read_text())
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200
        # the default dtype, auto: bf16 where the native bf16 kernels run the model, and the log says so
        import torch

        from ragcache_backend.model.kernels import native

        chosen = "bfloat16" if native.available(torch.bfloat16, "cpu", 64, 3) else "float32"
        assert f"dtype: {chosen} (auto: " in (tmp_path / "log").read_text()
    finally:
        process.terminate()
        process.wait(60)


def test_a_model_that_fails_to_load_in_the_background_stops_the_server(tmp_path):
    folder = tmp_path / "broken-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))  # passes the architecture check
    (folder / "model.safetensors").write_bytes(b"not weights")
    process, url = launch(tmp_path, str(folder))
    try:
        code = process.wait(120)
    finally:
        if process.poll() is None:
            process.kill()
    log = (tmp_path / "log").read_text()
    assert code != 0 and "could not load a model" in log, log
