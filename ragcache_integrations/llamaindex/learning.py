"""Documents learned from *any* LlamaIndex retriever, so their KV is reused in any query engine.

The LlamaIndex counterpart of :mod:`ragcache_integrations.langchain.learning`: an instrumentation
event handler on the root dispatcher that adds the text of every node any retriever returns
(``RetrievalEndEvent``) to the process-wide recognizer, both as the node's text and as LlamaIndex
renders it for the LLM (metadata lines first), so an index built on any vector store gains reuse
with ``RAGCacheLLM`` and no other change. Installed once when ``ragcache_integrations.llamaindex``
is imported; ``RAGCACHE_LEARN_DOCUMENTS=0`` turns it off.
"""

from __future__ import annotations

import os
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.schema import MetadataMode

from ragcache_backend.retrieval.documents import content_id
from ragcache_integrations._runtime import known_documents

__all__ = ["RetrievedNodeLearner", "install_node_learner"]


class RetrievedNodeLearner(BaseEventHandler):
    """Adds every retrieved node's text to the process-wide recognizer (never raises)."""

    @classmethod
    def class_name(cls) -> str:
        return "RetrievedNodeLearner"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if not isinstance(event, RetrievalEndEvent):
            return
        recognizer = known_documents()
        for scored in event.nodes or ():
            node = getattr(scored, "node", scored)
            try:
                plain = node.get_content(metadata_mode=MetadataMode.NONE)
            except Exception:  # a node type without text content
                continue
            if not isinstance(plain, str) or recognizer.id_of(plain) is not None:
                continue  # already known under its store's id (or not text)
            try:
                rendered = node.get_content(metadata_mode=MetadataMode.LLM)
            except Exception:  # no rendering with metadata: the plain text alone
                rendered = None
            for text in (plain, rendered):
                if isinstance(text, str) and text.strip():
                    recognizer.add(content_id(text.strip()), text)


_LEARNER: RetrievedNodeLearner | None = None


def install_node_learner() -> RetrievedNodeLearner | None:
    """Register a :class:`RetrievedNodeLearner` with the root dispatcher (once); None when
    ``RAGCACHE_LEARN_DOCUMENTS=0``."""
    global _LEARNER
    if os.environ.get("RAGCACHE_LEARN_DOCUMENTS", "1") == "0":
        return None
    if _LEARNER is None:
        _LEARNER = RetrievedNodeLearner()
        get_dispatcher().add_event_handler(_LEARNER)
    return _LEARNER
