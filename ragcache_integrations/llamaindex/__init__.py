"""LlamaIndex adapters: LLM, retriever, query engine and embedding with document-level KV reuse.

``index.as_query_engine(llm=RAGCacheLLM())`` or ``RAGCacheQueryEngine()`` (SPEC §3). Importing this
package also lets nodes from *any* retriever be recognised in prompts
(:mod:`~ragcache_integrations.llamaindex.learning`).
"""

from ragcache_integrations.llamaindex.embeddings import RAGCacheEmbedding
from ragcache_integrations.llamaindex.learning import RetrievedNodeLearner, install_node_learner
from ragcache_integrations.llamaindex.llms import RAGCacheLLM
from ragcache_integrations.llamaindex.query_engine import RAGCacheQueryEngine
from ragcache_integrations.llamaindex.retrievers import RAGCacheRetriever, to_llama_documents
from ragcache_integrations.llamaindex.usage import CacheUsageRecorder

install_node_learner()

__all__ = ["CacheUsageRecorder", "RAGCacheEmbedding", "RAGCacheLLM", "RAGCacheQueryEngine", "RAGCacheRetriever",
           "RetrievedNodeLearner", "install_node_learner", "to_llama_documents"]
