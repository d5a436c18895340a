"""``RAGCacheLLM``: a LlamaIndex LLM with transparent document-level KV reuse.

``index.as_query_engine(llm=RAGCacheLLM())`` is all it takes: the query engine's own prompt
(LlamaIndex's chat QA template: system rules, then ``Context information is below ...``) reaches
:meth:`RAGCacheLLM.chat`, the documents known to our stores are found inside it and served from
the knowledge tree. Every response's ``raw`` holds OpenAI-style ``usage`` with
``prompt_tokens_details.cached_tokens`` (read by LlamaIndex's ``TokenCountingHandler`` and
instrumentation events) plus ``ttft_s`` and the recognised ``documents``.

A ``FunctionCallingLLM``: ``chat_with_tools``, ``predict_and_call``, ``FunctionAgent`` and
``structured_predict`` work. Tools are offered in the Hermes format
(:mod:`ragcache_backend.prompts.tools`); with ``tool_required=True`` the answer is held to
well-formed calls by constrained decoding; the calls come back as ``ToolCallBlock`` blocks of the
response message (and OpenAI-style in ``additional_kwargs["tool_calls"]``). A streamed answer
with tools arrives whole in its last response.

Text content only: image, audio, video and document blocks are refused with
:class:`~ragcache_integrations.UnsupportedContentError` (thinking blocks of earlier assistant
turns are dropped; tool calls and tool results are rendered as the model writes and reads them).
"""

from __future__ import annotations

import json
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
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from ragcache_backend.engine.engine import GenerationResult, StreamChunk
from ragcache_backend.prompts.recognition import ChatTurn
from ragcache_backend.prompts.tools import Tool, parse_tool_calls, render_tool_calls, render_tool_result
from ragcache_integrations._params import CompletionParams
from ragcache_integrations._runtime import Generation, UnsupportedContentError
from ragcache_integrations._server import ServerGeneration

__all__ = ["RAGCacheLLM", "raw_usage", "to_chat_turns"]

_DROPPED_BLOCKS = frozenset({"thinking"})


def _openai_calls(message: ChatMessage) -> list[dict[str, Any]]:
    """An assistant message's tool calls in OpenAI's shape: its ``ToolCallBlock`` blocks, else
    ``additional_kwargs["tool_calls"]`` (dicts or OpenAI SDK objects, as LlamaIndex's OpenAI LLM keeps them)."""
    calls = []
    for block in message.blocks:
        if block.block_type == "tool_call":
            args = block.tool_kwargs if isinstance(block.tool_kwargs, str) else json.dumps(block.tool_kwargs)
            calls.append({"function": {"name": block.tool_name, "arguments": args}})
    if calls:
        return calls
    for call in message.additional_kwargs.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else getattr(call, "function", None)
        if fn is not None and not isinstance(fn, dict):
            fn = {"name": fn.name, "arguments": fn.arguments}
        calls.append({"function": fn})
    return calls


def to_chat_turns(messages: Sequence[ChatMessage]) -> list[ChatTurn]:
    """LlamaIndex chat messages as plain-text turns (text blocks joined by newlines, as
    ``ChatMessage.content`` does); an assistant's tool calls as the model writes them, a tool
    message as a ``<tool_response>`` in a user turn. Raises UnsupportedContentError for any other
    non-text block."""
    turns = []
    for i, message in enumerate(messages):
        texts = []
        for block in message.blocks:
            if block.block_type == "text":
                texts.append(block.text)
            elif block.block_type not in _DROPPED_BLOCKS and block.block_type != "tool_call":
                raise UnsupportedContentError(f"message {i} has a {block.block_type!r} block; "
                                              f"RAGCacheLLM accepts text only")
        text, role = "\n".join(texts), message.role.value
        calls = _openai_calls(message) if message.role == MessageRole.ASSISTANT else []
        if calls:
            rendered = render_tool_calls(calls)
            text = f"{text}\n{rendered}" if text else rendered
        if message.role == MessageRole.TOOL:
            role, text = "user", render_tool_result(text)
        turns.append(ChatTurn(role, text))
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


