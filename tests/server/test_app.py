"""The app in-process (httpx ``ASGITransport``) over the tiny random model: request checks, error
shapes, streaming shapes, authentication, the busy limit, the drain, per-app metrics; and the
settings' precedence (flags > ``RAGCACHE_*`` > config file) and ``ragcache serve``'s option checks.
"""

from __future__ import annotations

import json

import httpx
import pytest

from ragcache_backend import cli
from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.server.app import create_app
from ragcache_backend.server.schema import ChatCompletionRequest
from ragcache_backend.server.settings import ServerSettings, load_settings

DOC = ("The Larkspur Valley Railway carried slate from the quarries at Upper Larkspur down to Merrow harbour, "
       "with four small tank engines named after local birds.")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_model, fixed_profile):
    eng = RAGCacheEngine(EngineConfig(device_budget_bytes=4 << 20, host_budget_bytes=16 << 20),
                         loaded=tiny_model, profile=fixed_profile)
    yield eng
    eng.close(cancel=True)


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


@pytest.fixture()
async def api(engine):
    async with client_for(create_app(engine, ServerSettings(default_max_tokens=4))) as client:
        yield client


def sse(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), [
    ("/v1/chat/completions", {"messages": HI, "bogus": 1, "other": 2}, 400, "unknown_parameter", "bogus"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2048}, 400, "invalid_value", "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": "many"}, 400, "invalid_value", "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "temperature": 5}, 400, "invalid_value", "temperature"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "invalid_value",
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, 400, "unsupported_parameter", "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "presence_penalty": 2.5}, 400, "invalid_value", "presence_penalty"),
    ("/v1/chat/completions", {"messages": HI, "n": 17}, 400, "invalid_value", "n"),
    ("/v1/chat/completions", {"messages": HI, "n": 16, "max_tokens": 1000}, 400, "invalid_value", "n"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"abc": 1}}, 400, "invalid_value", "logit_bias"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"5": 150}}, 400, None, None),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"99999999": 1}}, 400, None, None),
    ("/v1/chat/completions", {"messages": HI, "min_tokens": 3}, 400, "unsupported_parameter", "min_tokens"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "xml"}}, 400, "invalid_value",
     "response_format"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, 400, None, None),
    ("/v1/chat/completions", {"messages": HI, "structured_outputs": {"regex": "(("}}, 400, None, None),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": 5}}}]}, 400, "invalid_value", "tools"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "invalid_value",
     "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "functions": [{"name": "f"}]}, 400, "unsupported_parameter",
     "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None,
                                            "tool_calls": [{"id": "1", "type": "function"}]}]}, 400, None,
     "messages[0].tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value", None),
    ("/v1/chat/completions", {"messages": HI, "reuse": "fuzzy"}, 400, "invalid_value", "reuse"),
    ("/v1/chat/completions", {"messages": HI, "seed": 1 << 64}, 400, "invalid_value", "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "invalid_value",
     "messages[0].content[0].text"),
    ("/v1/completions", {"prompt": "hi", "seed": -(1 << 63) - 1}, 400, "invalid_value", "seed"),
    ("/v1/chat/completions", {"messages": HI, "cache_salt": "s" * 300}, 400, "invalid_value", "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}], "documents": [DOC]}, 400, None,
     "documents"),
    ("/v1/chat/completions", {"messages": HI, "model": "nope"}, 404, "model_not_found", "model"),
    ("/v1/chat/completions", [1, 2], 400, "invalid_value", None),
    ("/v1/completions", {"prompt": [1, 2, 3]}, 400, "unsupported_parameter", "prompt"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "unsupported_parameter", "echo"),
    ("/v1/completions", {"prompt": "word " * 3000, "max_tokens": 4}, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, None, "prompt"),
    ("/v1/nothing", {}, 404, "not_found", None),
])
async def test_bad_requests_are_openai_errors(api, path, body, status, code, param):
    assert_error(await api.post(path, json=body), status, code, param)
    assert (await api.get("/health")).json()["status"] == "ok"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "h\\ud800i"}], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "h\\udfffi", "max_tokens": 2}'),
    ("/tokenize", b'{"prompt": "h\\ud800i"}'),
    ("/v1/embeddings", b'{"input": ["ok", "h\\ud800i"]}'),
])
async def test_a_lone_surrogate_in_text_is_a_400_not_a_crash(api, path, body):
    """JSON's \\uXXXX escapes can carry half a UTF-16 pair, which no tokenizer takes."""
    error = assert_error(await api.post(path, content=body, headers={"content-type": "application/json"}), 400,
                         "invalid_value")
    assert "surrogate" in error["message"]
    ok = await api.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


