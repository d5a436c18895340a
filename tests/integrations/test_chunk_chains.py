"""Chunk-cache reuse through the frameworks, with retrievers and vector stores that are not ours.

LangChain's stock RAG prompt puts the question first, so a new question starts a new prefix and
the knowledge tree alone reuses nothing of the documents after it. With ``reuse="auto"`` the
documents are served from chunk caches at their new position, and documents returned by *any*
retriever are learned through the callback hook (LlamaIndex: the instrumentation handler).
"""

from __future__ import annotations

import pytest
from langchain_core.documents import Document as LCDocument
from langchain_core.embeddings import Embeddings
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
    """LangChain's quick-start chain with the stock question-first prompt, returning the AIMessage."""
    prompt = ChatPromptTemplate.from_messages([("human", RLM_RAG_PROMPT)])
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm


def test_question_first_prompt_and_any_vector_store_reuse_documents_across_questions(engine, vector_store) -> None:
    engine.reset_cache()
    retriever = vector_store.as_retriever(search_kwargs={"k": 2})
    first_q, second_q = "How do I create a .pyc file?", "How can I compile Python source into bytecode files?"
    third_q = "Is there a way to turn Python source code into bytecode ahead of time?"
    docs = [{d.page_content for d in retriever.invoke(q)} for q in (first_q, second_q, third_q)]
    assert docs[1] & docs[2] and docs[0] & docs[2]  # the questions share retrieved documents
    auto = _chain(retriever, ChatRAGCache(engine=engine, max_tokens=4, reuse="auto"))
    exact = _chain(retriever, ChatRAGCache(engine=engine, max_tokens=4, reuse="exact"))
    auto.invoke(second_q)  # learns the documents, records their chunk variants
    reused = auto.invoke(third_q)  # a new question: its documents come from chunk caches
    tree_only = exact.invoke(first_q)
    cache_read = [m.usage_metadata["input_token_details"]["cache_read"] for m in (tree_only, reused)]
    print("\nquestion-first prompt, new questions: cache_read exact", cache_read[0], "of",
          tree_only.usage_metadata["input_tokens"], "| auto", cache_read[1], "of", reused.usage_metadata["input_tokens"])
    # the question comes first: the tree alone reuses only the template's blocks before it, no document
    assert cache_read[0] % engine.block_tokens == 0 and cache_read[0] < 100
    assert cache_read[1] > cache_read[0] + 100  # the shared documents, after another question
    meta = reused.response_metadata
    assert meta["chunk_hits"] >= 1 and 0 < meta["chunk_cached_tokens"] <= cache_read[1]
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
    assert len(cached) == 2 and cached[0] == 0 < cached[1]  # the shared node, after another question
    engine.cache.check_invariants()
