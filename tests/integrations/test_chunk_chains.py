"""Chunk-cache reuse through the frameworks, with retrievers and vector stores that are not ours.

LangChain's stock RAG prompt puts the question first, so a new question starts a new prefix and
the knowledge tree alone reuses nothing of the documents after it. With ``reuse="auto"`` the
documents are served from chunk caches at their new position, and documents returned by *any*
retriever are learned through the callback hook (LlamaIndex: the instrumentation handler).
"""

from __future__ import annotations

import pytest
from langchain_core.callbacks import get_usage_metadata_callback
from langchain_core.documents import Document as LCDocument
from langchain_core.embeddings import Embeddings
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from ragcache_backend.retrieval.embedder import Embedder
from ragcache_integrations.langchain import ChatRAGCache
from tests.integrations.rag_prompts import RLM_RAG_PROMPT, format_docs

pytestmark = pytest.mark.model


class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 as an ordinary LangChain ``Embeddings`` (what a user's vector store would use)."""

    def __init__(self) -> None:
        self.embedder = Embedder()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.embed_query(text).tolist()


@pytest.fixture(scope="module")
def vector_store(faq_store) -> InMemoryVectorStore:
    """An in-memory LangChain vector store over FAQ sections: not a store ragcache knows."""
    docs = [LCDocument(page_content=d.text) for d in faq_store.documents[:40]]
    store = InMemoryVectorStore(MiniLMEmbeddings())
    store.add_documents(docs)
    return store


def _chain(retriever, llm):
    prompt = ChatPromptTemplate.from_messages([("human", RLM_RAG_PROMPT)])
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()


def _usage(chain, question):
    with get_usage_metadata_callback() as cb:
        chain.invoke(question)
    (usage,) = cb.usage_metadata.values()
    return usage


def test_question_first_prompt_and_any_vector_store_reuse_documents_across_questions(engine, vector_store) -> None:
    engine.reset_cache()
    retriever = vector_store.as_retriever(search_kwargs={"k": 2})
    first_q, second_q = "How do I create a .pyc file?", "How can I compile Python source into bytecode files?"
    assert {d.page_content for d in retriever.invoke(first_q)} & {d.page_content for d in retriever.invoke(second_q)}
    exact = _chain(retriever, ChatRAGCache(engine=engine, max_tokens=4, reuse="exact"))
    auto = _chain(retriever, ChatRAGCache(engine=engine, max_tokens=4, reuse="auto"))
    _usage(auto, first_q)  # learns the documents, records their chunk variants
    tree_only = _usage(exact, second_q)
    reused = _usage(auto, second_q)
    print("\nquestion-first prompt, new question: cache_read exact", tree_only["input_token_details"]["cache_read"],
          "auto", reused["input_token_details"]["cache_read"], "of", reused["input_tokens"])
    assert tree_only["input_token_details"]["cache_read"] == 0  # the question comes first: nothing to reuse
    assert reused["input_token_details"]["cache_read"] > 100  # the shared document, at its new position
    engine.cache.check_invariants()


def test_llamaindex_index_on_another_vector_store_reuses_nodes_in_chunk_mode(engine, faq_store) -> None:
    from llama_index.core import Document as LIDocument
    from llama_index.core import VectorStoreIndex

    from ragcache_integrations.llamaindex import CacheUsageRecorder, RAGCacheEmbedding, RAGCacheLLM

    engine.reset_cache()
    index = VectorStoreIndex.from_documents([LIDocument(text=d.text) for d in faq_store.documents[:40]],
                                            embed_model=RAGCacheEmbedding())
    qe = index.as_query_engine(llm=RAGCacheLLM(engine=engine, max_tokens=4, reuse="auto"), similarity_top_k=2)
    recorder = CacheUsageRecorder.attach()
    try:
        qe.query("How do I create a .pyc file?")
        qe.query("How can I compile Python source into bytecode files?")
    finally:
        recorder.detach()
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in recorder.records]
    print("\nLlamaIndex, another vector store, cached tokens per query:", cached)
    assert len(cached) == 2 and cached[1] > cached[0] and cached[1] > 100
    engine.cache.check_invariants()
