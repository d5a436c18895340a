"""From a finished generation to the choice a client reads: its message or text, tool calls,
finish reason and log-probabilities (OpenAI's chat and legacy completion shapes)."""

from __future__ import annotations

from typing import Any

from ragcache_backend.engine.request import GenerationResult
from ragcache_backend.prompts.tools import parse_tool_calls
from ragcache_backend.server.constraints import OutputConstraints
from ragcache_backend.server.schema import (
    ChatLogprobs,
    CompletionLogprobs,
    FunctionCall,
    ResponseMessage,
    TokenLogprob,
    ToolCallOut,
    TopTokenLogprob,
)

__all__ = ["chat_logprobs", "chat_message", "completion_logprobs"]


def _text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(result: GenerationResult, tokenizer: Any) -> ChatLogprobs | None:
    """``choices[].logprobs`` of a chat answer (None when the request asked for none)."""
    if not result.logprobs:
        return None
    content = []
    for sampled in result.logprobs:
        text = _text(tokenizer, sampled.token)
        top = [TopTokenLogprob(token=(t := _text(tokenizer, alt.token)), logprob=alt.logprob, bytes=list(t.encode()))
               for alt in sampled.top]
        content.append(TokenLogprob(token=text, logprob=sampled.logprob or 0.0, bytes=list(text.encode()),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(result: GenerationResult, tokenizer: Any) -> CompletionLogprobs | None:
    """``choices[].logprobs`` of a completion (None when the request asked for none)."""
    if not result.logprobs:
        return None
    tokens, offsets, offset = [], [], 0
    for sampled in result.logprobs:
        text = _text(tokenizer, sampled.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [{_text(tokenizer, alt.token): alt.logprob for alt in s.top} for s in result.logprobs]
    return CompletionLogprobs(tokens=tokens, token_logprobs=[s.logprob or 0.0 for s in result.logprobs],
                              top_logprobs=top if any(top) else None, text_offset=offsets)


def chat_message(result: GenerationResult, constraints: OutputConstraints) -> tuple[ResponseMessage, str]:
    """The assistant message and finish reason: with tools, the calls the answer holds are
    parsed out (finish reason ``tool_calls``)."""
    if not constraints.calls_tools:
        return ResponseMessage(content=result.answer), result.finish_reason
    parsed = parse_tool_calls(result.answer, constraints.tools)
    if not parsed.calls:
        return ResponseMessage(content=result.answer), result.finish_reason
    calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls]
    return ResponseMessage(content=parsed.content, tool_calls=calls), "tool_calls"
