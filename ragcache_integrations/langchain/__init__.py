"""LangChain adapters: drop-in chat model, LLM and retriever with document-level KV reuse.

``from ragcache_integrations.langchain import ChatRAGCache, RAGCacheRetriever`` and swap them
into an existing chain; no other change (SPEC §3). Importing this package also lets documents
from *any* retriever be recognised in prompts (:mod:`~ragcache_integrations.langchain.learning`).
"""

from ragcache_integrations.langchain.chat_models import ChatRAGCache
from ragcache_integrations.langchain.learning import RetrievedDocumentLearner, install_document_learner
from ragcache_integrations.langchain.llms import RAGCacheLLM
from ragcache_integrations.langchain.retrievers import RAGCacheRetriever

install_document_learner()

__all__ = ["ChatRAGCache", "RAGCacheLLM", "RAGCacheRetriever", "RetrievedDocumentLearner", "install_document_learner"]
