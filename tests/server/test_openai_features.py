"""What clients written for OpenAI and vLLM expect of a model server, against a real ``ragcache
serve`` (SmolLM2-135M, fp32) driven by the ``openai`` SDK: structured output that validates,
tool calls (auto, required, named; plain and streamed; a follow-up turn with the tool's result),
log-probabilities, several choices, penalties and vLLM's sampling fields."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.model

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "city": {"type": "string", "maxLength": 24}}}
NAMES = ["Ada", "Bram", "Chen", "Dara", "Emil", "Fatou", "Gus", "Hana", "Ivo", "Jun", "Kemal", "Lior", "Mina",
         "Noor", "Olek", "Pia", "Quinn", "Rosa", "Sami", "Tove"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_json_schema_output_validates_on_20_of_20_prompts(aclient):
    async def one(name: str):
        return await aclient.chat.completions.create(
            model=openai.NOT_GIVEN, max_tokens=80, temperature=0,
            messages=[{"role": "user", "content": f"Invent a person called {name}: give name, age and city as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})

    async def all_of():
        return await asyncio.gather(*(one(n) for n in NAMES))

    answers = asyncio.run(all_of())
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)


def test_json_object_mode(client):
    answer = client.chat.completions.create(messages=[{"role": "user", "content": "A JSON object about a cat."}],
                                            max_tokens=80, temperature=0, response_format={"type": "json_object"},
                                            model=openai.NOT_GIVEN)
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_and_validate(client, choice):
    answer = client.chat.completions.create(messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80,
                                            temperature=0, model=openai.NOT_GIVEN)
    out = answer.choices[0]
    assert out.finish_reason == "tool_calls" and out.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in out.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(choice, dict):
        assert {c.function.name for c in out.message.tool_calls} == {"get_weather"}


def test_streamed_tool_call_and_the_turn_after_it(client):
    stream = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80,
                                            temperature=0, stream=True, model=openai.NOT_GIVEN,
                                            parallel_tool_calls=False)
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "get_weather"
    arguments = json.loads(calls[0]["arguments"])
    follow = client.chat.completions.create(model=openai.NOT_GIVEN, tools=[WEATHER], max_tokens=24, temperature=0, messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temperature": 18, "sky": "clear"}'}])
    assert follow.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    # the tool block is a stable prefix: the follow-up turn reuses the first turn's KV
    assert follow.usage.prompt_tokens_details.cached_tokens > 0


def test_auto_tool_choice_answers_text_or_a_valid_call(client):
    answer = client.chat.completions.create(messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
                                            model=openai.NOT_GIVEN)
    out = answer.choices[0]
    if out.message.tool_calls:
        assert out.finish_reason == "tool_calls"
        for call in out.message.tool_calls:
            assert call.function.name in {"get_weather", "get_time"} and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert out.message.content


def test_logprobs_and_several_choices(client):
    answer = client.chat.completions.create(messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=3, model=openai.NOT_GIVEN)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert all(c.logprob == c.top_logprobs[0].logprob and len(c.top_logprobs) == 3 for c in content)
    many = client.chat.completions.create(messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
                                          temperature=1.0, seed=11, n=4, model=openai.NOT_GIVEN)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == answer.usage.prompt_tokens
    assert len({c.message.content for c in many.choices}) > 1


def _named_bytes(name: str) -> bytes:
    """A logprobs token name back to its bytes (``bytes:\\xNN...`` for part of a character)."""
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
    return name.encode("utf-8")


def test_logprobs_of_tokens_inside_a_character_carry_their_real_bytes(client):
    """SmolLM2 spells an emoji or an accented capital over several tokens, each part of one UTF-8
    character: each token's ``bytes`` are its own (they join into the answer's text), its name is
    ``bytes:\\xNN...`` as OpenAI's, and a completion's ``text_offset`` stays within the text."""
    forced = {"structured_outputs": {"regex": "\U0001F409\u00c0 ok"}}
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Draw a dragon."}], max_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=2, model=openai.NOT_GIVEN,
                                          extra_body=forced)
    text, content = chat.choices[0].message.content, chat.choices[0].logprobs.content
    assert text == "\U0001F409\u00c0 ok" and len(content) > 3  # the emoji and the letter take several tokens
    assert b"".join(bytes(c.bytes) for c in content) == text.encode("utf-8")
    assert all(_named_bytes(c.token) == bytes(c.bytes) and "\ufffd" not in c.token for c in content)
    assert any(c.token.startswith("bytes:\\x") for c in content)
    assert all(_named_bytes(t.token) == bytes(t.bytes) for c in content for t in c.top_logprobs)
    done = client.completions.create(prompt="A dragon:", max_tokens=12, temperature=0, logprobs=1,
                                     model=openai.NOT_GIVEN, extra_body=forced)
    text, lp = done.choices[0].text, done.choices[0].logprobs
    assert text == "\U0001F409\u00c0 ok" and b"".join(_named_bytes(t) for t in lp.tokens) == text.encode("utf-8")
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0 and lp.text_offset[-1] < len(text)
    raw = [_named_bytes(t) for t in lp.tokens]  # each offset: the characters its predecessors complete
    assert lp.text_offset == [len(b"".join(raw[:i]).decode("utf-8", errors="ignore")) for i in range(len(raw))]


def test_penalties_reduce_repetition(client):
    """Greedy SmolLM2 lists the days of the week over and over (the same token 20 times in 48);
    the frequency and repetition penalties break the loop."""
    prompt = [{"role": "user", "content": "List the days of the week, then list them again, and again."}]

    def repeats(**extra) -> int:
        answer = client.chat.completions.create(messages=prompt, max_tokens=48, temperature=0,
                                                model=openai.NOT_GIVEN, extra_body={"return_token_ids": True, **extra})
        return Counter(answer.choices[0].model_extra["token_ids"]).most_common(1)[0][1]

    plain = repeats()
    assert plain >= 10
    assert repeats(frequency_penalty=1.5) < plain / 2
    assert repeats(repetition_penalty=1.8) < plain / 2
    vllm_style = client.chat.completions.create(messages=prompt, max_tokens=8, temperature=0.7, seed=1,
                                                model=openai.NOT_GIVEN,
                                                extra_body={"top_k": 20, "min_p": 0.05, "request_id": "x"})
    assert vllm_style.choices[0].message.content


def test_completions_with_vllm_structured_outputs(client):
    answer = client.completions.create(prompt="Is water wet? Answer:", max_tokens=4, temperature=0,
                                       model=openai.NOT_GIVEN, extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert answer.choices[0].text in {" yes", " no"}


def test_embeddings_and_tokenize_for_openai_and_vllm_clients(client, server):
    import httpx

    from ragcache_backend.retrieval.embedder import DEFAULT_EMBEDDER_NAME

    vectors = client.embeddings.create(input=["a list", "a tuple"], model=DEFAULT_EMBEDDER_NAME)
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 384
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"] == "Hello"