class RAGCacheLLM(CompletionParams, FunctionCallingLLM):
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
                           num_output=self.max_tokens, is_chat_model=True, is_function_calling_model=True,
                           model_name=self.reported_model_name())

    # ---- requests ------------------------------------------------------------------------------
    def chat_request(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Generation | ServerGeneration:
        """The ready request :meth:`chat` would run (its ``run``, ``stream``, ``submit``...), e.g. for
        a query engine that pipelines retrieval with generation."""
        return self._chat_request(messages, kwargs)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict) -> Generation | ServerGeneration:
        return self._tool_request(messages, kwargs)[0]

    def _tool_request(self, messages: Sequence[ChatMessage],
                      kwargs: dict) -> tuple[Generation | ServerGeneration, tuple[Tool, ...]]:
        """The request, and the tools whose calls are parsed out of its answer (``tools``,
        ``tool_choice`` and ``parallel_tool_calls`` in ``kwargs``, as :meth:`_prepare_chat_with_tools` puts them)."""
        kwargs = dict(kwargs)
        return self.tool_chat_generation(to_chat_turns(messages), None, kwargs, tools=kwargs.pop("tools", None) or (),
                                         tool_choice=kwargs.pop("tool_choice", None),
                                         parallel_tool_calls=kwargs.pop("parallel_tool_calls", None))

    def _complete_request(self, prompt: str, kwargs: dict) -> Generation | ServerGeneration:
        return self.completion_generation(prompt, None, kwargs)

    @staticmethod
    def _completion(result: GenerationResult) -> CompletionResponse:
        return CompletionResponse(text=result.answer, raw=raw_usage(result))

    @staticmethod
    def _chat(result: GenerationResult, tools: Sequence[Tool] = ()) -> ChatResponse:
        """The response; with tools, the calls the answer holds as ``ToolCallBlock`` blocks."""
        parsed = parse_tool_calls(result.answer, tools) if tools else None
        if not parsed or not parsed.calls:
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=result.answer),
                                raw=raw_usage(result))
        blocks: list = [TextBlock(text=parsed.content)] if parsed.content else []
        blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=json.loads(c.arguments))
                   for c in parsed.calls]
        openai_calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in parsed.calls]
        raw = raw_usage(result) | {"finish_reason": "tool_calls"}
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks,
                                                additional_kwargs={"tool_calls": openai_calls}), raw=raw)

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
        generation, tools = self._tool_request(messages, kwargs)
        return self._chat(generation.run(), tools)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        generation, tools = self._tool_request(messages, kwargs)
        if tools:  # whether the answer is a call is known at its end: one response, whole
            return (self._chat(c.result, tools) for c in generation.stream() if c.result is not None)
        return (self._as_chat(c) for c in self._completions(generation.stream()))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion(await self._complete_request(prompt, kwargs).arun())

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._acompletions(self._complete_request(prompt, kwargs).astream())

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        generation, tools = self._tool_request(messages, kwargs)
        return self._chat(await generation.arun(), tools)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        generation, tools = self._tool_request(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            if tools:
                yield self._chat(await generation.arun(), tools)
                return
            async for completion in self._acompletions(generation.astream()):
                yield self._as_chat(completion)

        return gen()

    # ---- function calling ----------------------------------------------------------------------
    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: str | dict | None = None, **kwargs: Any) -> dict[str, Any]:
        """``chat`` arguments offering ``tools`` (LlamaIndex tools): ``tool_required`` forces a
        call (constrained decoding), ``tool_choice`` may name one tool (by name or OpenAI dict)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg)
        if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        if tool_choice is None:
            tool_choice = "required" if tool_required else "auto"
        return {"messages": messages, "tools": [t.metadata.to_openai_tool() for t in tools],
                "tool_choice": tool_choice, "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The calls of a :meth:`chat` response as ``ToolSelection`` s.

        Raises:
            ValueError: no call and ``error_on_no_tool_call`` (LlamaIndex's contract)."""
        calls = [ToolSelection(tool_id=b.tool_call_id or "", tool_name=b.tool_name,
                               tool_kwargs=b.tool_kwargs if isinstance(b.tool_kwargs, dict) else json.loads(b.tool_kwargs))
                 for b in response.message.blocks if b.block_type == "tool_call"]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got: {response.message.content!r}")
        return calls
