"""One API request's life on the engine: checks, segments, sampling, generation, response bodies.

:class:`CompletionService` is what the routes of :mod:`ragcache_backend.server.app` call. Every
request goes through the engine's async stream (``astream_segments``); closing the stream (the
client went away, the server's drain timed out) cancels the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.engine.request import GenerationResult, StreamChunk
from ragcache_backend.errors import ContextWindowError, InvalidRequestError
from ragcache_backend.model.sampling import SamplingParams
from ragcache_backend.prompts.builder import MAX_SALT_CHARS
from ragcache_backend.prompts.recognition import SegmentedPrompt
from ragcache_backend.retrieval.documents import Document
from ragcache_backend.server.errors import APIError, from_engine_error
from ragcache_backend.server.metrics import ServerMetrics, engine_load
from ragcache_backend.server.prompting import (
    LearnedDocuments,
    PromptAssembler,
    chat_turns,
    load_index_documents,
    passed_documents,
    with_documents,
    with_documents_raw,
)
from ragcache_backend.server.schema import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    HealthResponse,
    ModelCard,
    ModelList,
    RAGCacheInfo,
    ResponseMessage,
    Usage,
)
from ragcache_backend.server.settings import ServerSettings

__all__ = ["CHAT", "COMPLETIONS", "CompletionService", "EventStream", "PreparedRequest", "endpoint_label"]

log = logging.getLogger(__name__)

#: Endpoint labels (metrics) of the two generation routes.
CHAT, COMPLETIONS = "chat.completions", "completions"
_LABELS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/models": "models"}


def endpoint_label(path: str) -> str:
    """The metrics label of a request path (``other`` for paths outside the API)."""
    return _LABELS.get(path.rstrip("/"), "other")


@dataclass(slots=True, frozen=True)
class PreparedRequest:
    """A checked request, ready for the engine.

    Attributes:
        endpoint: :data:`CHAT` or :data:`COMPLETIONS`.
        prompt: the segmented prompt.
        sampling: sampling parameters (``max_tokens`` resolved).
        reuse: the reuse mode.
        cache_salt: the tenant salt (None: the shared cache).
        stream: answer with server-sent events.
        include_usage: streaming: add a last chunk with ``usage``.
        arrived: ``time.perf_counter()`` at arrival.
        return_token_ids: put the generated token ids in the choice (vLLM's ``return_token_ids``).
    """

    endpoint: str
    prompt: SegmentedPrompt
    sampling: SamplingParams
    reuse: str
    cache_salt: str | None
    stream: bool
    include_usage: bool
    arrived: float
    return_token_ids: bool = False


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class _Slot:
    """One admitted request's place in :class:`CompletionService`'s count, given back once."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    @property
    def held(self) -> bool:
        return self._release is not None

    def release(self) -> None:
        if self._release is not None:
            self._release, release = None, self._release
            release()


class EventStream:
    """The server-sent events of one streaming request (an async iterator of ``data: ...`` frames).

    :meth:`aclose` always cancels the engine request if it has not finished and gives back the
    request's slot, even when iteration never started (a client gone before the first byte).
    """

    def __init__(self, events: AsyncIterator[str], stream: AsyncIterator[StreamChunk], slot: _Slot,
                 on_abandon: Callable[[], None]) -> None:
        self._events, self._stream, self._slot, self._on_abandon = events, stream, slot, on_abandon

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> str:
        return await anext(self._events)

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            if self._slot.held:  # never iterated: its own clean-up did not run
                self._on_abandon()
                self._slot.release()
            await self._stream.aclose()


class CompletionService:
    """The API over one engine: request checks, generation, response bodies, admission, drain.

    Args:
        engine: the engine (owned by the caller, who closes it).
        settings: served model name, default reuse mode and max_tokens, queue bound, the index whose
            documents are recognised, where learned documents are kept.
        index_documents: the documents of ``settings.index`` when the caller already loaded them
            (:func:`~ragcache_backend.server.prompting.load_index_documents`); None loads them here.

    Raises:
        InvalidRequestError: ``settings.index`` is not an index, or the learned documents' path is a folder.
        CorruptFileError: the index is damaged.
    """

    def __init__(self, engine: RAGCacheEngine, settings: ServerSettings, *,
                 index_documents: Sequence[Document] | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.model_name = settings.served_model_name or engine.model_name
        if index_documents is None and settings.index is not None:
            index_documents = load_index_documents(settings.index)
        learned = settings.learned_documents_path
        self.prompts = PromptAssembler(engine, documents=index_documents or (),
                                       learned=LearnedDocuments(learned) if learned is not None else None)
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        self.draining = False
        self.active = 0  # requests admitted by this service and not finished

    # ---- admission ------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Refuse new requests from now on (503); those in flight go on."""
        self.draining = True

    def check_open(self) -> None:
        """Raises APIError 503 while draining."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")

    def _admit(self) -> None:
        self.check_open()
        limit = self.settings.max_batch_size + self.settings.max_queue
        if self.active >= limit:
            raise APIError(503, f"the server is busy: {self.active} requests in flight, at most "
                                f"{self.settings.max_queue} may wait beyond a batch of {self.settings.max_batch_size}; "
                                "retry later", type="server_error", code="server_busy")
        self.active += 1

    def _release(self) -> None:
        self.active -= 1

    # ---- checks ---------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """Raises APIError 404 (``model_not_found``) unless ``model`` is None, empty or the served name."""
        if model and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _sampling(self, body: ChatCompletionRequest | CompletionRequest, prompt: SegmentedPrompt) -> SamplingParams:
        window = self.engine.loaded.context_window
        field, limit = body.token_limit
        if limit is not None and limit < 1:
            raise APIError(400, f"{field} must be >= 1, got {limit}", param=field, code="invalid_value")
        if limit is not None and limit >= window:
            raise APIError(400, f"{field} {limit} exceeds the {window}-token context window of {self.model_name}",
                           param=field, code="invalid_value")
        prompt_tokens = sum(len(s) for s in prompt.segments)
        if limit is None:
            limit = min(self.settings.default_max_tokens, window - prompt_tokens)
            if limit < 1:
                raise APIError(400, f"the prompt of {prompt_tokens} tokens fills the {window}-token context window",
                               param="messages", code="context_length_exceeded")
        try:
            sampling = SamplingParams(max_tokens=limit, temperature=body.temperature or 0.0,
                                      top_p=body.top_p if body.top_p is not None else 1.0,
                                      stop=body.stop_strings, seed=body.seed)
            self.engine.check_window(prompt.segments, sampling)
        except ContextWindowError as exc:
            raise APIError(400, str(exc), param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded") from None
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from None
        return sampling

    def prepare(self, body: ChatCompletionRequest | CompletionRequest, header_salt: str | None) -> PreparedRequest:
        """Check ``body`` and build its prompt and sampling.

        ``header_salt`` is the ``X-Cache-Salt`` header; the body's ``cache_salt`` wins.

        Raises:
            APIError: 404 unknown model; 400 unsupported feature, bad value, non-text content,
                prompt over the context window.
        """
        arrived = time.perf_counter()
        self.check_model(body.model)
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        reuse = body.reuse or self.settings.reuse
        documents = passed_documents(body.documents)
        self.prompts.register(documents)
        try:
            if isinstance(body, ChatCompletionRequest):
                prompt = self.prompts.chat(with_documents(chat_turns(body.messages), documents), reuse)
                endpoint = CHAT
            else:
                prompt = self.prompts.raw(with_documents_raw(body.prompt_text, documents), reuse)
                endpoint = COMPLETIONS
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="messages" if isinstance(body, ChatCompletionRequest) else "prompt") from None
        salt = body.cache_salt if body.cache_salt is not None else header_salt
        if salt is not None and len(salt) > MAX_SALT_CHARS:  # the header's salt (the body's is checked by its schema)
            raise APIError(400, f"cache_salt must be at most {MAX_SALT_CHARS} characters", param="cache_salt")
        return PreparedRequest(endpoint, prompt, self._sampling(body, prompt), reuse, salt or None,
                               bool(body.stream), body.include_usage, arrived, bool(body.return_token_ids))

    # ---- generation -----------------------------------------------------------------------------
    def _open(self, req: PreparedRequest) -> AsyncIterator[StreamChunk]:
        return self.engine.astream_segments(req.prompt.segments, req.sampling, reuse=req.reuse,
                                            cache_salt=req.cache_salt)

    async def generate(self, req: PreparedRequest) -> ChatCompletion | CompletionResponse:
        """Run ``req`` to the end and return the response body.

        Raises:
            APIError: 503 busy or draining; the engine's error mapped (:func:`from_engine_error`).
        """
        self._admit()
        try:
            async with contextlib.aclosing(self._open(req)) as stream:
                result = None
                async for chunk in stream:
                    result = chunk.result
        except asyncio.CancelledError:
            self.metrics.failed(req.endpoint, 499)
            raise
        except Exception as exc:  # counted in the metrics by the app's APIError handler
            error = from_engine_error(exc)
            if error.status >= 500:
                log.warning("request failed: %r", exc)
            raise error from None
        finally:
            self._release()
        assert result is not None
        self.metrics.finished(req.endpoint, result, time.perf_counter() - req.arrived)
        return self._body(req, result)

    def _body(self, req: PreparedRequest, result: GenerationResult) -> ChatCompletion | CompletionResponse:
        common = dict(created=int(time.time()), model=self.model_name, usage=Usage.of(result),
                      ragcache=RAGCacheInfo.of(result))
        ids = list(result.token_ids) if req.return_token_ids else None
        if req.endpoint == CHAT:
            return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", **common, choices=[ChatChoice(
                message=ResponseMessage(content=result.answer), finish_reason=result.finish_reason, token_ids=ids)])
        return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex[:24]}", **common, choices=[CompletionChoice(
            text=result.answer, finish_reason=result.finish_reason, token_ids=ids)])

    async def open_stream(self, req: PreparedRequest) -> EventStream:
        """Start ``req`` and wait for its first chunk, so that an error is still an HTTP status;
        returns the server-sent events (``data: {...}``, ending with ``data: [DONE]``).

        Closing the returned iterator before its end cancels the request.

        Raises:
            APIError: as :meth:`generate`, for errors before the first chunk.
        """
        self._admit()
        stream = self._open(req)
        try:
            first = await anext(stream)
        except BaseException as exc:
            self._release()
            await stream.aclose()
            if isinstance(exc, asyncio.CancelledError):
                self.metrics.failed(req.endpoint, 499)
                raise
            raise from_engine_error(exc) from None
        slot = _Slot(self._release)
        return EventStream(self._events(req, first, stream, slot), stream, slot,
                           lambda: self.metrics.failed(req.endpoint, 499))

    def _events(self, req: PreparedRequest, first: StreamChunk, stream: AsyncIterator[StreamChunk],
                slot: _Slot) -> AsyncIterator[str]:
        rid, created = uuid.uuid4().hex[:24], int(time.time())
        chat = req.endpoint == CHAT

        def ids(result: GenerationResult | None) -> list[int] | None:  # every id, in the finishing chunk
            return list(result.token_ids) if req.return_token_ids and result is not None else None

        if chat:
            def frame(text: str | None, finish: str | None = None, *, role: bool = False,
                      result: GenerationResult | None = None, usage_only: bool = False) -> str:
                choices = [] if usage_only else [ChunkChoice(delta=DeltaMessage(
                    role="assistant" if role else None, content=text), finish_reason=finish,
                    token_ids=ids(result))]
                return ChatCompletionChunk(
                    id=f"chatcmpl-{rid}", created=created, model=self.model_name, choices=choices,
                    usage=Usage.of(result) if usage_only and result else None,
                    ragcache=RAGCacheInfo.of(result) if result else None,
                ).model_dump_json()
        else:
            def frame(text: str | None, finish: str | None = None, *, role: bool = False,
                      result: GenerationResult | None = None, usage_only: bool = False) -> str:
                choices = [] if usage_only else [CompletionChoice(text=text or "", finish_reason=finish,
                                                                  token_ids=ids(result))]
                return CompletionChunk(
                    id=f"cmpl-{rid}", created=created, model=self.model_name, choices=choices,
                    usage=Usage.of(result) if usage_only and result else None,
                    ragcache=RAGCacheInfo.of(result) if result else None,
                ).model_dump_json()
        return self._event_loop(req, first, stream, frame, slot)

    async def _event_loop(self, req: PreparedRequest, first: StreamChunk, stream: AsyncIterator[StreamChunk],
                          frame: Callable[..., str], slot: _Slot) -> AsyncIterator[str]:
        status = 499  # until the stream ends: the client went away (or the drain timed out)
        try:
            if req.endpoint == CHAT:
                yield _sse(frame("", role=True))
            chunk = first
            while True:
                if chunk.text:
                    yield _sse(frame(chunk.text))
                if chunk.result is not None:
                    break
                chunk = await anext(stream)
            result = chunk.result
            yield _sse(frame(None if req.endpoint == CHAT else "", result.finish_reason, result=result))
            if req.include_usage:
                yield _sse(frame(None, result=result, usage_only=True))
            yield _sse("[DONE]")
            status = 200
            self.metrics.finished(req.endpoint, result, time.perf_counter() - req.arrived)
        except Exception as exc:  # after the first chunk: an error event (as OpenAI sends one)
            error = from_engine_error(exc)
            status = error.status
            if status >= 500:
                log.warning("stream failed: %r", exc)
            yield _sse(error.body.model_dump_json())
        finally:
            if status != 200:
                self.metrics.failed(req.endpoint, status)
            slot.release()
            await stream.aclose()

    # ---- other routes ---------------------------------------------------------------------------
    def models(self) -> ModelList:
        """``GET /v1/models``: the one served model."""
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.engine.loaded.context_window)])

    def health(self) -> HealthResponse:
        """``GET /health``: ``ok`` or ``draining``, with the engine's load."""
        waiting, running = engine_load(self.engine)
        return HealthResponse(status="draining" if self.draining else "ok", model=self.model_name,
                              in_flight=self.engine.in_flight, waiting=waiting, running=running)
