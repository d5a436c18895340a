"""``RAGCacheRetriever``: LangChain retriever over a ragcache document store (Faiss).

The documents it returns carry their exact stored text as ``page_content``, so when a prompt
template puts them into a prompt, :class:`~ragcache_integrations.langchain.ChatRAGCache` finds
them again and serves their KV from the cache. Its store is watched by the process-wide
recognizer (:func:`~ragcache_integrations.known_documents`).

The search runs in stages (RAGCache §5.3). Once our model has run one prompt built from this
retriever's documents and query, the retriever speculates while it searches: the candidates of
each stage are generated on with the prompt that chain would build, and the model call that
follows takes the speculative generation when its prompt is exactly that one
(:mod:`ragcache_integrations._speculation`). The chain needs no change; its answer is the one its
own prompt gives.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from ragcache_backend.retrieval.docstore import DocumentStore, ScoredDocument
from ragcache_backend.errors import InvalidRequestError
from ragcache_integrations._runtime import default_store, known_documents
from ragcache_integrations._speculation import speculative_retrieval

__all__ = ["RAGCacheRetriever", "to_langchain_document"]


def to_langchain_document(hit: ScoredDocument) -> LCDocument:
    """A search hit as a LangChain document (text unchanged; id, source, title, score in metadata)."""
    doc = hit.document
    return LCDocument(id=doc.doc_id, page_content=doc.text, metadata={
        "doc_id": doc.doc_id, "source": doc.source, "title": doc.title, "score": hit.score, "rank": hit.rank,
    })


class RAGCacheRetriever(BaseRetriever):
    """Top-``k`` documents from a :class:`~ragcache_backend.retrieval.docstore.DocumentStore`.

    Example:
        ```python
        retriever = RAGCacheRetriever(k=3)                  # the Python documentation
        retriever = RAGCacheRetriever(store=my_store, k=4)  # any store
        docs = retriever.invoke("How do I sort a list?", k=2)
        ```
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    store: DocumentStore | None = Field(
        default=None, exclude=True,
        description="the store to search; None = the store of corpus_dir, built or loaded on first use")
    corpus_dir: Path | None = Field(
        default=None, description="corpus folder used when no store is given; None = the Python documentation")
    k: int = Field(default=4, ge=1, description="how many documents to return (at most the store's size)")
    num_stages: int = Field(default=4, ge=1, description="stages of the pipelined search (RAGCache §5.3)")
    speculate: bool = Field(
        default=True,
        description="speculate on each stage's candidates with the prompt our model last built from this "
                    "retriever's results (dynamic speculative pipelining); False = a plain search")

    def resolved_store(self) -> DocumentStore:
        """The store (the default one is built or loaded on first use); watched for recognition."""
        store = self.store if self.store is not None else default_store(self.corpus_dir)
        known_documents().watch(store)
        return store

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None, **kwargs: Any) -> list[LCDocument]:
        if kwargs:
            raise InvalidRequestError(f"unsupported retriever arguments {sorted(kwargs)}; supported: k")
        k = self.k if k is None else k
        store = self.resolved_store()
        if not self.speculate:
            return [to_langchain_document(h) for h in store.search(query, k)]
        hits = speculative_retrieval(query, store.search_stages(query, k, self.num_stages),
                                     key=lambda h: h.document.doc_id, text=lambda h: h.document.text)
        return [to_langchain_document(h) for h in hits]

    def stream_candidates(self, query: str, num_stages: int | None = None, k: int | None = None) -> Iterator[list[LCDocument]]:
        """The current top-``k`` after each stage of a pipelined search (RAGCache §5.3); the last
        list equals :meth:`invoke`'s result."""
        stages = self.resolved_store().search_stages(query, self.k if k is None else k, num_stages or self.num_stages)
        for hits in stages:
            yield [to_langchain_document(h) for h in hits]

    async def astream_candidates(self, query: str, num_stages: int | None = None,
                                 k: int | None = None) -> AsyncIterator[list[LCDocument]]:
        """Async :meth:`stream_candidates` (each stage on a worker thread)."""
        stages = self.resolved_store().asearch_stages(query, self.k if k is None else k, num_stages or self.num_stages)
        async for hits in stages:
            yield [to_langchain_document(h) for h in hits]
