"""``RAGCacheLLM``: a LlamaIndex LLM with transparent document-level KV reuse.

``index.as_query_engine(llm=RAGCacheLLM())`` is all it takes: the query engine's own prompt
(LlamaIndex's chat QA template: system rules, then ``Context information is below ...``) reaches
:meth:`RAGCacheLLM.chat`, the documents known to our stores are found inside it and served from
the knowledge tree. Every response's ``raw`` holds OpenAI-style ``usage`` with
``prompt_tokens_details.cached_tokens`` (read by LlamaIndex's ``TokenCountingHandler`` and
instrumentation events) plus ``ttft_s`` and the recognised ``documents``.

Text content only: image, audio, video, document and tool-call blocks are refused with
:class:`~ragcache_integrations.UnsupportedContentError` (thinking blocks of earlier assistant
turns are dropped).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from ragcache_backend.engine.engine import GenerationResult, StreamChunk
from ragcache_backend.prompts.recognition import ChatTurn
from ragcache_integrations._params import CompletionParams
from ragcache_integrations._runtime import Generation, UnsupportedContentError
from ragcache_integrations._server import ServerGeneration

__all__ = ["RAGCacheLLM", "raw_usage", "to_chat_turns"]

_DROPPED_BLOCKS = frozenset({"thinking"})


def to_chat_turns(messages: Sequence[ChatMessage]) -> list[ChatTurn]:
    """LlamaIndex chat messages as plain-text turns (text blocks joined by newlines, as
    ``ChatMessage.content`` does). Raises UnsupportedContentError for any non-text block."""
    turns = []
    for i, message in enumerate(messages):
        texts = []
        for block in message.blocks:
            if block.block_type == "text":
                texts.append(block.text)
            elif block.block_type not in _DROPPED_BLOCKS:
                raise UnsupportedContentError(f"message {i} has a {block.block_type!r} block; "
                                              f"RAGCacheLLM accepts text only")
        turns.append(ChatTurn(message.role.value, "\n".join(texts)))
    return turns


def raw_usage(result: GenerationResult) -> dict[str, Any]:
    """An OpenAI-style ``raw`` payload: ``usage`` (with cached prompt tokens) and cache details."""
    output = len(result.token_ids)
    return {
        "model": result.model,
        "finish_reason": result.finish_reason,
        "usage": {
            "prompt_tokens": result.prompt_tokens, "completion_tokens": output,
            "total_tokens": result.prompt_tokens + output,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        },
        "ttft_s": result.ttft_s,
        "total_s": result.total_s,
        "chunk_cached_tokens": result.chunk_cached_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "chunk_hits": result.chunk_hits,
        "documents": list(result.documents),
    }


class RAGCacheLLM(CompletionParams, CustomLLM):
    """LlamaIndex LLM over a :class:`~ragcache_backend.engine.engine.RAGCacheEngine` (a chat model).

    Example:
        ```python
        index = VectorStoreIndex.from_documents(docs, embed_model=RAGCacheEmbedding())
        engine = index.as_query_engine(llm=RAGCacheLLM(max_tokens=64))
        ```
    """

    @classmethod
    def class_name(cls) -> str:
        return "RAGCacheLLM"

    @property
    def metadata(self) -> LLMMetadata:
        """Context window of the engine's model (builds the default engine if none was given), or
        of the ``base_url`` server's (asked once)."""
        return LLMMetadata(context_window=self.context_window(),
                           num_output=self.max_tokens, is_chat_model=True,
                           model_name=self.reported_model_name())

    # ---- requests ------------------------------------------------------------------------------
    def chat_request(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Generation | ServerGeneration:
        """The ready request :meth:`chat` would run (its ``run``, ``stream``, ``submit``...), e.g. for
        a query engine that pipelines retrieval with generation."""
        return self._chat_request(messages, kwargs)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict) -> Generation | ServerGeneration:
        return self.chat_generation(to_chat_turns(messages), None, kwargs)

    def _complete_request(self, prompt: str, kwargs: dict) -> Generation | ServerGeneration:
        return self.completion_generation(prompt, None, kwargs)

    @staticmethod
    def _completion(result: GenerationResult) -> CompletionResponse:
        return CompletionResponse(text=result.answer, raw=raw_usage(result))

    @staticmethod
    def _chat(result: GenerationResult) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=result.answer),
                            raw=raw_usage(result))

    @staticmethod
    def _completions(chunks: Iterator[StreamChunk]) -> CompletionResponseGen:
        text = ""
        for chunk in chunks:
            text += chunk.text
            raw = raw_usage(chunk.result) if chunk.result is not None else None
            yield CompletionResponse(text=text, delta=chunk.text, raw=raw)

    @staticmethod
    async def _acompletions(chunks: AsyncIterator[StreamChunk]) -> CompletionResponseAsyncGen:
        text = ""
        async for chunk in chunks:
            text += chunk.text
            raw = raw_usage(chunk.result) if chunk.result is not None else None
            yield CompletionResponse(text=text, delta=chunk.text, raw=raw)

    @staticmethod
    def _as_chat(completion: CompletionResponse) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=completion.text),
                            delta=completion.delta, raw=completion.raw)

    # ---- LlamaIndex LLM interface --------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion(self._complete_request(prompt, kwargs).run())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._completions(self._complete_request(prompt, kwargs).stream())

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(self._chat_request(messages, kwargs).run())

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return (self._as_chat(c) for c in self._completions(self._chat_request(messages, kwargs).stream()))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion(await self._complete_request(prompt, kwargs).arun())

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._acompletions(self._complete_request(prompt, kwargs).astream())

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(await self._chat_request(messages, kwargs).arun())

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        async def gen() -> ChatResponseAsyncGen:
            async for completion in self._acompletions(self._chat_request(messages, kwargs).astream()):
                yield self._as_chat(completion)

        return gen()
