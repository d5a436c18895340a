"""From a finished generation to the choice a client reads: its message or text, tool calls,
finish reason and log-probabilities (OpenAI's chat and legacy completion shapes)."""

from __future__ import annotations

import codecs
import functools
import re
from typing import Any

from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode

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

__all__ = ["chat_logprobs", "chat_message", "completion_logprobs", "token_bytes", "token_name"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece


@functools.lru_cache(maxsize=8)
def _byte_decoder(tokenizer: Any) -> dict[str, int] | None:
    """A byte-level BPE tokenizer's (GPT-2's, SmolLM2's, Llama 3's) map from its token alphabet back
    to bytes (``bytes_to_unicode`` inverted); None for any other kind."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes token id ``token`` stands for: what OpenAI's logprobs ``bytes`` field holds. A
    byte-level BPE token or a ``<0xNN>`` byte-fallback piece may be part of one UTF-8 character
    (an emoji or an accented letter split over tokens); decoding it alone would give U+FFFD."""
    piece = tokenizer.convert_ids_to_tokens(token)
    table = _byte_decoder(tokenizer)
    if isinstance(piece, str) and table is not None and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    if isinstance(piece, str) and (match := _BYTE_PIECE.fullmatch(piece)):
        return bytes([int(match.group(1), 16)])
    return tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")


def token_name(raw: bytes) -> str:
    """A token's ``token`` string in logprobs: its text, or, where its bytes are not whole UTF-8
    characters, ``bytes:\\xNN...`` (OpenAI's convention)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(result: GenerationResult, tokenizer: Any) -> ChatLogprobs | None:
    """``choices[].logprobs`` of a chat answer (None when the request asked for none)."""
    if not result.logprobs:
        return None
    content = []
    for sampled in result.logprobs:
        raw = token_bytes(tokenizer, sampled.token)
        top = [TopTokenLogprob(token=token_name(b := token_bytes(tokenizer, alt.token)), logprob=alt.logprob,
                               bytes=list(b)) for alt in sampled.top]
        content.append(TokenLogprob(token=token_name(raw), logprob=sampled.logprob or 0.0, bytes=list(raw),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(result: GenerationResult, tokenizer: Any) -> CompletionLogprobs | None:
    """``choices[].logprobs`` of a completion (None when the request asked for none). A token's
    ``text_offset`` is the number of characters its predecessors complete in the text (a token
    that ends inside a character does not count it; the one that completes it does)."""
    if not result.logprobs:
        return None
    tokens, offsets, chars = [], [], 0
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for sampled in result.logprobs:
        raw = token_bytes(tokenizer, sampled.token)
        tokens.append(token_name(raw))
        offsets.append(chars)
        chars += len(decoder.decode(raw))
    top = [{token_name(token_bytes(tokenizer, alt.token)): alt.logprob for alt in s.top} for s in result.logprobs]
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
