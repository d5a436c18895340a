"""``ragcache serve`` as a real process (SmolLM2-135M, fp32) driven by real OpenAI clients: the
``openai`` SDK (sync, async, streaming), LangChain's ``ChatOpenAI`` and LlamaIndex's ``OpenAILike``.

One server per module (the model loads once). The last test stops it with SIGTERM while a request
is in flight. Every request generates at most 16 tokens.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest

from ragcache_backend.retrieval.documents import content_id

pytestmark = pytest.mark.model

DOC_A = (
    "The Larkspur Valley Railway was a narrow-gauge line opened in 1887 to carry slate from the quarries "
    "at Upper Larkspur down to the harbour at Merrow. Its locomotives were small tank engines built in "
    "Leeds, each named after a local bird: Kestrel, Curlew, Heron and Wagtail. Passenger services began "
    "in 1891 and the line closed to all traffic in 1946, when the last quarry shut. Volunteers reopened "
    "three miles of track as a heritage railway in 1978, and Curlew still runs on summer weekends."
)
DOC_B = (
    "Merrow harbour has a tidal range of almost seven metres, one of the largest on the western coast. "
    "Its stone breakwater, finished in 1864, shelters a basin where slate ships once waited for the tide. "
    "The harbour master's office keeps a brass tide gauge installed in 1870 that is still read every "
    "morning at six. Today the basin holds fishing boats and a small lifeboat station, and the old slate "
    "wharf has become a promenade with a museum about the railway and the quarrying families."
)
IDS = [content_id(DOC_A), content_id(DOC_B)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.compile(rf"^{re.escape(name)}(\{{{re.escape(want)}\}})? (\S+)$" if want else rf"^{re.escape(name)} (\S+)$",
                         re.M)
    m = pattern.search(text)
    return float(m.groups()[-1]) if m else 0.0


def ask(client, question: str, **kw):
    return client.chat.completions.create(
        model=kw.pop("model", None) or openai.NOT_GIVEN, messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS, temperature=0, **kw)


def test_models_and_health(server, model_name):
    assert "SmolLM2" in model_name
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == model_name and health["in_flight"] == 0


def test_kept_alive_connection_answers_without_nagle_delay(server):
    """Every request on one kept-alive connection is answered at once: with Nagle's algorithm on
    (a listening socket made with protocol 0, which asyncio does not set TCP_NODELAY on) a response
    body written after its headers waited for the client's delayed ACK, >= 40 ms each time."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    took = []
    try:
        for _ in range(7):
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["status"] == "ok"
            took.append(time.perf_counter() - t0)
    finally:
        conn.close()
    assert sorted(took)[3] < 0.03, f"median {sorted(took)[3] * 1000:.1f} ms per request on a kept-alive connection"


def test_documents_are_recognised_and_reused(client, model_name):
    docs = {"documents": [DOC_A, {"id": "merrow-harbour", "text": DOC_B}]}
    first = ask(client, "When did the railway close?", model=model_name, extra_body=docs)
    assert first.choices[0].message.content.strip()
    info = first.model_extra["ragcache"]
    assert info["documents"] == [IDS[0], "merrow-harbour"]
    assert first.usage.prompt_tokens > 150
    # an exact repeat: everything but the last prompt token comes from the cache
    again = ask(client, "When did the railway close?", extra_body=docs)
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    # another question over the same documents, this time pasted in the message text (no extra body):
    # recognised, and their KV reused
    pasted = ask(client, f"{DOC_A}\n\n{DOC_B}\n\nHow large is the tidal range at Merrow?")
    assert pasted.model_extra["ragcache"]["documents"] == [IDS[0], "merrow-harbour"]
    assert pasted.usage.prompt_tokens_details.cached_tokens > 100
    assert pasted.choices[0].message.content.strip()


async def test_async_streaming_with_usage(server, model_name):
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=model_name, max_tokens=MAX_TOKENS, temperature=0, extra_body={"documents": [DOC_A, DOC_B]},
                  messages=[{"role": "system", "content": "Answer briefly."},
                            {"role": "user", "content": [{"type": "text", "text": "Which engine still runs?"}]}])
    for attempt in range(2):
        stream = await aclient.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        text, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == []
        assert "".join(text).strip() and finish in ("stop", "length")
        assert usage is not None and usage.completion_tokens >= 1
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1  # the second run
    await aclient.close()


