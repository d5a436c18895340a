"""``RAGCacheRetriever``: LlamaIndex retriever over a ragcache document store (Faiss).

Nodes carry the exact stored text, so a query engine's prompt contains it verbatim and
:class:`~ragcache_integrations.llamaindex.RAGCacheLLM` serves it from the cache. The store is
watched by the process-wide recognizer (:func:`~ragcache_integrations.known_documents`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import Document as LlamaDocument
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from ragcache_backend.retrieval.docstore import DocumentStore, ScoredDocument
from ragcache_backend.retrieval.documents import Document
from ragcache_backend.errors import InvalidRequestError
from ragcache_integrations._runtime import default_store, known_documents

__all__ = ["RAGCacheRetriever", "to_llama_documents", "to_node"]

#: Metadata kept out of the embedding text; the LLM sees ``source`` and ``title``.
_EMBED_EXCLUDED = ["doc_id", "source", "title"]
_LLM_EXCLUDED = ["doc_id"]


def _metadata(doc: Document) -> dict[str, str]:
    return {"doc_id": doc.doc_id, "source": doc.source, "title": doc.title}


def to_node(hit: ScoredDocument) -> NodeWithScore:
    """A search hit as a scored LlamaIndex node (node id = document id, text unchanged)."""
    doc = hit.document
    node = TextNode(id_=doc.doc_id, text=doc.text, metadata=_metadata(doc),
                    excluded_embed_metadata_keys=_EMBED_EXCLUDED, excluded_llm_metadata_keys=_LLM_EXCLUDED)
    return NodeWithScore(node=node, score=hit.score)


def to_llama_documents(documents: Iterable[Document]) -> list[LlamaDocument]:
    """Our documents as LlamaIndex documents, e.g. for ``VectorStoreIndex.from_documents``.

    They are also registered with :func:`~ragcache_integrations.known_documents`, so that any
    prompt a LlamaIndex query engine builds from them is recognised by our models.
    """
    documents = list(documents)
    known_documents().add_documents(documents)
    return [LlamaDocument(id_=d.doc_id, text=d.text, metadata=_metadata(d),
                          excluded_embed_metadata_keys=_EMBED_EXCLUDED, excluded_llm_metadata_keys=_LLM_EXCLUDED)
            for d in documents]


class RAGCacheRetriever(BaseRetriever):
    """Top-``k`` documents of a :class:`~ragcache_backend.retrieval.docstore.DocumentStore` as ``NodeWithScore``.

    Args:
        store: the store to search; None = the store of ``corpus_dir``, built or loaded on first use.
        corpus_dir: corpus folder used when no store is given; None = the Python documentation.
        k: how many documents to return (at most the store's size).
        num_stages: stages of the pipelined search (:meth:`stream_candidates`, RAGCache §5.3);
            :class:`~ragcache_integrations.llamaindex.RAGCacheQueryEngine` speculates on them.
        callback_manager: LlamaIndex callbacks.
    """

    def __init__(self, store: DocumentStore | None = None, *, corpus_dir: Path | str | None = None, k: int = 4,
                 num_stages: int = 4, callback_manager: CallbackManager | None = None) -> None:
        for name, value in (("k", k), ("num_stages", num_stages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
        super().__init__(callback_manager=callback_manager)
        self._store, self.corpus_dir, self.k, self.num_stages = store, corpus_dir, k, num_stages

    def resolved_store(self) -> DocumentStore:
        """The store (the default one is built or loaded on first use); watched for recognition."""
        if self._store is None:
            self._store = default_store(self.corpus_dir)
        known_documents().watch(self._store)
        return self._store

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [to_node(h) for h in self.resolved_store().search(query_bundle.query_str, self.k)]

    def stream_candidates(self, query: str) -> Iterator[list[NodeWithScore]]:
        """The current top-``k`` nodes after each stage of a pipelined search (RAGCache §5.3); the
        last list equals :meth:`retrieve`'s result."""
        for hits in self.resolved_store().search_stages(query, self.k, self.num_stages):
            yield [to_node(h) for h in hits]

    async def astream_candidates(self, query: str) -> AsyncIterator[list[NodeWithScore]]:
        """Async :meth:`stream_candidates` (each stage on a worker thread)."""
        async for hits in self.resolved_store().asearch_stages(query, self.k, self.num_stages):
            yield [to_node(h) for h in hits]