async def test_seeds_at_the_ends_of_the_64_bit_range_are_served_for_every_choice(api):
    for seed in ((1 << 64) - 1, -(1 << 63)):
        response = await api.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "n": 2, "seed": seed,
                                                                "temperature": 1.0})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2


async def test_a_huge_prompt_is_tokenized_off_the_event_loop(api):
    """A multi-megabyte body takes seconds to tokenize before it is refused as too long: /health
    and other requests are answered meanwhile (it ran on the event loop and stalled them all)."""
    import asyncio

    big = asyncio.ensure_future(api.post("/v1/completions", json={"prompt": "word " * 400_000, "max_tokens": 2}))
    await asyncio.sleep(0.05)
    health = await api.get("/health")
    assert health.status_code == 200 and not big.done()  # answered while the big prompt was still being tokenized
    assert_error(await big, 400, "context_length_exceeded", "prompt")
    ok = await api.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


async def test_standard_client_fields_are_accepted(api):
    body = {"messages": [{"role": "developer", "content": "Be brief."}, *HI], "n": 1, "user": "u", "seed": 3,
            "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "response_format": {"type": "text"},
            "parallel_tool_calls": True, "tool_choice": "none", "stream_options": None, "store": False,
            "metadata": {"a": "b"}, "stop": ["\n\n"], "top_p": 0.9, "max_completion_tokens": 3}
    response = await api.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion" and data["usage"]["completion_tokens"] <= 3
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]
    assert set(data["ragcache"]) >= {"computed_tokens", "recomputed_tokens", "chunk_cached_tokens", "device_hits",
                                     "host_hits", "documents"}


async def test_streaming_shapes(api):
    response = await api.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "stream": True,
                                                            "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["ragcache"] is not None
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    response = await api.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "stream": True})
    chunks = [json.loads(e) for e in sse(response.text)[:-1]]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)


async def test_vllm_extensions_return_token_ids_and_kv_transfer_params(api, engine):
    """vLLM's ``return_token_ids`` is honoured (streamed: every id in the finishing chunk) and its
    ``kv_transfer_params`` accepted, so clients written for vLLM (our adapters' base_url mode) work."""
    body = {"messages": HI, "max_tokens": 4, "return_token_ids": True, "kv_transfer_params": {"any": "thing"}}
    data = (await api.post("/v1/chat/completions", json=body)).json()
    ids = data["choices"][0]["token_ids"]
    assert len(ids) == data["usage"]["completion_tokens"] == 4
    assert engine.loaded.tokenizer.decode(ids) == data["choices"][0]["message"]["content"]
    plain = (await api.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4})).json()
    assert plain["choices"][0].get("token_ids") is None
    streamed = await api.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(e) for e in sse(streamed.text)[:-1]]
    assert [c["choices"][0].get("token_ids") for c in chunks if c["choices"][0]["finish_reason"]] == [ids]
    assert sum(len(c["choices"][0].get("token_ids") or ()) for c in chunks) == 4
    done = await api.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "return_token_ids": True})
    assert len(done.json()["choices"][0]["token_ids"]) == 2
    models = (await api.get("/v1/models")).json()
    assert models["data"][0]["max_model_len"] == engine.loaded.context_window
    name = models["data"][0]["id"]  # one model: the SDK's models.retrieve(name), and 404 for any other
    assert (await api.get(f"/v1/models/{name}")).json() == models["data"][0]
    assert_error(await api.get("/v1/models/not-this-one"), 404, "model_not_found", "model")


