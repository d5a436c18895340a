"""LangChain adapters: drop-in chat model, LLM and retriever with document-level KV reuse.

``from ragcache_integrations.langchain import ChatRAGCache, RAGCacheRetriever`` and swap them
into an existing chain; no other change (SPEC §3).
"""

from ragcache_integrations.langchain.chat_models import ChatRAGCache
from ragcache_integrations.langchain.llms import RAGCacheLLM
from ragcache_integrations.langchain.retrievers import RAGCacheRetriever

__all__ = ["ChatRAGCache", "RAGCacheLLM", "RAGCacheRetriever"]
