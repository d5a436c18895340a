"""``RAGCacheEmbedding``: our sentence embedder as a LlamaIndex embedding model (offline).

Lets a ``VectorStoreIndex`` be built from our documents without any hosted embedding service,
with the same model (all-MiniLM-L6-v2) our document stores use.
"""

from __future__ import annotations

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from pydantic import ConfigDict, Field, PrivateAttr

from ragcache_backend.retrieval.embedder import DEFAULT_EMBEDDER_NAME, Embedder

__all__ = ["RAGCacheEmbedding"]


class RAGCacheEmbedding(BaseEmbedding):
    """L2-normalised sentence embeddings from a ragcache :class:`~ragcache_backend.retrieval.embedder.Embedder`."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())

    model_name: str = Field(default=DEFAULT_EMBEDDER_NAME, description="embedding model name")
    embedder: Embedder | None = Field(
        default=None, exclude=True,
        description="the embedder; None = the default all-MiniLM-L6-v2, loaded on first use")
    _default: Embedder | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "RAGCacheEmbedding"

    def _embedder(self) -> Embedder:
        if self.embedder is not None:
            return self.embedder
        if self._default is None:
            self._default = Embedder()
        return self._default

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._embedder().embed_query(query).tolist()

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._embedder().embed(texts).tolist()

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._get_query_embedding(query)