def test_completions_plain_and_streaming(client, model_name):
    prompt = "The capital of France is"
    done = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0)
    assert done.choices[0].text.strip() and done.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt=prompt, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == done.choices[0].text


def test_langchain_chat_openai(server, model_name):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=model_name, max_tokens=MAX_TOKENS,
                     temperature=0, max_retries=0, extra_body={"documents": [DOC_A, DOC_B]})
    message = llm.invoke("Name one of the locomotives.")
    assert message.content.strip()
    again = llm.invoke("Name one of the locomotives.")
    assert again.usage_metadata["input_token_details"]["cache_read"] > 100
    chunks = list(llm.stream("What is the museum about?"))
    assert "".join(c.content for c in chunks).strip()


def test_llamaindex_openai_like(server, model_name):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=model_name, api_base=f"{server.url}/v1", api_key="unused", is_chat_model=True,
                     max_tokens=MAX_TOKENS, temperature=0, max_retries=0, context_window=8192)
    reply = llm.chat([ChatMessage(role="user", content=f"{DOC_B}\n\nWhen was the breakwater finished?")])
    assert reply.message.content.strip()
    assert reply.raw.model_extra["ragcache"]["documents"] == ["merrow-harbour"]
    completion = OpenAILike(model=model_name, api_base=f"{server.url}/v1", api_key="unused", is_chat_model=False,
                            max_tokens=6, temperature=0, max_retries=0).complete("Slate is a kind of")
    assert completion.text.strip()


