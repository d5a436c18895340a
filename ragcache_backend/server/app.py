"""The FastAPI app (:func:`create_app`) and the uvicorn runner with a graceful drain (:func:`serve`).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream``),
``GET /v1/models``, ``POST /v1/embeddings``, ``POST /tokenize``, ``POST /detokenize``,
``GET /health``, ``GET /metrics``; all ask a :class:`~ragcache_backend.server.startup.ServiceSlot`
for the service, so a server can listen before its engine is built. Every error is OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``): malformed JSON, unknown fields and bad values
are 400, an unknown model 404, a busy or draining server 503, an engine failure 500.

Shutdown (SIGTERM or SIGINT): new requests get 503 and the listening socket closes; requests in
flight get ``drain_timeout`` seconds to finish, the rest are cancelled (their KV freed); then the
caller closes the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.model.loader import DEFAULT_MODEL_NAME
from ragcache_backend.retrieval.documents import Document
from ragcache_backend.server.errors import APIError
from ragcache_backend.server.heap import HeapTrimmer
from ragcache_backend.server.metrics import CONTENT_TYPE
from ragcache_backend.server.schema import (
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from ragcache_backend.server.service import CompletionService, endpoint_label
from ragcache_backend.server.startup import ServiceSlot
from ragcache_backend.server.utilities import TokenRoutes
from ragcache_backend.server.settings import ServerSettings

__all__ = ["DrainingServer", "bind_socket", "create_app", "serve"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class _EventStream(StreamingResponse):
    """Server-sent events whose iterator is always closed (so an abandoned stream cancels its request)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body.model_dump(), status_code=error.status)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    unknown = [str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden" and len(e["loc"]) == 2]
    if unknown:
        return APIError(400, f"unknown field(s) in the request body: {', '.join(unknown)}", param=unknown[0],
                        code="unknown_parameter")
    for e in errors:
        if e.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}",
                            code="invalid_json")
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', '')}"
                        for e in errors[:5])
    return APIError(400, message or "invalid request body", param=param, code="invalid_value")


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Await ``work`` (a non-streaming generation); if the client disconnects first, cancel it (the
    engine request is cancelled and its KV freed) and answer 499 (read by no one)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=499)
    finally:
        if not task.done():  # this handler was cancelled (server shutdown)
            task.cancel()


