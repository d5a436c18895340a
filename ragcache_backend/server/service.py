"""One API request's life on the engine: checks, segments, sampling, generation, response bodies.

:class:`CompletionService` is what the routes of :mod:`ragcache_backend.server.app` call. Every
request goes through the engine's async stream (``astream_segments``); closing the stream (the
client went away, the server's drain timed out) cancels the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.engine.request import GenerationResult, StreamChunk
from ragcache_backend.errors import ContextWindowError, InvalidRequestError
from ragcache_backend.model.sampling import SEED_MAX, SamplingParams
from ragcache_backend.prompts.builder import MAX_SALT_CHARS
from ragcache_backend.prompts.recognition import SegmentedPrompt
from ragcache_backend.retrieval.documents import Document
from ragcache_backend.prompts.tools import with_tools
from ragcache_backend.server.constraints import OutputConstraints, output_constraints
from ragcache_backend.server.errors import APIError, from_engine_error
from ragcache_backend.server.events import ChunkFrames, MergedStreams
from ragcache_backend.server.metrics import ServerMetrics, engine_load
from ragcache_backend.server.outputs import chat_logprobs, chat_message, completion_logprobs
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
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    RAGCacheInfo,
    Usage,
)
from ragcache_backend.server.settings import ServerSettings

__all__ = ["CHAT", "COMPLETIONS", "CompletionService", "EventStream", "PreparedRequest", "endpoint_label"]

log = logging.getLogger(__name__)

#: Endpoint labels (metrics) of the two generation routes.
CHAT, COMPLETIONS = "chat.completions", "completions"
_LABELS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/models": "models",
           "/v1/embeddings": "embeddings", "/tokenize": "tokenize", "/detokenize": "detokenize"}


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
        n: choices to generate (each a request of its own on the engine; the prompt is computed
            about once: the others reuse its KV through the knowledge tree, as the test
            ``test_several_choices_compute_the_prompt_once`` checks).
        constraints: the output's grammar and the tools to parse out of the answer.
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
    n: int = 1
    constraints: OutputConstraints = OutputConstraints()

    def sampling_for(self, index: int) -> SamplingParams:
        """Choice ``index``'s sampling: a seeded request's choices get seeds ``seed + index``
        (wrapped within the 64 bits a seed has)."""
        if index == 0 or self.sampling.seed is None:
            return self.sampling
        seed = self.sampling.seed + index
        return dataclasses.replace(self.sampling, seed=seed - (1 << 64) if seed > SEED_MAX else seed)


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

    def __init__(self, events: AsyncIterator[str], stream: MergedStreams, slot: _Slot,
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

    def _sampling(self, body: ChatCompletionRequest | CompletionRequest, prompt: SegmentedPrompt,
                  constraints: OutputConstraints) -> SamplingParams:
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
        n = body.n or 1
        arena = self.engine.cache.num_device_blocks * self.engine.runner.block_size
        if n > 1 and prompt_tokens + n * limit > arena:
            raise APIError(400, f"n={n} choices of up to {limit} tokens over a {prompt_tokens}-token prompt need "
                                f"{prompt_tokens + n * limit} tokens of KV; the device arena holds {arena}",
                           param="n", code="invalid_value")
        if isinstance(body, ChatCompletionRequest):
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        try:
            bias = body.token_bias
        except ValueError as exc:
            raise APIError(400, str(exc), param="logit_bias", code="invalid_value") from None
        try:
            sampling = SamplingParams(
                max_tokens=limit, temperature=body.temperature or 0.0,
                top_p=body.top_p if body.top_p is not None else 1.0, stop=body.stop_strings, seed=body.seed,
                top_k=body.top_k or 0, min_p=body.min_p or 0.0,
                repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=bias, logprobs=logprobs, grammar=constraints.grammar)
            self.engine.check_window(prompt.segments, sampling)
        except ContextWindowError as exc:
            raise APIError(400, str(exc), param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded") from None
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from None
        return sampling

    def prepare(self, body: ChatCompletionRequest | CompletionRequest, header_salt: str | None,
                arrived: float | None = None) -> PreparedRequest:
        """Check ``body`` and build its prompt, sampling and output constraints.

        ``header_salt`` is the ``X-Cache-Salt`` header; the body's ``cache_salt`` wins. ``arrived``
        is ``time.perf_counter()`` when the request came in (None: now), so that time spent waiting
        for the prompt thread counts in the request's latency.

        Raises:
            APIError: 404 unknown model; 400 unsupported feature, bad value, non-text content,
                bad tools or output format, prompt over the context window.
        """
        arrived = time.perf_counter() if arrived is None else arrived
        self.check_model(body.model)
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        reuse = body.reuse or self.settings.reuse
        documents = passed_documents(body.documents)
        constraints = output_constraints(body)
        self.prompts.register(documents)
        try:
            if isinstance(body, ChatCompletionRequest):
                turns = with_documents(chat_turns(body.messages), documents)
                if constraints.calls_tools:
                    turns = with_tools(turns, constraints.tools)
                prompt = self.prompts.chat(turns, reuse)
                endpoint = CHAT
            else:
                prompt = self.prompts.raw(with_documents_raw(body.prompt_text, documents), reuse)
                endpoint = COMPLETIONS
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="messages" if isinstance(body, ChatCompletionRequest) else "prompt") from None
        salt = body.cache_salt if body.cache_salt is not None else header_salt
        if salt is not None and len(salt) > MAX_SALT_CHARS:  # the header's salt (the body's is checked by its schema)
            raise APIError(400, f"cache_salt must be at most {MAX_SALT_CHARS} characters", param="cache_salt")
        return PreparedRequest(endpoint, prompt, self._sampling(body, prompt, constraints), reuse, salt or None,
                               bool(body.stream), body.include_usage, arrived, bool(body.return_token_ids),
                               body.n or 1, constraints)

    # ---- generation -----------------------------------------------------------------------------
    def _open(self, req: PreparedRequest, index: int = 0) -> AsyncIterator[StreamChunk]:
        return self.engine.astream_segments(req.prompt.segments, req.sampling_for(index), reuse=req.reuse,
                                            cache_salt=req.cache_salt)

    async def _first_chunks(self, req: PreparedRequest) -> tuple[list[AsyncIterator[StreamChunk]], list[StreamChunk]]:
        """Open the request's ``n`` streams and wait for each one's first chunk; on any failure every
        stream is closed and the error raised."""
        streams = [self._open(req, i) for i in range(req.n)]
        tasks = [asyncio.ensure_future(anext(s)) for s in streams]
        try:
            firsts = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # a stream is closed only once its pending read has ended
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()
            raise
        return streams, firsts

    async def generate(self, req: PreparedRequest) -> ChatCompletion | CompletionResponse:
        """Run ``req`` (all its choices) to the end and return the response body.

        Raises:
            APIError: 503 busy or draining; the engine's error mapped (:func:`from_engine_error`).
        """
        self._admit()
        try:
            merged = MergedStreams(*await self._first_chunks(req))
            try:
                results: dict[int, GenerationResult] = {}
                async for index, chunk in merged:
                    if chunk.result is not None:
                        results[index] = chunk.result
            finally:
                await merged.aclose()
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
        ordered = [results[i] for i in range(req.n)]
        for result in ordered:
            self.metrics.finished(req.endpoint, result, time.perf_counter() - req.arrived)
        return self._body(req, ordered)

    def _body(self, req: PreparedRequest, results: list[GenerationResult]) -> ChatCompletion | CompletionResponse:
        common = dict(created=int(time.time()), model=self.model_name, usage=Usage.of(results),
                      ragcache=RAGCacheInfo.of(results[0]))
        tokenizer = self.engine.loaded.tokenizer
        if req.endpoint == CHAT:
            choices = []
            for i, result in enumerate(results):
                message, finish = chat_message(result, req.constraints)
                choices.append(ChatChoice(index=i, message=message, finish_reason=finish,
                                          logprobs=chat_logprobs(result, tokenizer),
                                          token_ids=list(result.token_ids) if req.return_token_ids else None))
            return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", **common, choices=choices)
        return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex[:24]}", **common, choices=[CompletionChoice(
            index=i, text=result.answer, finish_reason=result.finish_reason,
            logprobs=completion_logprobs(result, tokenizer),
            token_ids=list(result.token_ids) if req.return_token_ids else None) for i, result in enumerate(results)])

    async def open_stream(self, req: PreparedRequest) -> EventStream:
        """Start ``req`` and wait for the first chunk of each of its choices, so that an error is
        still an HTTP status; returns the server-sent events (``data: {...}``, ending with
        ``data: [DONE]``).

        Closing the returned iterator before its end cancels the request.

        Raises:
            APIError: as :meth:`generate`, for errors before the first chunk.
        """
        self._admit()
        try:
            merged = MergedStreams(*await self._first_chunks(req))
        except BaseException as exc:
            self._release()
            if isinstance(exc, asyncio.CancelledError):
                self.metrics.failed(req.endpoint, 499)
                raise
            raise from_engine_error(exc) from None
        slot = _Slot(self._release)
        return EventStream(self._event_loop(req, merged, ChunkFrames(req, self.model_name, self.engine.loaded.tokenizer),
                                            slot), merged, slot, lambda: self.metrics.failed(req.endpoint, 499))

    async def _event_loop(self, req: PreparedRequest, merged: MergedStreams, frames: ChunkFrames,
                          slot: _Slot) -> AsyncIterator[str]:
        status = 499  # until the stream ends: the client went away (or the drain timed out)
        held = req.constraints.calls_tools  # the answer is sent whole at the end (tool calls or not)
        results: dict[int, GenerationResult] = {}
        try:
            if req.endpoint == CHAT:
                for i in range(req.n):
                    yield _sse(frames.text(i, "", role=True))
            async for index, chunk in merged:
                if chunk.text and not held:
                    yield _sse(frames.text(index, chunk.text))
                if chunk.result is not None:
                    results[index] = chunk.result
                    for frame in frames.finish(index, chunk.result):
                        yield _sse(frame)
            ordered = [results[i] for i in range(req.n)]
            if req.include_usage:
                yield _sse(frames.usage(ordered))
            yield _sse("[DONE]")
            status = 200
            for result in ordered:
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
            await merged.aclose()

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
