"""The adapters' ``base_url=`` mode against a real ``ragcache serve`` on loopback (default model).

Sending generation to a server keeps what the adapters add over a plain OpenAI client: the
documents found in the prompt travel with it and are reused by the server, the cache figures come
back in the response metadata, and our retrievers' speculative pipelining runs as streamed
requests that are cancelled by closing them. Answers equal the embedded engine's (greedy, fp32).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from llama_index.core.base.llms.types import ChatMessage
from pydantic import ValidationError

from ragcache_backend.errors import InvalidRequestError
from ragcache_integrations import GenerationTimeoutError, ServerError
from ragcache_integrations._speculation import speculation_board
from ragcache_integrations.langchain import ChatRAGCache, RAGCacheLLM, RAGCacheRetriever
from ragcache_integrations.llamaindex import RAGCacheLLM as LlamaLLM
from ragcache_integrations.llamaindex import RAGCacheQueryEngine
from ragcache_integrations.llamaindex import RAGCacheRetriever as LlamaRetriever
from tests.integrations.rag_prompts import RLM_RAG_PROMPT, format_docs
from tests.server.conftest import start_server, stop_server

pytestmark = [pytest.mark.model, pytest.mark.slow]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    running = start_server(tmp_path_factory.mktemp("serve"))
    yield running
    stop_server(running)


@pytest.fixture()
def base_url(served) -> str:
    return f"{served.url}/v1"


def idle(served, timeout: float = 20.0) -> dict:
    """The server's /health once nothing is in flight (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{served.url}/health").json()
        if health["in_flight"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def rag_chain(retriever, llm):
    prompt = ChatPromptTemplate.from_messages([("human", RLM_RAG_PROMPT)])
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm


def test_chat_answers_equal_the_embedded_engine_and_documents_are_reused(engine, faq_store, faq_questions, base_url):
    remote = rag_chain(RAGCacheRetriever(store=faq_store, k=3, speculate=False),
                       ChatRAGCache(base_url=base_url, max_tokens=MAX_TOKENS))
    local = rag_chain(RAGCacheRetriever(store=faq_store, k=3, speculate=False),
                      ChatRAGCache(engine=engine, max_tokens=MAX_TOKENS))
    question = faq_questions[3]
    first, again, want = remote.invoke(question), remote.invoke(question), local.invoke(question)
    assert first.content == again.content == want.content
    meta = first.response_metadata
    assert meta["model_name"] == "SmolLM2-135M-Instruct" and meta["finish_reason"] in ("stop", "length")
    # the retrieved documents were recognised, sent along, and recognised by the server
    assert meta["documents"] == want.response_metadata["documents"] and len(meta["documents"]) == 3
    assert first.usage_metadata["input_tokens"] == want.usage_metadata["input_tokens"]
    assert first.usage_metadata["output_tokens"] == want.usage_metadata["output_tokens"]
    cached = again.usage_metadata["input_token_details"]["cache_read"]
    assert cached >= 0.9 * again.usage_metadata["input_tokens"]  # the repeat is served from the server's cache
    assert again.response_metadata["cached_tokens"] == cached


def test_streaming_and_async_give_the_same_answer(base_url):
    llm = ChatRAGCache(base_url=base_url, max_tokens=MAX_TOKENS)
    messages = [("human", "Name three Python data types.")]
    want = llm.invoke(messages).content
    chunks = list(llm.stream(messages))
    assert "".join(c.content for c in chunks) == want and len(chunks) > 3
    assert chunks[-1].usage_metadata["output_tokens"] == MAX_TOKENS

    async def both():
        got = await llm.ainvoke(messages)
        parts = [c.content async for c in llm.astream(messages)]
        return got.content, "".join(parts)

    assert asyncio.run(both()) == (want, want)


def test_completion_llms_equal_the_embedded_engine(engine, base_url):
    prompt = "def fibonacci(n):"
    for chat_template in (True, False):
        remote = RAGCacheLLM(base_url=base_url, max_tokens=MAX_TOKENS, chat_template=chat_template)
        local = RAGCacheLLM(engine=engine, max_tokens=MAX_TOKENS, chat_template=chat_template)
        assert remote.invoke(prompt) == local.invoke(prompt)
    li_remote, li_local = LlamaLLM(base_url=base_url, max_tokens=MAX_TOKENS), LlamaLLM(engine=engine, max_tokens=MAX_TOKENS)
    assert li_remote.complete(prompt).text == li_local.complete(prompt).text
    assert li_remote.metadata.context_window == engine.loaded.context_window
    reply = li_remote.chat([ChatMessage(role="user", content="Say hello.")])
    assert reply.raw["usage"]["completion_tokens"] > 0 and "cached_tokens" in reply.raw["usage"]["prompt_tokens_details"]
    streamed = list(li_remote.stream_chat([ChatMessage(role="user", content="Say hello.")]))
    assert streamed[-1].message.content == reply.message.content


def test_lcel_chain_speculates_through_the_server(faq_store, faq_questions, base_url, served):
    llm = ChatRAGCache(base_url=base_url, max_tokens=MAX_TOKENS)
    plain = rag_chain(RAGCacheRetriever(store=faq_store, k=3, speculate=False), llm) | StrOutputParser()
    piped = rag_chain(RAGCacheRetriever(store=faq_store, k=3), llm)
    questions = faq_questions[10:13]
    expected = [plain.invoke(q) for q in questions]
    board = speculation_board()
    board.forget()
    taken = board.taken
    messages = [piped.invoke(q) for q in questions]
    assert [m.content for m in messages] == expected  # speculation never changes an answer
    assert board.taken - taken == len(questions) - 1
    for m in messages[1:]:
        meta = m.response_metadata
        assert meta["speculation_kept"] and meta["speculative_requests"] >= 1 and meta["search_s"] > 0
    assert board.posted == 0
    assert idle(served)["in_flight"] == 0  # terminated speculative streams were cancelled on the server


def test_llamaindex_query_engine_pipelines_through_the_server(faq_store, faq_questions, base_url, served):
    llm = LlamaLLM(base_url=base_url, max_tokens=MAX_TOKENS)
    retriever = LlamaRetriever(faq_store, k=3, num_stages=4)
    piped = RAGCacheQueryEngine(retriever=retriever, llm=llm)
    plain = RAGCacheQueryEngine(retriever=retriever, llm=llm, pipelined=False)
    for q in faq_questions[30:32]:
        got, want = piped.query(q), plain.query(q)
        assert got.response == want.response
        assert got.metadata["speculation_kept"] and got.metadata["speculative_requests"] >= 1
        # the kept speculative request's prefill stays in the server's cache: the plain query reuses it
        assert want.metadata["cached_tokens"] >= 0.9 * want.metadata["prompt_tokens"]
    assert idle(served)["in_flight"] == 0


def test_closing_a_stream_cancels_the_request_on_the_server(base_url, served):
    llm = ChatRAGCache(base_url=base_url, max_tokens=400)
    stream = llm.stream([("human", "Write a long story about a lighthouse keeper.")])
    next(stream), next(stream)
    stream.close()
    assert idle(served)["in_flight"] == 0


def test_timeout_cancels_and_raises(base_url, served):
    llm = ChatRAGCache(base_url=base_url, max_tokens=400, timeout=0.3, max_retries=0)
    with pytest.raises(GenerationTimeoutError):
        llm.invoke([("human", "Write a long story about a lighthouse keeper.")])
    assert idle(served)["in_flight"] == 0


def test_bad_input_gets_a_clear_typed_error(engine, base_url):
    with pytest.raises(InvalidRequestError, match="context window"):
        ChatRAGCache(base_url=base_url, max_tokens=100_000).invoke("hi")  # the server's 400, typed
    with pytest.raises(InvalidRequestError, match="use_cache=False"):
        ChatRAGCache(base_url=base_url, use_cache=False).invoke("hi")
    with pytest.raises(InvalidRequestError, match="serves"):
        ChatRAGCache(base_url=base_url).invoke("hi", model="gpt-4o")
    with pytest.raises(ValidationError, match="not both"):
        ChatRAGCache(base_url=base_url, engine=engine)
    with pytest.raises(InvalidRequestError, match="no local engine"):
        ChatRAGCache(base_url=base_url).resolved_engine()
    with pytest.raises(ServerError):  # the discard port: nothing listens there
        ChatRAGCache(base_url="http://127.0.0.1:9/v1", max_retries=0).invoke("hi")


def test_tool_calls_and_penalties_through_the_server_equal_the_embedded_engine(engine, base_url):
    """A forced tool call and the penalties travel to the server (as vLLM's ``structured_outputs``
    grammar and sampling fields) and give the embedded engine's answer."""
    from langchain_core.tools import tool

    @tool
    def magic_function(input: int) -> int:
        """Applies a magic function to an input."""
        return input + 2

    question = "What is the value of magic_function(3)? Use the tool."
    answers = []
    for kw in ({"engine": engine}, {"base_url": base_url}):
        llm = ChatRAGCache(max_tokens=48, frequency_penalty=0.5, repetition_penalty=1.1, top_k=5, **kw)
        answers.append(llm.bind_tools([magic_function], tool_choice="magic_function").invoke(question))
    embedded, served = answers
    assert served.tool_calls and [c["args"] for c in served.tool_calls] == [c["args"] for c in embedded.tool_calls]
    assert served.tool_calls[0]["name"] == "magic_function"


@pytest.mark.parametrize("method", ["json_schema", "json_mode", "function_calling"])
def test_structured_output_by_every_method_parses_and_the_server_gives_the_embedded_answer(engine, base_url, method):
    """``with_structured_output`` as ChatOpenAI's: the answer held to the schema (json_schema and,
    given a schema, json_mode) or to a forced tool call; parsed into the pydantic class, or
    None with the error kept under ``include_raw``; the same through the server. (The schema's
    maxLength keeps a 135M model's strings inside max_tokens: cut short, no JSON parses.)"""
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        """An answer to the user's question."""

        topic: str = Field(description="what the question is about", max_length=40)
        short_answer: str = Field(description="the answer in a few words", max_length=60)

    question = ("Why can a tuple be a dictionary key? Reply as a JSON object with the keys 'topic' and "
                "'short_answer'.")
    results = []
    for kw in ({"engine": engine}, {"base_url": base_url}):
        llm = ChatRAGCache(max_tokens=96, frequency_penalty=1.0, **kw)
        results.append(llm.with_structured_output(Answer, method=method, include_raw=True).invoke(question))
    embedded, served = results
    assert embedded["raw"].content == served["raw"].content
    assert [c["args"] for c in embedded["raw"].tool_calls] == [c["args"] for c in served["raw"].tool_calls]
    for result in results:
        assert isinstance(result["parsed"], Answer) and result["parsing_error"] is None
    # json_mode without a schema: any JSON object, parsed as a dict
    anything = ChatRAGCache(engine=engine, max_tokens=96, frequency_penalty=1.0).with_structured_output(
        method="json_mode").invoke(question)
    assert isinstance(anything, dict)
    with pytest.raises(ValueError, match="method must be"):
        ChatRAGCache(engine=engine).with_structured_output(Answer, method="xml")