async def test_documents_inserted_and_recognised(api):
    body = {"messages": HI, "max_tokens": 2, "documents": [{"id": "rail", "text": DOC}, DOC.upper()]}
    first = (await api.post("/v1/chat/completions", json=body)).json()
    assert first["ragcache"]["documents"] == ["rail", cli_content_id(DOC.upper())]
    again = (await api.post("/v1/chat/completions", json=body)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    clash = await api.post("/v1/chat/completions", json={**body, "documents": [{"id": "rail", "text": DOC[::-1]}]})
    assert_error(clash, 400, param="documents[0].id")


def cli_content_id(text: str) -> str:
    from ragcache_backend.retrieval.documents import content_id

    return content_id(text)


async def test_api_key_and_drain(engine):
    app = create_app(engine, ServerSettings(api_key="s3cret", default_max_tokens=2))
    async with client_for(app) as api:
        assert_error(await api.get("/v1/models"), 401, "invalid_api_key")
        assert_error(await api.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        ok = await api.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.json()["data"][0]["id"] == "tiny-llama"
        assert (await api.get("/metrics")).status_code == 200  # no key needed
        app.state.service.begin_drain()
        assert_error(await api.post("/v1/chat/completions", json={"messages": HI},
                                    headers={"Authorization": "Bearer s3cret"}), 503, "shutting_down")
        health = await api.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"


async def test_busy_server_answers_503(engine):
    app = create_app(engine, ServerSettings(max_batch_size=1, max_queue=0, served_model_name="house-model"))
    service = app.state.service
    async with client_for(app) as api:
        body = {"model": "house-model", "messages": HI, "max_tokens": 512, "stream": True}
        # hold one request open (its first chunk received), as a slow streaming client would
        events = await service.open_stream(service.prepare(ChatCompletionRequest(**body), None))
        try:
            assert_error(await api.post("/v1/chat/completions", json=body), 503, "server_busy")
        finally:
            await events.aclose()  # never iterated: still cancels the request and frees its slot
        assert engine.wait_idle(30) and engine.stats.cancelled >= 1
        response = await api.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        assert response.status_code == 200 and response.json()["model"] == "house-model"


async def test_each_app_has_its_own_metrics(engine):
    one, two = create_app(engine, ServerSettings()), create_app(engine, ServerSettings())
    async with client_for(one) as a, client_for(two) as b:
        await a.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1})
        text_a, text_b = (await a.get("/metrics")).text, (await b.get("/metrics")).text
    assert 'ragcache_http_requests_total{endpoint="chat.completions",status="200"} 1.0' in text_a
    assert 'endpoint="chat.completions",status="200"' not in text_b


def test_settings_precedence(tmp_path, monkeypatch):
    config = tmp_path / "serve.toml"
    config.write_text('port = 7000\nmax-queue = 3\nreuse = "chunk"\nlog_level = "debug"\n')
    monkeypatch.setenv("RAGCACHE_PORT", "7100")
    monkeypatch.setenv("RAGCACHE_REUSE", "auto")
    settings = load_settings(config, reuse="exact", disk_cache=None)
    assert (settings.port, settings.max_queue, settings.reuse, settings.log_level) == (7100, 3, "exact", "debug")
    assert settings.engine_config().disk_dir == settings.disk_dir and settings.disk_dir is not None
    assert load_settings(None, disk_cache=False).engine_config().disk_dir is None
    assert settings.engine_config().host_commit == "background"  # a server commits its host tier from start
    monkeypatch.setenv("RAGCACHE_HOST_COMMIT", "lazy")
    assert load_settings(None).engine_config().host_commit == "lazy"
    assert load_settings(None, host_commit="background").engine_config().host_commit == "background"
    (tmp_path / "serve.json").write_text(json.dumps({"port": 7200, "api_key": "k"}))
    monkeypatch.delenv("RAGCACHE_PORT")
    from_json = load_settings(tmp_path / "serve.json")
    assert from_json.port == 7200 and from_json.api_key.get_secret_value() == "k"
    (tmp_path / "bad.toml").write_text("colour = 'blue'\n")
    with pytest.raises(InvalidRequestError, match="colour"):
        load_settings(tmp_path / "bad.toml")
    with pytest.raises(InvalidRequestError, match="max_queue"):
        load_settings(None, max_queue=-1)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