def test_metrics_expose_the_cache(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "ragcache_http_requests_total", endpoint="chat.completions", status="200") >= 5
    assert metric(text, "ragcache_prompt_tokens_cached_total") > 500
    assert metric(text, "ragcache_prompt_tokens_computed_total") > 0
    assert metric(text, "ragcache_generation_tokens_total") > 0
    assert metric(text, "ragcache_cache_hits_total", tier="device") > 0
    assert metric(text, "ragcache_cache_bytes", tier="device") > 0
    assert "ragcache_cache_hits_total{tier=\"disk\"}" in text and "ragcache_cache_evictions_total" in text
    assert "ragcache_cache_swap_outs_total" in text
    assert metric(text, "ragcache_cache_disk_writes_total") > 0 and metric(text, "ragcache_cache_disk_files") > 0
    for tier in ("device", "host", "disk"):
        assert 0 <= metric(text, "ragcache_cache_bytes", tier=tier) <= metric(text, "ragcache_cache_budget_bytes", tier=tier)
    assert metric(text, "ragcache_time_to_first_token_seconds_count", endpoint="chat.completions") >= 5
    assert "ragcache_queue_length 0.0" in text and "ragcache_running_batch_size 0.0" in text


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    (b"{not json", 400, "invalid_json", None),
    ({"messages": [{"role": "user", "content": "hi"}], "bogus": 1}, 400, "unknown_parameter", "bogus"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "invalid_value", "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9}, 400, "invalid_value",
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 404, "model_not_found", "model"),
    ({"messages": [{"role": "user", "content": "lorem ipsum " * 5000}], "max_tokens": 4}, 400,
     "context_length_exceeded", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400,
     "unsupported_content", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 99}, 400, "invalid_value", "n"),
    ({"messages": []}, 400, "invalid_value", "messages"),
])
def test_bad_input_is_an_openai_error(server, body, status, code, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code and error["param"] == param
    assert httpx.get(f"{server.url}/health").json() | {"in_flight": 0} == httpx.get(f"{server.url}/health").json()


def test_client_disconnect_cancels_the_request(server, model_name):
    before = metric(httpx.get(f"{server.url}/metrics").text, "ragcache_engine_requests_total", outcome="cancelled")
    body = {"model": model_name, "messages": [{"role": "user", "content": "Write a very long story about a train."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # the first generated text: walk away
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.url}/health").json()
        if health["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert health == {**health, "status": "ok", "in_flight": 0, "running": 0, "waiting": 0}
    after = metric(httpx.get(f"{server.url}/metrics").text, "ragcache_engine_requests_total", outcome="cancelled")
    assert after == before + 1
    assert "499" in httpx.get(f"{server.url}/metrics").text
    assert ask(openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0), "Say hi.").choices[0].message.content


def test_a_non_streaming_client_that_disconnects_cancels_its_request(server, model_name):
    before = metric(httpx.get(f"{server.url}/metrics").text, "ragcache_engine_requests_total", outcome="cancelled")
    body = {"model": model_name, "messages": [{"role": "user", "content": "Write a very long story about a ship."}],
            "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 400 tokens are generated
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(f"{server.url}/health").json()["in_flight"]:
        time.sleep(0.2)
    assert httpx.get(f"{server.url}/health").json()["in_flight"] == 0
    after = metric(httpx.get(f"{server.url}/metrics").text, "ragcache_engine_requests_total", outcome="cancelled")
    assert after == before + 1


def test_cache_salt_isolates_tenants(client, server):
    doc = f"Tenant note {uuid.uuid4()}: " + DOC_A.replace("slate", "granite")
    body = dict(extra_body={"documents": [doc]})
    a1 = ask(client, "What did the railway carry?", extra_body={**body["extra_body"], "cache_salt": "tenant-a"})
    a2 = ask(client, "What did the railway carry?", extra_body={**body["extra_body"], "cache_salt": "tenant-a"})
    b1 = ask(client, "What did the railway carry?", extra_headers={"X-Cache-Salt": "tenant-b"}, **body)
    assert a1.usage.prompt_tokens_details.cached_tokens == 0
    assert a2.usage.prompt_tokens_details.cached_tokens >= a2.usage.prompt_tokens - 1
    assert b1.usage.prompt_tokens_details.cached_tokens == 0
    assert b1.choices[0].message.content == a1.choices[0].message.content


async def test_200_concurrent_streaming_clients_get_an_answer_or_a_clear_error(server, model_name):
    """A bounded burst on loopback: 200 streams at once against a server that admits a batch of 8 plus
    a queue of 64. Every client gets its answer or a 503 in the OpenAI shape; afterwards nothing is in
    flight, no tier is over its budget, and a second burst leaves the server's memory where the
    first left it (the cache's tiers are full by then: what grows after that is a leak)."""
    def rss_mib() -> float:
        for line in open(f"/proc/{server.process.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": model_name, "stream": True, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": f"Say a number. Client {i % 40}."}]}
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                error = json.loads(await resp.aread())["error"]
                assert resp.status_code == 503 and error["code"] == "server_busy" and error["message"]
                return "busy"
            lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
            return "answered"

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    memory = []
    for _ in range(2):
        # a client (connection pool) per burst: a connection kept alive from the first burst may be
        # closed by the server's keep-alive timeout just as the second burst sends on it (a reset
        # that no server could avoid); every burst opens its 200 connections afresh
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
            outcomes = await asyncio.gather(*(one(client, i) for i in range(200)))
        print("outcomes:", outcomes.count("answered"), "answered,", outcomes.count("busy"), "busy")
        assert outcomes.count("answered") >= 72 and set(outcomes) <= {"answered", "busy"}
        memory.append(rss_mib())
    health = httpx.get(f"{server.url}/health").json()
    assert health["in_flight"] == 0 and health["waiting"] == 0 and health["running"] == 0
    text = httpx.get(f"{server.url}/metrics").text
    for tier in ("device", "host", "disk"):
        assert metric(text, "ragcache_cache_bytes", tier=tier) <= metric(text, "ragcache_cache_budget_bytes", tier=tier)
    print("rss after bursts (MiB):", memory)
    assert memory[1] - memory[0] < 64, memory  # MiB: no growth once a burst has run


def test_sigterm_drains_the_request_in_flight(server, model_name):
    """Last test of the module: it stops the server."""
    body = {"model": model_name, "messages": [{"role": "user", "content": "Tell me about trains."}],
            "max_tokens": 24, "temperature": 0, "stream": True}
    events: list[str] = []
    started = threading.Event()

    def consume():
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(60)
    server.process.send_signal(signal.SIGTERM)
    reader.join(120)
    assert server.process.wait(90) == 0, server.logs()[-3000:]
    assert events[-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-1] if json.loads(e)["choices"]]
    assert finish[-1] == "length"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.url}/health", timeout=2)
