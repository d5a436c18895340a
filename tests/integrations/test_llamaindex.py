"""LlamaIndex adapters: an ordinary VectorStoreIndex query engine with our LLM swapped in,
RAGCacheQueryEngine, and the LLM interface (complete, stream, chat, async) on the real model.

Usage is read the LlamaIndex way, from instrumentation events (``CacheUsageRecorder``): each LLM
response's ``raw`` holds OpenAI-style ``usage`` with ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.core.schema import NodeWithScore

from ragcache_integrations import UnsupportedContentError
from ragcache_integrations.llamaindex import (
    CacheUsageRecorder,
    RAGCacheEmbedding,
    RAGCacheLLM,
    RAGCacheQueryEngine,
    RAGCacheRetriever,
    to_llama_documents,
)

pytestmark = pytest.mark.model
QUESTIONS = 2
MAX_TOKENS = 8


@pytest.fixture
def recorder():
    recorder = CacheUsageRecorder.attach()
    yield recorder
    recorder.detach()


@pytest.fixture(scope="module")
def vector_index(faq_store) -> VectorStoreIndex:
    """An ordinary VectorStoreIndex built from (the first 40 of) our FAQ documents."""
    documents = to_llama_documents(faq_store.documents[:40])
    return VectorStoreIndex.from_documents(documents, embed_model=RAGCacheEmbedding(embedder=faq_store.embedder))


def test_as_query_engine_gets_cache_hits(engine, vector_index, faq_questions, recorder) -> None:
    engine.reset_cache()
    questions = faq_questions[:QUESTIONS]
    baseline = vector_index.as_query_engine(llm=RAGCacheLLM(engine=engine, max_tokens=MAX_TOKENS, use_cache=False),
                                            similarity_top_k=2)
    cached = vector_index.as_query_engine(llm=RAGCacheLLM(engine=engine, max_tokens=MAX_TOKENS), similarity_top_k=2)
    expected = [str(baseline.query(q)) for q in questions]
    first = [str(cached.query(q)) for q in questions]
    second = [str(cached.query(q)) for q in questions]
    usage = [raw["usage"] for raw in recorder.records]
    cached_tokens = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    print("\nLlamaIndex as_query_engine cached tokens: off", cached_tokens[:QUESTIONS],
          "pass 1", cached_tokens[QUESTIONS:2 * QUESTIONS], "pass 2",
          [(u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]) for u in usage[2 * QUESTIONS:]])
    assert len(usage) == 3 * QUESTIONS
    assert all(c == 0 for c in cached_tokens[:QUESTIONS])
    for u in usage[2 * QUESTIONS:]:
        assert u["prompt_tokens_details"]["cached_tokens"] > 0.9 * u["prompt_tokens"]
    assert all(len(raw["documents"]) == 2 for raw in recorder.records)
    assert first == expected and second == expected


class NoDocuments(BaseRetriever):
    def _retrieve(self, query_bundle) -> list[NodeWithScore]:
        return []


def test_rag_query_engine(engine, faq_store, faq_questions) -> None:
    engine.reset_cache()
    retriever = RAGCacheRetriever(faq_store, k=2)
    question = faq_questions[2]
    nodes = retriever.retrieve(question)
    assert all(isinstance(n, NodeWithScore) for n in nodes) and len(nodes) == 2
    assert [n.node.node_id for n in nodes] == [h.document.doc_id for h in faq_store.search(question, 2)]
    # not pipelined: a stale speculative prefill (other documents, same template) could cache the
    # shared prompt prefix before the first answer; pipelining is tested in test_pipelined_chains.py
    query_engine = RAGCacheQueryEngine(retriever=retriever, llm=RAGCacheLLM(engine=engine, max_tokens=MAX_TOKENS),
                                       pipelined=False)
    off_llm = RAGCacheLLM(engine=engine, max_tokens=MAX_TOKENS, use_cache=False)
    off = RAGCacheQueryEngine(retriever=retriever, llm=off_llm)
    first, second = query_engine.query(question), query_engine.query(question)
    assert first.metadata["cached_tokens"] == 0
    assert second.metadata["cached_tokens"] > 0.9 * second.metadata["prompt_tokens"]
    assert second.metadata["documents"] == [n.node.node_id for n in nodes]
    assert str(first) == str(second) == str(off.query(question))
    no_docs = RAGCacheQueryEngine(retriever=NoDocuments(), llm=RAGCacheLLM(engine=engine, max_tokens=4))
    empty = no_docs.query("What is Python?")
    assert empty.source_nodes == [] and empty.metadata["documents"] == []
    assert empty.metadata["cached_tokens"] % engine.block_tokens == 0  # only the template's blocks seen before


async def test_llm_interface(engine) -> None:
    llm = RAGCacheLLM(engine=engine, max_tokens=4)
    assert llm.metadata.is_chat_model and llm.metadata.context_window == engine.loaded.context_window
    completion = llm.complete("Say hello.")
    assert completion.text and completion.raw["usage"]["completion_tokens"] <= 4
    streamed = list(llm.stream_complete("Say hello."))
    assert streamed[-1].text == completion.text == "".join(c.delta for c in streamed)
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
                ChatMessage(role=MessageRole.USER, content="Say hello.")]
    reply = llm.chat(messages)
    assert reply.message.role == MessageRole.ASSISTANT and reply.message.content
    assert list(llm.stream_chat(messages))[-1].message.content == reply.message.content
    assert (await llm.achat(messages)).message.content == reply.message.content
    assert (await llm.acomplete("Say hello.")).text == completion.text
    chunks = [c async for c in await llm.astream_chat(messages)]
    assert chunks[-1].message.content == reply.message.content
    image = ChatMessage(role=MessageRole.USER,
                        blocks=[TextBlock(text="What is this?"), ImageBlock(url="https://example.com/a.png")])
    with pytest.raises(UnsupportedContentError, match="image"):
        llm.chat([image])


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


async def test_function_calling_llm_calls_tools_and_predicts_structures(engine) -> None:
    """RAGCacheLLM is a FunctionCallingLLM: a required call is well formed (constrained decoding)
    and carries the right arguments, plain and streamed; predict_and_call runs the tool; the tool's
    result goes back as a tool message; structured_predict fills a pydantic model."""
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools import FunctionTool
    from pydantic import BaseModel

    tool = FunctionTool.from_defaults(fn=multiply)
    llm = RAGCacheLLM(engine=engine, max_tokens=64, frequency_penalty=1.0)
    assert llm.metadata.is_function_calling_model
    question = "What is 6 times 7? Use the tool."
    reply = llm.chat_with_tools([tool], user_msg=question, tool_required=True)
    calls = llm.get_tool_calls_from_response(reply)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("multiply", {"a": 6, "b": 7})]
    assert reply.message.additional_kwargs["tool_calls"][0]["function"]["name"] == "multiply"
    streamed = list(llm.stream_chat_with_tools([tool], user_msg=question, tool_required=True))
    assert [c.tool_kwargs for c in llm.get_tool_calls_from_response(streamed[-1])] == [{"a": 6, "b": 7}]
    assert str(llm.predict_and_call([tool], user_msg=question, tool_required=True)) == "42"
    history = [ChatMessage(role=MessageRole.USER, content=question), reply.message,
               ChatMessage(role=MessageRole.TOOL, content="42", additional_kwargs={"tool_call_id": calls[0].tool_id})]
    after = await llm.achat_with_tools([tool], chat_history=history)
    assert after.message.content is not None
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(await llm.achat([ChatMessage(role=MessageRole.USER, content="hi")]))

    class City(BaseModel):
        name: str
        country: str

    city = llm.structured_predict(City, PromptTemplate("Name a famous city in {country}."), country="France")
    assert isinstance(city, City) and city.name