@pytest.mark.parametrize(("argv", "needle"), [
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-queue", "-1"], "--max-queue"),
    (["serve", "--dtype", "int4"], "unknown dtype"),
    (["serve", "--log-level", "loud"], "unknown log level"),
    (["serve", "--model", "/no/such/model"], "does not exist"),
    (["serve", "/no/such/model"], "packaged model"),
    (["serve", "smollm2", "--model", "/tmp"], "two models given"),
    (["serve", "--config", "/no/such/file.toml"], "--config"),
    (["ask", "q", "--disk-budget-mib", "-1"], "--disk-budget-mib"),
    (["serve", "--host-commit", "eager"], "unknown host commit"),
])
def test_serve_options_checked_before_loading(capsys, monkeypatch, argv, needle):
    monkeypatch.setattr(cli, "_engine", lambda *a, **k: pytest.fail("the model must not load"))
    code, _, stderr = run_cli(capsys, *argv)
    assert code == 2 and stderr.startswith("error: ") and needle in stderr and len(stderr.strip().splitlines()) == 1


def test_serve_bad_env_and_busy_port(capsys, monkeypatch):
    import socket

    monkeypatch.setattr(cli, "_engine", lambda *a, **k: pytest.fail("the model must not load"))
    monkeypatch.setenv("RAGCACHE_MAX_BATCH_SIZE", "zero")
    code, _, stderr = run_cli(capsys, "serve")
    assert code == 2 and "max_batch_size" in stderr
    monkeypatch.delenv("RAGCACHE_MAX_BATCH_SIZE")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, stderr = run_cli(capsys, "serve", "--port", str(taken.getsockname()[1]))
    assert code == 2 and "cannot listen" in stderr


def test_version(capsys):
    from importlib.metadata import version

    code, stdout, _ = run_cli(capsys, "--version")
    assert code == 0 and stdout.strip() == f"ragcache {version('ragcache-kv')}"


async def test_vllm_sampling_fields_and_harmless_extras_are_accepted(api):
    body = {"messages": HI, "max_tokens": 3, "temperature": 0.8, "seed": 1, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"17": -5},
            "request_id": "r1", "priority": 0, "skip_special_tokens": True, "spaces_between_special_tokens": False,
            "chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": False, "min_tokens": 0}
    response = await api.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    again = await api.post("/v1/chat/completions", json=body)
    assert again.json()["choices"][0]["message"] == response.json()["choices"][0]["message"]  # seeded


async def test_logit_bias_forces_a_token(api, engine):
    token = engine.loaded.tokenizer.encode(" river", add_special_tokens=False)[0]
    data = (await api.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "return_token_ids": True,
                                                         "logit_bias": {str(token): 100}})).json()
    assert data["choices"][0]["token_ids"] == [token] * 4


