"""``ChatRAGCache``: a LangChain chat model with transparent document-level KV reuse.

Swap it into an existing chain (``... | prompt | ChatRAGCache() | StrOutputParser()``) and
nothing else changes: the messages the prompt template produced are rendered with the model's
chat template, the documents known to our stores are found inside them
(:mod:`ragcache_backend.prompts.recognition`) and their KV is served from the knowledge tree.
``usage_metadata["input_token_details"]["cache_read"]`` counts the prompt tokens that were reused.

Structured output: ``with_structured_output(schema, method=...)`` with ``function_calling`` (the
default), ``json_schema`` or ``json_mode``, as ``ChatOpenAI``'s; each decodes under a grammar.
Tool calling (``bind_tools``, and through it the default ``with_structured_output``): the tools are offered
in the system turn in the Hermes format (:mod:`ragcache_backend.prompts.tools`); a forced call
(``tool_choice`` ``"any"``/``"required"``/a name, as ``with_structured_output`` uses) is held to
the tools' JSON Schemas by constrained decoding, so it always parses; the calls come back as
``AIMessage.tool_calls``. A streamed answer with tools arrives whole in its last chunk, since
whether the model wrote a call is known only at the end.

Text content only: image, audio and file content is refused with
:class:`~ragcache_integrations.UnsupportedContentError` (reasoning blocks of earlier assistant
turns are dropped, as they are not meant to be sent back).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage, ToolMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

from ragcache_backend.engine.engine import GenerationResult, StreamChunk
from ragcache_backend.prompts.recognition import ChatTurn
from ragcache_backend.prompts.tools import Tool, parse_tool_calls, render_tool_calls, render_tool_result
from ragcache_integrations._params import RAGCacheParams
from ragcache_integrations._runtime import Generation, UnsupportedContentError
from ragcache_integrations._server import ServerGeneration

__all__ = ["ChatRAGCache", "usage_metadata", "response_metadata", "to_chat_turns"]

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}
#: Content blocks left out of the prompt: reasoning (not meant to be sent back) and tool-call
#: blocks (the same calls are in ``AIMessage.tool_calls``, which are rendered).
_DROPPED_BLOCKS = frozenset({"reasoning", "thinking", "tool_use", "tool_call", "tool_call_chunk", "function_call"})


def to_chat_turns(messages: Sequence[BaseMessage]) -> list[ChatTurn]:
    """LangChain messages as plain-text chat turns for the model's template: an AI message's tool
    calls as the model writes them, a tool message as a ``<tool_response>`` in a user turn.

    Raises UnsupportedContentError for non-text content or an unknown message type.
    """
    turns = []
    for i, message in enumerate(messages):
        role = message.role if isinstance(message, ChatMessage) else _ROLES.get(message.type)
        if role is None:
            raise UnsupportedContentError(f"message {i} is a {message.type!r} message; "
                                          f"supported: system, human, ai, tool and chat messages")
        text = _text(message.content, i)
        if isinstance(message, AIMessage) and message.tool_calls:
            calls = render_tool_calls([{"function": {"name": c["name"], "arguments": json.dumps(c["args"])}}
                                       for c in message.tool_calls])
            text = f"{text}\n{calls}" if text else calls
        if isinstance(message, ToolMessage) or role == "tool":
            role, text = "user", render_tool_result(text)
        turns.append(ChatTurn(role, text))
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

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | bool | dict | None = None, parallel_tool_calls: bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` offered on every call (OpenAI function format after
        ``convert_to_openai_tool``).

        ``tool_choice``: None or ``"auto"`` (the model decides), ``"none"``, ``"any"`` /
        ``"required"`` / True (some call is forced), or a tool's name (that call is forced).
        Forced calls are held to the tools' schemas by constrained decoding; one call, or one or
        more with ``parallel_tool_calls=True``.

        Raises (on the first call): ToolError for a schema that is not valid JSON Schema, or a
        ``tool_choice`` naming no tool.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is True or tool_choice == "any":
            tool_choice = "required"
        elif isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        extra = {"tool_choice": tool_choice} if tool_choice is not None else {}
        if parallel_tool_calls is not None:
            extra["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **extra, **kwargs)

    def with_structured_output(self, schema: dict | type | None = None, *, include_raw: bool = False,
                               method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
                               strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """This model answering in ``schema``'s shape, parsed (a pydantic instance for a pydantic
        class, else a dict), as ``ChatOpenAI.with_structured_output``.

        ``method``: ``function_calling`` (a forced call of a tool named after the schema),
        ``json_schema`` (the answer itself held to the schema: OpenAI's ``response_format``
        ``json_schema``) or ``json_mode`` (a JSON object, OpenAI's ``json_object``; where a schema
        is given, constrained decoding holds the object to it too, which OpenAI's JSON mode leaves
        to the prompt). Every method decodes under a grammar, so the JSON parses unless
        ``max_tokens`` cuts it short (a ``maxLength`` in the schema bounds strings); ``strict`` is
        accepted and changes nothing (the schema is always enforced).
        With ``include_raw=True`` the result is ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``.

        Raises:
            ValueError: an unknown ``method``, or no ``schema`` for ``function_calling`` / ``json_schema``.
        """
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        if method == "function_calling":
            if schema is None:
                raise ValueError("with_structured_output(method='function_calling') needs a schema")
            return super().with_structured_output(schema, include_raw=include_raw)
        is_model = isinstance(schema, type) and issubclass(schema, BaseModel)
        if method == "json_schema" or (method == "json_mode" and schema is not None):
            if schema is None:
                raise ValueError("with_structured_output(method='json_schema') needs a schema")
            function = convert_to_openai_tool(schema)["function"]
            response_format = {"type": "json_schema", "json_schema": {
                "name": function["name"], "schema": schema.model_json_schema() if is_model else function["parameters"]}}
        elif method == "json_mode":
            response_format = {"type": "json_object"}
        else:
            raise ValueError(f"method must be 'function_calling', 'json_schema' or 'json_mode', got {method!r}")
        llm = self.bind(response_format=response_format, ls_structured_output_format={
            "kwargs": {"method": method}, "schema": schema})
        parser = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict) -> tuple[Generation | ServerGeneration, tuple[Tool, ...]]:
        """The generation, and the tools whose calls are parsed out of its answer (empty: none)."""
        kwargs = dict(kwargs)
        return self.tool_chat_generation(to_chat_turns(messages), stop, kwargs, tools=kwargs.pop("tools", None) or (),
                                         tool_choice=kwargs.pop("tool_choice", None),
                                         parallel_tool_calls=kwargs.pop("parallel_tool_calls", None),
                                         response_format=kwargs.pop("response_format", None))

    def _message(self, result: GenerationResult, tools: Sequence[Tool]) -> AIMessage:
        metadata = response_metadata(result, self.reported_model_name())
        parsed = parse_tool_calls(result.answer, tools) if tools else None
        if not parsed or not parsed.calls:
            return AIMessage(content=result.answer, usage_metadata=usage_metadata(result), response_metadata=metadata)
        metadata["finish_reason"] = "tool_calls"
        return AIMessage(content=parsed.content or "", usage_metadata=usage_metadata(result), response_metadata=metadata,
                         tool_calls=[{"name": c.name, "args": json.loads(c.arguments), "id": c.id, "type": "tool_call"}
                                     for c in parsed.calls])

    def _chunk(self, chunk: StreamChunk, tools: Sequence[Tool]) -> ChatGenerationChunk | None:
        """The LangChain chunk of a streamed chunk; with tools, None until the last one, which
        carries the whole answer (its text or its calls)."""
        if chunk.result is None:
            return None if tools else ChatGenerationChunk(message=AIMessageChunk(content=chunk.text))
        result = chunk.result
        common = dict(usage_metadata=usage_metadata(result), chunk_position="last")
        if not tools:
            return ChatGenerationChunk(message=AIMessageChunk(
                content=chunk.text, response_metadata=response_metadata(result, self.reported_model_name()), **common))
        message = self._message(result, tools)
        calls = [{"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i, "type": "tool_call_chunk"}
                 for i, c in enumerate(message.tool_calls)]
        return ChatGenerationChunk(message=AIMessageChunk(content=message.content, tool_call_chunks=calls,
                                                          response_metadata=message.response_metadata, **common))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        generation, tools = self._prepare(messages, stop, kwargs)
        return ChatResult(generations=[ChatGeneration(message=self._message(generation.run(), tools))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        generation, tools = self._prepare(messages, stop, kwargs)
        return ChatResult(generations=[ChatGeneration(message=self._message(await generation.arun(), tools))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        generation, tools = self._prepare(messages, stop, kwargs)
        for chunk in generation.stream():
            out = self._chunk(chunk, tools)
            if out is None:
                continue
            if run_manager:
                run_manager.on_llm_new_token(out.text, chunk=out)
            yield out

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        generation, tools = self._prepare(messages, stop, kwargs)
        async for chunk in generation.astream():
            out = self._chunk(chunk, tools)
            if out is None:
                continue
            if run_manager:
                await run_manager.on_llm_new_token(out.text, chunk=out)
            yield out
