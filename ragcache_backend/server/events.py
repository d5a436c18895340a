"""The streamed form of a request: its choices' engine streams merged into one, and the
server-sent event frames (chat or completion chunks) built from them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from ragcache_backend.engine.request import GenerationResult, StreamChunk
from ragcache_backend.server.outputs import chat_logprobs, chat_message, completion_logprobs
from ragcache_backend.server.schema import (
    ChatCompletionChunk,
    ChunkChoice,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
    RAGCacheInfo,
    ToolCallDelta,
    Usage,
)

if TYPE_CHECKING:
    from ragcache_backend.server.service import PreparedRequest

__all__ = ["ChunkFrames", "MergedStreams"]


class MergedStreams:
    """The engine streams of one request's choices as one async iterator of ``(index, chunk)``,
    in the order chunks arrive; each stream's first chunk (already read) comes first.

    :meth:`aclose` stops waiting and closes every stream (which cancels unfinished choices).
    An error in one stream is raised to the consumer.
    """

    def __init__(self, streams: Sequence[AsyncIterator[StreamChunk]], firsts: Sequence[StreamChunk]) -> None:
        self._streams = list(streams)
        self._ready: list[tuple[int, StreamChunk]] = list(enumerate(firsts))
        self._pending: dict[asyncio.Future, int] = {}
        self._open = [first.result is None for first in firsts]

    def __aiter__(self) -> MergedStreams:
        return self

    async def __anext__(self) -> tuple[int, StreamChunk]:
        while not self._ready:
            for i, stream in enumerate(self._streams):
                if self._open[i] and i not in self._pending.values():
                    self._pending[asyncio.ensure_future(anext(stream))] = i
            if not self._pending:
                raise StopAsyncIteration
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = self._pending.pop(future)
                chunk = future.result()  # a stream's error reaches the consumer here
                self._open[index] = chunk.result is None
                self._ready.append((index, chunk))
        index, chunk = self._ready.pop(0)
        return index, chunk

    async def aclose(self) -> None:
        pending, self._pending = list(self._pending), {}
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()


class ChunkFrames:
    """The JSON of one streaming request's chunks (one id and creation time for all of them)."""

    def __init__(self, req: PreparedRequest, model: str, tokenizer: Any) -> None:
        self.req, self.model, self.tokenizer = req, model, tokenizer
        self.chat = req.endpoint == "chat.completions"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _chunk(self, choices: list, result: GenerationResult | None = None, usage: Usage | None = None) -> str:
        kind = ChatCompletionChunk if self.chat else CompletionChunk
        return kind(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
                    ragcache=RAGCacheInfo.of(result) if result is not None else None).model_dump_json()

    def text(self, index: int, text: str, *, role: bool = False) -> str:
        """A text delta of choice ``index`` (chat: the first one carries the role)."""
        if self.chat:
            return self._chunk([ChunkChoice(index=index, delta=DeltaMessage(
                role="assistant" if role else None, content=text))])
        return self._chunk([CompletionChoice(index=index, text=text)])

    def finish(self, index: int, result: GenerationResult) -> list[str]:
        """The last frames of choice ``index``: with tools, the whole answer (content or tool
        calls) first; then the finishing chunk with its reason, logprobs, token ids and the
        ``ragcache`` object."""
        ids = list(result.token_ids) if self.req.return_token_ids else None
        if not self.chat:
            return [self._chunk([CompletionChoice(index=index, text="", finish_reason=result.finish_reason,
                                                  logprobs=completion_logprobs(result, self.tokenizer),
                                                  token_ids=ids)], result)]
        frames, finish = [], result.finish_reason
        if self.req.constraints.calls_tools:
            message, finish = chat_message(result, self.req.constraints)
            calls = [ToolCallDelta(index=k, **call.model_dump()) for k, call in enumerate(message.tool_calls or ())]
            frames.append(self._chunk([ChunkChoice(index=index, delta=DeltaMessage(
                content=message.content, tool_calls=calls or None))]))
        frames.append(self._chunk([ChunkChoice(index=index, delta=DeltaMessage(), finish_reason=finish,
                                               logprobs=chat_logprobs(result, self.tokenizer), token_ids=ids)],
                                  result))
        return frames

    def usage(self, results: Sequence[GenerationResult]) -> str:
        """The last chunk with ``stream_options.include_usage``: no choices, the request's usage."""
        return self._chunk([], results[0], usage=Usage.of(results))
