"""The examples in examples/ build their chain / query engine and answer a question (shared
engine and FAQ store; one short question each)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ragcache_integrations.langchain import ChatRAGCache, RAGCacheRetriever
from ragcache_integrations.llamaindex import RAGCacheLLM

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
pytestmark = pytest.mark.model


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_langchain_example(engine, faq_store) -> None:
    example = load("langchain_lcel_rag")
    chain = example.build_chain(ChatRAGCache(engine=engine, max_tokens=4), RAGCacheRetriever(store=faq_store, k=1))
    question = "How do I make a Python script executable on Unix?"
    chain.invoke(question)
    message = chain.invoke(question)
    assert message.content and message.usage_metadata["input_token_details"]["cache_read"] > 0


def test_llamaindex_example(engine, faq_store) -> None:
    example = load("llamaindex_query_engine")
    query_engine = example.ragcache_query_engine(faq_store, RAGCacheLLM(engine=engine, max_tokens=4), k=1)
    question = "How do I make a Python script executable on Unix?"
    query_engine.query(question)
    response = query_engine.query(question)
    assert str(response) and response.metadata["cached_tokens"] > 0
