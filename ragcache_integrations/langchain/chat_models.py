"""``ChatRAGCache``: a LangChain chat model with transparent document-level KV reuse.

Swap it into an existing chain (``... | prompt | ChatRAGCache() | StrOutputParser()``) and
nothing else changes: the messages the prompt template produced are rendered with the model's
chat template, the documents known to our stores are found inside them
(:mod:`ragcache_backend.prompts.recognition`) and their KV is served from the knowledge tree.
``usage_metadata["input_token_details"]["cache_read"]`` counts the prompt tokens that were reused.

Text content only: image, audio, file and tool-call content is refused with
:class:`~ragcache_integrations.UnsupportedContentError` (reasoning blocks of earlier assistant
turns are dropped, as they are not meant to be sent back).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import Field

from ragcache_backend.engine.engine import GenerationResult, StreamChunk
from ragcache_backend.prompts.recognition import ChatTurn
from ragcache_integrations._params import RAGCacheParams
from ragcache_integrations._runtime import Generation, UnsupportedContentError
from ragcache_integrations._server import ServerGeneration

__all__ = ["ChatRAGCache", "usage_metadata", "response_metadata", "to_chat_turns"]

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}
_DROPPED_BLOCKS = frozenset({"reasoning", "thinking"})


def to_chat_turns(messages: Sequence[BaseMessage]) -> list[ChatTurn]:
    """LangChain messages as plain-text chat turns for the model's template.

    Raises UnsupportedContentError for non-text content, tool calls or an unknown message type.
    """
    turns = []
    for i, message in enumerate(messages):
        role = message.role if isinstance(message, ChatMessage) else _ROLES.get(message.type)
        if role is None:
            raise UnsupportedContentError(f"message {i} is a {message.type!r} message; "
                                          f"supported: system, human, ai, tool and chat messages")
        if isinstance(message, AIMessage) and message.tool_calls:
            raise UnsupportedContentError(f"message {i} holds tool calls; ChatRAGCache has no tool calling")
        turns.append(ChatTurn(role, _text(message.content, i)))
    return turns


def _text(content: str | list, index: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        kind = "text" if isinstance(block, str) else block.get("type")
        if kind == "text":
            parts.append(block if isinstance(block, str) else block["text"])
        elif kind not in _DROPPED_BLOCKS:
            raise UnsupportedContentError(f"message {index} has a {kind!r} content block; "
                                          f"ChatRAGCache accepts text only")
    return "".join(parts)


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    """Token counts; ``input_token_details.cache_read`` = prompt tokens served from the cache."""
    output = len(result.token_ids)
    return UsageMetadata(
        input_tokens=result.prompt_tokens, output_tokens=output, total_tokens=result.prompt_tokens + output,
        input_token_details={"cache_read": result.cached_tokens},
    )


def response_metadata(result: GenerationResult, model_name: str) -> dict[str, Any]:
    """Model name, finish reason, latency and what the cache served (``chunk_*``: the approximate
    part served from chunk caches; ``speculation_kept`` and the search figures: the answer was
    generated while our retriever searched, see :class:`~ragcache_backend.engine.request.GenerationResult`)."""
    return {
        "model_name": model_name,
        "finish_reason": result.finish_reason,
        "ttft_s": result.ttft_s,
        "total_s": result.total_s,
        "cached_tokens": result.cached_tokens,
        "computed_tokens": result.computed_tokens,
        "chunk_cached_tokens": result.chunk_cached_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "chunk_hits": result.chunk_hits,
        "documents": list(result.documents),
        # dynamic speculative pipelining: set when this answer was generated during the retriever's search
        "speculation_kept": result.speculation_kept,
        "search_s": result.search_s,
        "unoverlapped_search_s": result.unoverlapped_search_s,
        "speculative_requests": result.speculative_requests,
        "wasted_tokens": result.wasted_tokens,
    }


class ChatRAGCache(RAGCacheParams, BaseChatModel):
    """LangChain chat model over a :class:`~ragcache_backend.engine.engine.RAGCacheEngine`.

    Example:
        ```python
        from ragcache_integrations.langchain import ChatRAGCache, RAGCacheRetriever

        llm = ChatRAGCache(max_tokens=64)          # the default engine, built on first use
        chain = {"context": RAGCacheRetriever(k=3) | format_docs,
                 "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
        ```
    """

    streaming: bool = Field(default=False, description="stream tokens even from invoke() (callbacks see them)")

    @property
    def _llm_type(self) -> str:
        return "ragcache-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.reported_model_name(), "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "stop": self.stop}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="ragcache", ls_model_type="chat",
            ls_model_name=kwargs.get("model") or self.reported_model_name(),
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> Generation | ServerGeneration:
        return self.chat_generation(to_chat_turns(messages), stop, kwargs)

    def _message(self, result: GenerationResult) -> AIMessage:
        return AIMessage(content=result.answer, usage_metadata=usage_metadata(result),
                         response_metadata=response_metadata(result, self.reported_model_name()))

    def _chunk(self, chunk: StreamChunk) -> ChatGenerationChunk:
        if chunk.result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=chunk.text))
        result = chunk.result
        return ChatGenerationChunk(message=AIMessageChunk(
            content=chunk.text, usage_metadata=usage_metadata(result), chunk_position="last",
            response_metadata=response_metadata(result, self.reported_model_name()),
        ))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        result = self._prepare(messages, stop, kwargs).run()
        return ChatResult(generations=[ChatGeneration(message=self._message(result))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        result = await self._prepare(messages, stop, kwargs).arun()
        return ChatResult(generations=[ChatGeneration(message=self._message(result))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for chunk in self._prepare(messages, stop, kwargs).stream():
            out = self._chunk(chunk)
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=out)
            yield out

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in self._prepare(messages, stop, kwargs).astream():
            out = self._chunk(chunk)
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=out)
            yield out
