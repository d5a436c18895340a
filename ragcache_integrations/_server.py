"""Generation on an OpenAI-compatible server: the adapters' ``base_url=`` mode.

Our LangChain and LlamaIndex models normally run an embedded engine. Given ``base_url=`` they send
each request to a server instead (``ragcache serve``, or vLLM with
:class:`~ragcache_integrations.vllm.RAGCacheConnector`) and keep what they add over a plain
OpenAI client:

* **document boundaries**: the documents our recognizer finds in the prompt are sent with it
  (``documents`` to ``ragcache serve``, which then reuses their KV wherever they sit); vLLM gets
  the prompt alone and reuses its prefixes through the connector's block nodes;
* **cache figures**: ``usage.prompt_tokens_details.cached_tokens`` and, from ``ragcache serve``,
  the ``ragcache`` object (tier hits, chunk reuse, server-side TTFT) in the response metadata;
* **speculative pipelining**: a speculative request is a streamed request whose text is held back
  (:meth:`ServerGeneration.submit`); it is cancelled by closing its stream, which the server sees
  as a disconnect and frees the request.

:class:`ServerGeneration` has the interface of :class:`~ragcache_integrations._runtime.Generation`
(``run``, ``arun``, ``stream``, ``astream``, ``submit``, ``request_key``) and returns the same
:class:`~ragcache_backend.engine.request.GenerationResult`, so the adapters' code is one for both
modes. Every request streams (so that it can be cancelled and its first token timed) and asks for
the generated token ids (vLLM's ``return_token_ids``, which ``ragcache serve`` honours too).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tenacity import AsyncRetrying, Retrying

from ragcache_backend.engine.request import GenerationResult, RequestHandle, StreamChunk
from ragcache_backend.errors import InvalidRequestError, RAGCacheError, RequestCancelledError
from ragcache_backend.model.sampling import SamplingParams
from ragcache_backend.prompts.recognition import ChatTurn
from ragcache_backend.server.schema import RAGCacheInfo
from ragcache_integrations._runtime import (
    GenerationTimeoutError,
    arun_taken,
    astream_taken,
    retry_policy,
    stream_taken,
)
from ragcache_integrations._speculation import speculation_board

__all__ = ["ServerClient", "ServerDocument", "ServerError", "ServerGeneration", "ServerInfo", "server_client"]

Endpoint = Literal["chat", "completion"]


class ServerError(RAGCacheError):
    """The server failed a request (5xx after the client's retries, unreachable, or an answer
    that is not an OpenAI-compatible completion stream)."""


@dataclass(slots=True, frozen=True)
class ServerInfo:
    """What ``GET /v1/models`` says about a server.

    Attributes:
        model: the served model's name (the first listed).
        owned_by: ``ragcache`` for ``ragcache serve``, ``vllm`` for vLLM.
        context_window: the model's context in tokens (``max_model_len``), None if not given.
    """

    model: str
    owned_by: str
    context_window: int | None

    @property
    def is_ragcache(self) -> bool:
        """``ragcache serve`` (takes ``documents`` and ``reuse``, answers with a ``ragcache`` object)."""
        return self.owned_by == "ragcache"


def _openai():
    try:
        import openai
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RAGCacheError("base_url= needs the openai client: pip install 'ragcache-kv[langchain]' "
                            "or 'ragcache-kv[llamaindex]' (or pip install openai)") from exc
    return openai


class ServerClient:
    """One OpenAI-compatible server, shared by every adapter given the same ``base_url`` and key.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        api_key: the bearer key (``EMPTY`` when the server has none).
        max_retries: the HTTP client's own retries of connection errors, 429 and 5xx answers.
        max_prefill_bs: speculative pipelining starts a speculative request only while fewer of
            this client's requests wait for their first token (RAGCache Algorithm 2).

    Raises:
        RAGCacheError: the ``openai`` package is not installed.
    """

    def __init__(self, base_url: str, api_key: str, *, max_retries: int = 2, max_prefill_bs: int = 1) -> None:
        openai = _openai()
        self.base_url, self.max_prefill_bs = base_url.rstrip("/"), max_prefill_bs
        self.sync = openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=max_retries)
        self.aio = openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=max_retries)
        self._info: ServerInfo | None = None
        self._lock = threading.Lock()
        self._waiting = 0
        self._ids = itertools.count(1)

    def info(self) -> ServerInfo:
        """The server's model (asked once; later calls are free).

        Raises:
            ServerError: the server is unreachable or lists no model.
        """
        if self._info is None:
            openai = _openai()
            try:
                models = self.sync.models.list().data
            except openai.APIError as exc:
                raise ServerError(f"{self.base_url}: GET /models failed: {exc}") from exc
            if not models:
                raise ServerError(f"{self.base_url} serves no model")
            card = models[0]
            extra = card.model_extra or {}
            self._info = ServerInfo(card.id, str(card.owned_by or ""), extra.get("max_model_len"))
        return self._info

    # ---- the pool speculative pipelining looks at -----------------------------------------------
    @property
    def waiting_requests(self) -> int:
        """This client's requests sent whose first token has not arrived (waiting for prefill)."""
        with self._lock:
            return self._waiting

    @contextlib.contextmanager
    def awaiting_first_token(self) -> Iterator[Callable[[], None]]:
        """Count one request as waiting (for :attr:`waiting_requests`) until it calls the yielded
        ``arrived()`` (its first token arrived; later calls do nothing) or leaves the block."""
        waiting = True
        with self._lock:
            self._waiting += 1

        def arrived() -> None:
            nonlocal waiting
            with self._lock:
                if waiting:
                    waiting = False
                    self._waiting -= 1

        try:
            yield arrived
        finally:
            arrived()

    def next_rid(self) -> int:
        return next(self._ids)