async def test_logprobs_chat_and_completion(api, engine):
    data = (await api.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "logprobs": True,
                                                         "top_logprobs": 3})).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == data["usage"]["completion_tokens"] == 4
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["logprob"] == entry["logprob"] <= 0
        assert bytes(entry["bytes"]).decode() == entry["token"]
    assert "".join(e["token"] for e in content) == data["choices"][0]["message"]["content"]
    data = (await api.post("/v1/completions", json={"prompt": "The river", "max_tokens": 3, "logprobs": 2})).json()
    lp = data["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert lp["text_offset"][0] == 0 and all(len(t) == 2 for t in lp["top_logprobs"])


async def test_n_choices_plain_and_streamed(api):
    body = {"messages": HI, "max_tokens": 3, "n": 3, "temperature": 1.0, "seed": 5}
    data = (await api.post("/v1/chat/completions", json=body)).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert data["usage"]["completion_tokens"] == 9
    assert len({c["message"]["content"] for c in data["choices"]}) > 1  # seeds 5, 6, 7
    response = await api.post("/v1/chat/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in sse(response.text)[:-1]]
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert finished == {0, 1, 2} and chunks[-1]["usage"]["completion_tokens"] == 9
    assert texts == {c["index"]: c["message"]["content"] for c in data["choices"]}


async def test_structured_outputs_hold_a_random_model_to_the_grammar(api):
    data = (await api.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 8,
                                                         "structured_outputs": {"choice": ["yes", "no"]}})).json()
    assert data["choices"][0]["message"]["content"] in {"yes", "no"}
    assert data["choices"][0]["finish_reason"] == "stop"
    data = (await api.post("/v1/completions", json={"prompt": "Code:", "max_tokens": 8,
                                                    "structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})).json()
    assert len(data["choices"][0]["text"]) == 4 and data["choices"][0]["text"][:2].isupper()


TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_required_tool_call_is_well_formed_even_from_a_random_model(api, stream):
    body = {"messages": HI, "max_tokens": 60, "tools": [TOOL], "tool_choice": "required",
            "parallel_tool_calls": False, "stream": stream}
    response = await api.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(e) for e in sse(response.text)[:-1]]
        calls = [c for chunk in chunks for ch in chunk["choices"] for c in (ch["delta"].get("tool_calls") or [])]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        message = response.json()["choices"][0]["message"]
        calls, finish = message["tool_calls"], response.json()["choices"][0]["finish_reason"]
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["function"]["name"] == "pick" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["function"]["arguments"])["colour"] in {"red", "green"}


async def test_a_tool_conversation_renders_calls_and_results(api):
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "pick", "arguments": '{"colour": "red"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "picked red"}]
    response = await api.post("/v1/chat/completions", json={"messages": messages, "tools": [TOOL], "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in {"length", "stop", "tool_calls"}


async def test_tokenize_and_detokenize(api, engine):
    data = (await api.post("/tokenize", json={"prompt": "Hello there"})).json()
    assert data["tokens"] == engine.loaded.tokenizer.encode("Hello there", add_special_tokens=False)
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == engine.loaded.context_window
    chat = (await api.post("/tokenize", json={"messages": HI})).json()
    served = (await api.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1})).json()
    assert chat["count"] == served["usage"]["prompt_tokens"]  # the prompt generation sees
    back = (await api.post("/detokenize", json={"tokens": data["tokens"]})).json()
    assert back["prompt"] == "Hello there"
    assert_error(await api.post("/detokenize", json={"tokens": [10**9]}), 400, "invalid_value", "tokens")
    assert_error(await api.post("/tokenize", json={}), 400, None, "prompt")
    assert_error(await api.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, "model_not_found")


async def test_embeddings_are_the_retrieval_embedders(api):
    import base64

    import numpy as np

    from ragcache_backend.retrieval.embedder import Embedder

    texts = ["How do I copy a list?", "Tuples are immutable."]
    data = (await api.post("/v1/embeddings", json={"input": texts})).json()
    assert [d["index"] for d in data["data"]] == [0, 1] and data["usage"]["prompt_tokens"] > 0
    expect = Embedder().embed(texts)
    got = np.array([d["embedding"] for d in data["data"]], dtype=np.float32)
    assert np.allclose(got, expect, atol=1e-5)
    b64 = (await api.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64",
                                                  "model": data["model"]})).json()
    assert np.allclose(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4"), expect[0], atol=1e-5)
    assert_error(await api.post("/v1/embeddings", json={"input": ["ok", ""]}), 400, "invalid_value", "input")
    assert_error(await api.post("/v1/embeddings", json={"input": "x", "dimensions": 8}), 400,
                 "unsupported_parameter", "dimensions")
    assert_error(await api.post("/v1/embeddings", json={"input": "x", "model": "ada"}), 404, "model_not_found")


async def test_a_bad_choice_among_several_fails_the_request_and_frees_the_others(api, engine):
    """n=3 with a grammar that compiles for none: a 400, and nothing left running."""
    response = await api.post("/v1/chat/completions", json={"messages": HI, "n": 3, "max_tokens": 4,
                                                            "structured_outputs": {"grammar": "start: ???"}})
    assert_error(response, 400)
    assert (await api.get("/health")).json()["in_flight"] == 0 and engine.in_flight == 0


async def test_several_choices_compute_the_prompt_once(api):
    """n=3 over a fresh prompt: submitted together, one choice prefills it and the other two reuse
    its blocks (the server's computed-token counter grows by about one prompt, not three)."""
    import re

    async def counter() -> float:
        text = (await api.get("/metrics")).text
        found = re.search(r'^ragcache_prompt_tokens_computed_total\{endpoint="chat.completions"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    body = {"messages": [{"role": "user", "content": "A fresh prompt about herons and slate quarries. " * 8}],
            "max_tokens": 2, "n": 3, "temperature": 1.0, "seed": 1}
    before = await counter()
    data = (await api.post("/v1/chat/completions", json=body)).json()
    assert len(data["choices"]) == 3
    prompt = data["usage"]["prompt_tokens"]
    assert await counter() - before < 1.5 * prompt, (prompt, await counter() - before)
