"""``CacheUsageRecorder``: collect what the cache served, the LlamaIndex way (instrumentation).

A query engine returns only the answer; the LLM calls behind it are reported through LlamaIndex's
instrumentation events. The recorder keeps the ``raw`` payload of every finished
:class:`~ragcache_integrations.llamaindex.RAGCacheLLM` call (``usage`` with
``prompt_tokens_details.cached_tokens``, ``ttft_s``, ``documents``).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from pydantic import Field

__all__ = ["CacheUsageRecorder"]


class CacheUsageRecorder(BaseEventHandler):
    """Event handler recording the ``raw`` usage payload of each finished RAGCacheLLM call.

    Example:
        ```python
        recorder = CacheUsageRecorder.attach()
        query_engine.query("How do I sort a list?")
        recorder.records[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        recorder.detach()
        ```
    """

    records: list[dict[str, Any]] = Field(default_factory=list, description="raw payloads, oldest first")

    @classmethod
    def class_name(cls) -> str:
        return "CacheUsageRecorder"

    @classmethod
    def attach(cls) -> CacheUsageRecorder:
        """A new recorder, registered with the root instrumentation dispatcher."""
        recorder = cls()
        get_dispatcher().add_event_handler(recorder)
        return recorder

    def detach(self) -> None:
        """Stop recording."""
        handlers = get_dispatcher().event_handlers
        if self in handlers:
            handlers.remove(self)

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response is not None:
            raw = event.response.raw
            if isinstance(raw, dict) and "usage" in raw and "ttft_s" in raw:
                self.records.append(raw)