_CLIENTS: dict[tuple[str, str, int, int], ServerClient] = {}
_CLIENTS_LOCK = threading.Lock()


def server_client(base_url: str, api_key: str, *, max_retries: int = 2, max_prefill_bs: int = 1) -> ServerClient:
    """The process-wide :class:`ServerClient` for these settings (connection pools are shared)."""
    key = (base_url.rstrip("/"), api_key, max_retries, max_prefill_bs)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = ServerClient(base_url, api_key, max_retries=max_retries, max_prefill_bs=max_prefill_bs)
        return _CLIENTS[key]


@dataclass(slots=True)
class _Reading:
    """A streamed answer as it arrives: text, token ids, usage and the ``ragcache`` object."""

    started: float = field(default_factory=time.perf_counter)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    first_token: float = 0.0
    finish_reason: str | None = None
    model: str = ""
    usage: Any = None
    ragcache: RAGCacheInfo | None = None

    def add(self, chunk: Any) -> str:
        """Take one streamed chunk (chat or completion); returns its text delta."""
        self.model = chunk.model or self.model
        extra = chunk.model_extra or {}
        if extra.get("ragcache"):  # ragcache serve's extension object (in the finishing chunk)
            self.ragcache = RAGCacheInfo.model_validate(extra["ragcache"])
        if chunk.usage is not None:
            self.usage = chunk.usage
        if extra.get("error"):  # an error event after the first chunk (OpenAI's shape)
            raise ServerError(f"the server failed the stream: {extra['error']}")
        delta = ""
        for choice in chunk.choices:
            delta += (choice.delta.content if hasattr(choice, "delta") else choice.text) or ""
            self.token_ids.extend((choice.model_extra or {}).get("token_ids") or ())
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
        if delta:
            if not self.first_token:
                self.first_token = time.perf_counter()
            self.text.append(delta)
        return delta

    def result(self, info: ServerInfo, documents: Sequence[str]) -> GenerationResult:
        """The finished answer as a :class:`GenerationResult`.

        Raises ServerError when the stream ended without a finish reason, usage or token ids.
        """
        if self.finish_reason is None or self.usage is None:
            raise ServerError("the stream ended without a finish reason and usage: not an OpenAI-compatible server, "
                              "or the connection was cut")
        answer = "".join(self.text)
        if answer and not self.token_ids:
            raise ServerError("the server did not return token ids (return_token_ids); supported servers: "
                              "ragcache serve, vLLM >= 0.10.2")
        details = getattr(self.usage, "prompt_tokens_details", None)
        cached = int(getattr(details, "cached_tokens", 0) or 0)
        prompt = int(self.usage.prompt_tokens)
        now = time.perf_counter()
        common = dict(answer=answer, token_ids=tuple(self.token_ids),
                      finish_reason="length" if self.finish_reason == "length" else "stop",
                      ttft_s=(self.first_token or now) - self.started, total_s=now - self.started,
                      prompt_tokens=prompt, cached_tokens=cached, dropped_documents=(), model=self.model or info.model)
        r = self.ragcache
        if r is None:  # vLLM: only what usage says
            return GenerationResult(**common, computed_tokens=prompt - cached, device_hits=0, host_hits=0,
                                    documents=tuple(documents))
        return GenerationResult(**common, computed_tokens=r.computed_tokens, device_hits=r.device_hits,
                                host_hits=r.host_hits, documents=tuple(r.documents), reuse=r.reuse,
                                chunk_cached_tokens=r.chunk_cached_tokens, recomputed_tokens=r.recomputed_tokens,
                                disk_hits=r.disk_hits)


