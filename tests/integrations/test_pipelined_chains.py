"""Dynamic speculative pipelining through the adapters, on the real default model.

* LangChain: the quick-start LCEL chain, unchanged, with our retriever and model: after the first
  question the retriever speculates during its staged search with the prompt the chain builds,
  and the model call takes that generation; answers equal a chain that does not speculate.
* LlamaIndex: ``RAGCacheQueryEngine`` pipelines end to end; answers equal ``pipelined=False``.
"""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import RunnablePassthrough

from ragcache_integrations._speculation import speculation_board
from ragcache_integrations.langchain import ChatRAGCache, RAGCacheRetriever
from ragcache_integrations.llamaindex import RAGCacheLLM, RAGCacheQueryEngine
from ragcache_integrations.llamaindex import RAGCacheRetriever as LlamaRetriever
from tests.integrations.rag_prompts import CUSTOM_RAG_PROMPT, RLM_RAG_PROMPT, format_docs

pytestmark = pytest.mark.model
MAX_TOKENS = 16


def chain(retriever, llm, prompt):
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm


@pytest.mark.parametrize("template", ["question-first", "context-first"])
def test_lcel_chain_takes_the_retrievers_speculative_generation(engine, faq_store, faq_questions, template):
    prompt = (ChatPromptTemplate.from_messages([("human", RLM_RAG_PROMPT)]) if template == "question-first"
              else PromptTemplate.from_template(CUSTOM_RAG_PROMPT))
    llm = ChatRAGCache(engine=engine, max_tokens=MAX_TOKENS)
    plain = chain(RAGCacheRetriever(store=faq_store, k=3, speculate=False), llm, prompt) | StrOutputParser()
    piped = chain(RAGCacheRetriever(store=faq_store, k=3), llm, prompt)
    board = speculation_board()
    questions = faq_questions[10:14]
    expected = [plain.invoke(q) for q in questions]
    speculation_board().forget()
    taken = board.taken
    messages = [piped.invoke(q) for q in questions]
    assert [m.content for m in messages] == expected  # speculation never changes an answer
    first, rest = messages[0].response_metadata, [m.response_metadata for m in messages[1:]]
    assert not first["speculation_kept"]  # nothing learned yet: the first question is searched, then generated
    assert board.taken - taken == len(rest) and all(m["speculation_kept"] for m in rest)
    for meta in rest:
        assert meta["search_s"] > 0 and meta["speculative_requests"] >= 1
        assert meta["unoverlapped_search_s"] <= meta["search_s"]
    assert board.posted == 0
    assert engine.wait_idle(30)


def test_rewritten_question_is_never_taken(engine, faq_store, faq_questions):
    """A chain that changes the question before the prompt: the prediction never matches, the
    posted generation is not taken, and the answer is the chain's own."""
    llm = ChatRAGCache(engine=engine, max_tokens=MAX_TOKENS)
    prompt = ChatPromptTemplate.from_messages([("human", RLM_RAG_PROMPT)])
    retriever = RAGCacheRetriever(store=faq_store, k=2)
    rewritten = {"context": retriever | format_docs, "question": lambda q: q.upper()} | prompt | llm
    board = speculation_board()
    taken = board.taken
    for q in faq_questions[20:22]:
        rewritten.invoke(q)
    assert board.taken == taken
    assert board.frame(2) is None  # the query is not in the prompt: no frame is learned


def test_llamaindex_query_engine_pipelines_end_to_end(engine, faq_store, faq_questions):
    llm = RAGCacheLLM(engine=engine, max_tokens=MAX_TOKENS)
    retriever = LlamaRetriever(faq_store, k=3, num_stages=4)
    piped = RAGCacheQueryEngine(retriever=retriever, llm=llm)
    plain = RAGCacheQueryEngine(retriever=retriever, llm=llm, pipelined=False)
    for q in faq_questions[30:33]:
        got, want = piped.query(q), plain.query(q)
        assert got.response == want.response
        assert [n.node.node_id for n in got.source_nodes] == [n.node.node_id for n in want.source_nodes]
        meta = got.metadata
        assert meta["speculation_kept"] and meta["speculative_requests"] >= 1 and meta["search_s"] > 0
        assert meta["unoverlapped_search_s"] <= meta["search_s"]
    got = asyncio.run(piped.aquery(faq_questions[33]))
    assert got.response == plain.query(faq_questions[33]).response
    assert engine.wait_idle(30)


def test_llamaindex_retriever_streams_candidates(faq_store, faq_questions):
    retriever = LlamaRetriever(faq_store, k=3, num_stages=3)
    q = faq_questions[40]
    stages = list(retriever.stream_candidates(q))
    assert len(stages) == 3
    assert [n.node.node_id for n in stages[-1]] == [n.node.node_id for n in retriever.retrieve(q)]

    async def collect():
        return [s async for s in retriever.astream_candidates(q)]

    assert [[n.node.node_id for n in s] for s in asyncio.run(collect())] == [[n.node.node_id for n in s] for s in stages]
    with pytest.raises(ValueError):
        LlamaRetriever(faq_store, num_stages=0)


def test_cancelled_pipelined_aquery_frees_its_work(engine, faq_store, faq_questions):
    llm = RAGCacheLLM(engine=engine, max_tokens=200)
    piped = RAGCacheQueryEngine(retriever=LlamaRetriever(faq_store, k=3), llm=llm)

    async def main():
        task = asyncio.ensure_future(piped.aquery(faq_questions[50]))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert engine.wait_idle(10) and engine.in_flight == 0
