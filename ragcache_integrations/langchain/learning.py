"""Documents learned from *any* LangChain retriever, so their KV is reused in any chain.

Our own retriever's documents are known to the process-wide recognizer because it watches our
stores. A chain built on another retriever or vector store (``InMemoryVectorStore``, Chroma, FAISS,
a web search...) returns documents we have never seen. :class:`RetrievedDocumentLearner` is a
callback handler that adds every document any retriever returns (``on_retriever_end``) to the
recognizer, so when that text reaches one of our models inside a prompt it is cut out as a
document and served from the knowledge tree or, at any position, from chunk caches.

It is attached to every LangChain run through ``register_configure_hook`` (the way LangSmith's
tracer is attached), once, when ``ragcache_integrations.langchain`` is imported: no change to
the user's chain. ``RAGCACHE_LEARN_DOCUMENTS=0`` turns it off. Texts shorter than the recognizer's
anchor (64 characters) are ignored, as for our own stores.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.context import register_configure_hook

from ragcache_backend.prompts.recognition import DocumentRecognizer
from ragcache_backend.retrieval.documents import content_id
from ragcache_integrations._runtime import known_documents

__all__ = ["RetrievedDocumentLearner", "install_document_learner"]


class RetrievedDocumentLearner(BaseCallbackHandler):
    """Adds the page content of every retrieved document to a recognizer (thread-safe; never raises
    into the chain)."""

    raise_error = False
    run_inline = True

    def __init__(self, recognizer: DocumentRecognizer | None = None) -> None:
        self.recognizer = recognizer or known_documents()
        self.learned = 0

    def on_retriever_end(self, documents: Any, **kwargs: Any) -> None:
        for doc in documents or ():
            text = getattr(doc, "page_content", None)
            if isinstance(text, str) and self.recognizer.add(content_id(text.strip()), text):
                self.learned += 1


_LEARNER: RetrievedDocumentLearner | None = None


def install_document_learner() -> RetrievedDocumentLearner | None:
    """Attach a :class:`RetrievedDocumentLearner` to every LangChain run in this process (once);
    returns it, or None when ``RAGCACHE_LEARN_DOCUMENTS=0``.

    The hook's context variable has the learner as its *default*, so every thread and task sees it
    without anything being set in its context."""
    global _LEARNER
    if os.environ.get("RAGCACHE_LEARN_DOCUMENTS", "1") == "0":
        return None
    if _LEARNER is None:
        _LEARNER = RetrievedDocumentLearner()
        register_configure_hook(ContextVar("ragcache_document_learner", default=_LEARNER), inheritable=True)
    return _LEARNER