@dataclass(slots=True, frozen=True)
class ServerDocument:
    """A document found in the prompt, sent with it: its id and stripped text."""

    id: str
    text: str


@dataclass(slots=True)
class ServerGeneration:
    """One request ready to send to a server (the ``base_url=`` twin of ``Generation``).

    Attributes:
        client: the server.
        endpoint: ``chat`` (``turns`` through the server's chat template) or ``completion``
            (``prompt`` completed as raw text).
        turns: the chat turns (chat endpoint).
        prompt: the raw prompt (completion endpoint).
        documents: the known documents inside the prompt, in prompt order.
        sampling: sampling parameters (``stop`` included).
        reuse: None = the server's setting; ``exact``, ``chunk`` or ``auto`` (``ragcache serve`` only).
        timeout: seconds per attempt; the stream is closed (and the request cancelled) after that.
        max_retries: further attempts after a timed-out one.
    """

    client: ServerClient
    endpoint: Endpoint
    turns: tuple[ChatTurn, ...]
    prompt: str
    documents: tuple[ServerDocument, ...]
    sampling: SamplingParams
    reuse: str | None = None
    timeout: float | None = None
    max_retries: int = 0

    @property
    def target(self) -> ServerClient:
        """Where the request runs (speculative pipelining reads its pool)."""
        return self.client

    def request_key(self) -> tuple:
        """What makes two generations the same request (see ``Generation.request_key``)."""
        return (id(self.client), self.endpoint, self.turns, self.prompt, self.documents, self.sampling, self.reuse)

    def _body(self) -> dict[str, Any]:
        info = self.client.info()
        s = self.sampling
        body: dict[str, Any] = dict(model=info.model, max_tokens=s.max_tokens, temperature=s.temperature,
                                    top_p=s.top_p, stream=True, stream_options={"include_usage": True})
        if s.stop:
            body["stop"] = list(s.stop)
        if s.seed is not None:
            body["seed"] = s.seed
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(s, name):
                body[name] = getattr(s, name)
        if s.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in s.logit_bias}
        extra: dict[str, Any] = {"return_token_ids": True}
        if s.top_k > 0:
            extra["top_k"] = s.top_k
        if s.min_p:
            extra["min_p"] = s.min_p
        if s.repetition_penalty != 1.0:
            extra["repetition_penalty"] = s.repetition_penalty
        if s.grammar is not None:  # vLLM's field, which ragcache serve also takes
            extra["structured_outputs"] = s.grammar.structured_outputs()
        if info.is_ragcache:
            if self.documents:
                extra["documents"] = [{"id": d.id, "text": d.text} for d in self.documents]
            if self.reuse is not None:
                extra["reuse"] = self.reuse
        elif self.reuse not in (None, "exact"):
            raise InvalidRequestError(f"reuse={self.reuse!r} needs ragcache serve; {self.client.base_url} is "
                                      f"{info.owned_by or 'another server'} (exact prefix reuse only)")
        body["extra_body"] = extra
        if self.endpoint == "chat":
            body["messages"] = [{"role": t.role, "content": t.content} for t in self.turns]
        else:
            body["prompt"] = self.prompt
        if self.timeout is not None:
            body["timeout"] = self.timeout
        return body

    def _open(self, body: dict[str, Any]):
        api = self.client.sync.chat.completions if self.endpoint == "chat" else self.client.sync.completions
        return api.create(**body)

    def _aopen(self, body: dict[str, Any]):
        api = self.client.aio.chat.completions if self.endpoint == "chat" else self.client.aio.completions
        return api.create(**body)

    def _documents(self) -> list[str]:
        return [d.id for d in self.documents]

    def _retry_kwargs(self, may_retry: Callable[[], bool] = lambda: True) -> dict:
        return retry_policy(self.max_retries, may_retry)

    # ---- one streamed attempt, the core of every mode --------------------------------------------
    def _chunks(self, cancel: threading.Event | None = None,
                opened: list | None = None) -> Iterator[str | GenerationResult]:
        """Text deltas, then the result; closing the iterator closes the stream (the server
        cancels the request). ``opened`` receives the open stream, so that another thread can
        close it (see :meth:`submit`). Raises GenerationTimeoutError past ``timeout``,
        RequestCancelledError when ``cancel`` is set, InvalidRequestError for a 4xx answer,
        ServerError otherwise."""
        openai = _openai()
        body, reading = self._body(), _Reading()
        deadline = reading.started + self.timeout if self.timeout else None
        with self.client.awaiting_first_token() as arrived:
            with _mapped(openai, self.timeout):
                stream = self._open(body)
            if opened is not None:
                opened.append(stream)
            with stream, _mapped(openai, self.timeout):
                try:
                    if cancel is not None and cancel.is_set():
                        raise RequestCancelledError("the request was cancelled")
                    for chunk in stream:
                        text = reading.add(chunk)
                        if reading.first_token:
                            arrived()
                        if cancel is not None and cancel.is_set():
                            raise RequestCancelledError("the request was cancelled")
                        if deadline is not None and time.perf_counter() > deadline:
                            raise GenerationTimeoutError(f"generation exceeded the timeout of {self.timeout} s")
                        if text:
                            yield text
                except Exception as exc:  # a stream closed by another thread's cancel reads as an error
                    if cancel is not None and cancel.is_set() and not isinstance(exc, RequestCancelledError):
                        raise RequestCancelledError("the request was cancelled") from None
                    raise
        yield reading.result(self.client.info(), self._documents())

    async def _achunks(self) -> AsyncIterator[str | GenerationResult]:
        """Async :meth:`_chunks` (cancelling the task closes the stream)."""
        openai = _openai()
        body = await asyncio.to_thread(self._body)  # the first call asks the server for its model
        reading = _Reading()
        deadline = reading.started + self.timeout if self.timeout else None
        with self.client.awaiting_first_token() as arrived:
            with _mapped(openai, self.timeout):
                stream = await self._aopen(body)
            async with stream:
                with _mapped(openai, self.timeout):
                    async for chunk in stream:
                        text = reading.add(chunk)
                        if reading.first_token:
                            arrived()
                        if deadline is not None and time.perf_counter() > deadline:
                            raise GenerationTimeoutError(f"generation exceeded the timeout of {self.timeout} s")
                        if text:
                            yield text
        yield reading.result(self.client.info(), self._documents())

    # ---- the Generation interface --------------------------------------------------------------
    def _posted(self):
        return speculation_board().take(self.request_key())

    def run(self, on_text: Callable[[str], None] | None = None,
            cancel: threading.Event | None = None) -> GenerationResult:
        """Generate to the end (a timed-out attempt is retried unless text was already emitted);
        a speculative request posted for exactly this one is taken instead of sending a new one."""
        taken = self._posted()
        if taken is not None:
            return taken.finish(on_text, cancel)
        emitted = threading.Event()
        for attempt in Retrying(**self._retry_kwargs(lambda: not emitted.is_set())):
            with attempt:
                for item in self._chunks(cancel):
                    if isinstance(item, GenerationResult):
                        return item
                    emitted.set()
                    if on_text:
                        on_text(item)
        raise AssertionError("unreachable: the stream ends with its result")

    async def arun(self) -> GenerationResult:
        """Async :meth:`run`; cancelling the task closes the stream."""
        taken = self._posted()
        if taken is not None:
            return await arun_taken(taken)
        async for attempt in AsyncRetrying(**self._retry_kwargs()):
            with attempt:
                async for item in self._achunks():
                    if isinstance(item, GenerationResult):
                        return item
        raise AssertionError("unreachable: the stream ends with its result")

    def stream(self) -> Iterator[StreamChunk]:
        """Text deltas as they arrive; the last chunk carries the result."""
        taken = self._posted()
        if taken is not None:
            yield from stream_taken(taken)
            return
        chunks = self._chunks()
        try:
            for item in chunks:
                yield StreamChunk(item) if isinstance(item, str) else StreamChunk("", item)
        finally:
            chunks.close()

    async def astream(self) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`."""
        taken = self._posted()
        if taken is not None:
            async for chunk in astream_taken(taken):
                yield chunk
            return
        chunks = self._achunks()
        try:
            async for item in chunks:
                yield StreamChunk(item) if isinstance(item, str) else StreamChunk("", item)
        finally:
            await chunks.aclose()

    def submit(self, on_text: Callable[[str], None]) -> RequestHandle:
        """Send this request once, streamed, on a thread (no timeout, no retry): for speculation.

        The handle's ``cancel`` closes the stream (a server that sends its headers only with the
        first token, as ``ragcache serve`` does, sees it after its prefill); its metrics count the first token (as
        ``admitted`` and ``first_token``: a server does not say when it admitted a request) and
        the generated deltas; the prompt tokens computed are known only when it finishes.
        """
        cancel, opened = threading.Event(), []

        def cancel_request(_rid: int) -> None:
            cancel.set()
            for stream in list(opened):  # unblocks a read waiting for the next chunk (vLLM: even in prefill)
                try:
                    stream.close()
                except Exception:  # noqa: BLE001 - closing a stream its reader is closing too
                    pass

        handle = RequestHandle(self.client.next_rid(), cancel_request)
        metrics = handle.metrics

        def work() -> None:
            try:
                for item in self._chunks(cancel, opened):
                    if isinstance(item, GenerationResult):
                        metrics.computed_tokens = item.computed_tokens
                        metrics.finished = time.perf_counter()
                        handle.future.set_result(item)
                        return
                    if not metrics.first_token:
                        metrics.admitted = metrics.first_token = time.perf_counter()
                    metrics.generated_tokens += 1
                    on_text(item)
            except BaseException as exc:  # delivered through the handle
                if not handle.future.done():
                    handle.future.set_exception(exc)

        threading.Thread(target=work, name=f"ragcache-speculative-{handle.rid}", daemon=True).start()
        return handle


class _mapped:
    """Maps the ``openai`` client's errors to ours: a 4xx answer is InvalidRequestError (never
    retried), a timeout GenerationTimeoutError, anything else from the client ServerError."""

    def __init__(self, openai, timeout: float | None) -> None:
        self.openai, self.timeout = openai, timeout

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        openai = self.openai
        if exc is None or not isinstance(exc, openai.OpenAIError):
            return False
        if isinstance(exc, openai.APITimeoutError):
            raise GenerationTimeoutError(f"generation exceeded the timeout of {self.timeout} s") from exc
        if isinstance(exc, openai.APIStatusError) and 400 <= exc.status_code < 500:
            raise InvalidRequestError(f"the server refused the request ({exc.status_code}): {_message(exc)}") from exc
        raise ServerError(f"the server failed the request: {exc}") from exc


def _message(exc) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    return str(exc)