def create_app(engine: RAGCacheEngine, settings: ServerSettings | None = None, *,
               index_documents: Sequence[Document] | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (which the caller owns and closes).

    ``app.state.service`` is its :class:`CompletionService` (drain, metrics). Each app has its own
    Prometheus registry, so several apps can live in one process. ``index_documents``: the
    documents of ``settings.index`` if already loaded (None: loaded here).

    Raises:
        InvalidRequestError, CorruptFileError: a bad ``settings.index`` or learned documents' path.
    """
    settings = settings or ServerSettings()
    service = CompletionService(engine, settings, index_documents=index_documents)
    app = app_over(ServiceSlot(service), settings)
    app.state.service = service
    return app


def app_over(slot: ServiceSlot, settings: ServerSettings) -> FastAPI:
    """The app over ``slot``: every route asks it for the service (503 ``starting`` until there is
    one). ``app.state.slot`` is the slot."""
    app = FastAPI(title="ragcache", summary="OpenAI-compatible API with document-level KV caching",
                  responses={400: {"model": ErrorResponse}})
    app.state.slot = slot
    # Prompts are built (chat template, tokenizer, document recognition, grammars) on one thread of
    # their own: a multi-megabyte body takes seconds to tokenize, and on the event loop that stalled
    # every stream and /health meanwhile. One thread: the prompt assembler's registry sees one caller.
    prompting = ThreadPoolExecutor(1, thread_name_prefix="ragcache-prompt")

    async def off_loop(fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(prompting, fn, *args)

    def failed(path: str, status: int) -> None:
        if slot.ready:
            slot.get().metrics.failed(endpoint_label(path), status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        failed(request.url.path, exc.status)
        response = _error_response(exc)
        if exc.body.error.code == "starting":
            response.headers["Retry-After"] = "5"
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        failed(request.url.path, error.status)
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s", request.url.path)
        failed(request.url.path, 500)
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error",
                                        code="internal_error"))

    def guard(authorization: str | None = Header(None)) -> None:
        """Bearer authentication (when an api_key is set), then 503 while starting or draining."""
        key = settings.api_key.get_secret_value() if settings.api_key is not None else None
        if key and authorization != f"Bearer {key}":
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                           type="authentication_error", code="invalid_api_key")
        slot.get().check_open()

    routes: list[TokenRoutes] = []  # one per service (it holds the embedder, loaded on first use)

    def tokens() -> TokenRoutes:
        service = slot.get()
        if not routes or routes[0].service is not service:
            routes[:] = [TokenRoutes(service)]
        return routes[0]

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(guard)])

    @v1.post("/chat/completions", response_model=ChatCompletion, response_model_exclude_none=True)
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               x_cache_salt: str | None = Header(None)):
        service = slot.get()
        req = await off_loop(service.prepare, body, x_cache_salt, time.perf_counter())
        if req.stream:
            return _EventStream(await service.open_stream(req))
        return await _unless_disconnected(request, service.generate(req))

    @v1.post("/completions", response_model=CompletionResponse, response_model_exclude_none=True)
    async def completions(body: CompletionRequest, request: Request, x_cache_salt: str | None = Header(None)):
        service = slot.get()
        req = await off_loop(service.prepare, body, x_cache_salt, time.perf_counter())
        if req.stream:
            return _EventStream(await service.open_stream(req))
        return await _unless_disconnected(request, service.generate(req))

    @v1.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        return slot.get().models()

    @v1.get("/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> ModelCard:
        """The SDK's ``models.retrieve``: the served model's card, else 404 ``model_not_found``."""
        card = slot.get().models().data[0]
        if model_id != card.id:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {card.id!r}",
                           param="model", code="model_not_found")
        return card

    @v1.post("/embeddings", response_model=EmbeddingResponse)
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        return await tokens().embeddings(body)

    app.include_router(v1)
    plain = APIRouter(dependencies=[Depends(guard)])  # vLLM's paths, outside /v1

    @plain.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await off_loop(tokens().tokenize, body)

    @plain.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return tokens().detokenize(body)

    app.include_router(plain)

    @app.get("/health", response_model=HealthResponse)
    async def health() -> JSONResponse:
        body = slot.health()
        return JSONResponse(body.model_dump(), status_code=200 if body.status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(slot.get().metrics.render(), media_type=CONTENT_TYPE)

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server that turns the app's service to draining on SIGTERM/SIGINT and, once it
    stopped gracefully, returns normally (exit status 0) instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, slot: ServiceSlot) -> None:
        super().__init__(config)
        self.slot = slot

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.slot.begin_drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet: connections are refused until the
    server starts), with Nagle's algorithm off (``TCP_NODELAY``, inherited by accepted connections).

    The socket is made with the protocol ``getaddrinfo`` gives (``IPPROTO_TCP``): asyncio sets
    ``TCP_NODELAY`` only on sockets whose ``proto`` says TCP, and a socket made with protocol 0
    kept Nagle on. A response's body, written after its headers, then waited for the client's
    delayed ACK: 40 ms added to every request after the first on a kept-alive connection
    (measured: ``GET /health`` 44 ms instead of 1 ms; every streamed first token 40 ms late).

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(engine: RAGCacheEngine | Callable[[], RAGCacheEngine], settings: ServerSettings,
          sock: socket.socket | None = None, *, index_documents: Sequence[Document] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, drain, then close the engine.

    Args:
        engine: the engine, or a function that builds it: then the server listens at once,
            answers ``/health`` with ``starting`` (503) while it runs in a background thread, and
            serves once it returns (:mod:`~ragcache_backend.server.startup`). The engine is closed
            (remaining requests cancelled) when the server stops.
        settings: host, port, log level, drain timeout...
        sock: an already bound socket (see :func:`bind_socket`); None binds ``settings.host:port``.
        index_documents: the documents of ``settings.index`` if already loaded (None: loaded here).

    Raises:
        whatever building the engine raised (ModelLoadError...), once the server has stopped.
    """
    built: list[RAGCacheEngine] = []
    if isinstance(engine, RAGCacheEngine):
        service = CompletionService(engine, settings, index_documents=index_documents)
        slot = ServiceSlot(service)
        built.append(engine)
    else:
        slot = ServiceSlot(model=settings.served_model_name or Path(settings.model or DEFAULT_MODEL_NAME).name)
    app = app_over(slot, settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=settings.drain_timeout, lifespan="off")
    server = DrainingServer(config, slot)

    def build() -> None:
        try:
            started = time.monotonic()
            built.append(engine())
            slot.set(CompletionService(built[0], settings, index_documents=index_documents))
            logging.getLogger("uvicorn.error").info("ragcache ready: %s loaded in %.1f s", slot.get().model_name,
                                                    time.monotonic() - started)
        except BaseException as exc:  # the server cannot serve: stop it, the caller raises the error
            slot.failure = exc
            server.should_exit = True

    builder = None if slot.ready else threading.Thread(target=build, name="ragcache-startup", daemon=True)
    try:
        if sock is not None:
            host, port = sock.getsockname()[:2]
            logging.getLogger("uvicorn.error").info("ragcache %s on http://%s:%d (Ctrl+C to stop)",
                                                    "serving" if slot.ready else "starting", host, port)
        if builder is not None:
            builder.start()
        # the host tier's freed buffers go back to the OS, once the engine is idle (server/heap.py)
        with HeapTrimmer(busy=lambda: bool(built) and built[0].in_flight > 0):
            server.run(sockets=[sock] if sock is not None else None)
    finally:
        if builder is not None:
            builder.join()
        for built_engine in built:
            built_engine.close(cancel=True, timeout=30.0)
    if slot.failure is not None:
        raise slot.failure
