"""What the LangChain and LlamaIndex adapters share (framework-independent).

* the **default engine** (embedded SmolLM2, built lazily, once per process, thread-safe) for
  adapters given no engine, and **default document stores** (one per corpus folder, the Python
  documentation by default);
* the process-wide :class:`~ragcache_backend.prompts.recognition.DocumentRecognizer`: every store our
  retrievers search (and the store of every engine our models use) is watched by it, so the
  documents they return are recognised in any prompt that later reaches one of our models;
* :class:`Generation`: one request (segments + sampling) run on an engine with a ``timeout`` and
  ``max_retries`` (tenacity), blocking, streaming, or async. Only transient errors are retried
  (:data:`TRANSIENT_ERRORS`), never a typed input error, and a stream only before its first chunk.
  A generation takes over a speculative generation of exactly the same request that one of our
  retrievers posted while its search ran (:mod:`ragcache_integrations._speculation`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from tenacity import AsyncRetrying, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ragcache_backend.config import EngineConfig
from ragcache_backend.retrieval.docstore import DocumentStore, build_index
from ragcache_backend.engine.engine import GenerationResult, RAGCacheEngine, StreamChunk
from ragcache_backend.engine.pipelining import SpeculationOutcome, run_cancellable
from ragcache_backend.engine.request import RequestHandle
from ragcache_backend.errors import InvalidRequestError, RAGCacheError, RequestCancelledError
from ragcache_backend.prompts.builder import Segment
from ragcache_backend.prompts.recognition import DocumentRecognizer, PromptSegmenter
from ragcache_backend.model.sampling import SamplingParams
from ragcache_integrations._speculation import speculation_board

__all__ = ["GenerationTimeoutError", "TRANSIENT_ERRORS", "UnsupportedContentError", "Generation",
           "arun_taken", "astream_taken", "default_engine", "engine_for", "retry_policy", "stream_taken", "default_store", "known_documents", "segmenter"]

T = TypeVar("T")


class UnsupportedContentError(InvalidRequestError):
    """A message holds content other than text (image, audio, file, tool call...)."""


class GenerationTimeoutError(RAGCacheError, TimeoutError):
    """A generation ran past the adapter's ``timeout`` and was cancelled."""


#: Errors worth another attempt: a timed-out attempt. A momentarily full device arena is no error
#: (the engine's step loop waits for room); a prompt larger than the whole arena raises
#: CacheBudgetError at once and is never retried.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (GenerationTimeoutError,)


class _Lazy(Generic[T]):
    """A value built on first use, once, under a lock."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory, self._value, self._lock = factory, None, threading.Lock()

    def get(self) -> T:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._factory()
        return self._value


_ENGINES: dict[Path, _Lazy[RAGCacheEngine]] = {}
_ENGINES_LOCK = threading.Lock()
_RECOGNIZER = DocumentRecognizer()
_STORES: dict[Path, _Lazy[DocumentStore]] = {}
_STORES_LOCK = threading.Lock()


def default_engine() -> RAGCacheEngine:
    """The process-wide default engine (SmolLM2-135M-Instruct, default config), built on first use."""
    return engine_for(None)


def engine_for(model: str | None) -> RAGCacheEngine:
    """The process-wide engine (default config) of ``model``: a ``.gguf`` file, an HF folder or a
    packaged model's name (None: the default, SmolLM2-135M-Instruct); built on first use, one
    per model file, shared by every adapter given the same model.

    Raises:
        ModelLoadError: the model cannot be found or loaded (the architecture is checked first)."""
    from ragcache_backend.model.loader import resolve_model

    path = resolve_model(model).resolve()
    with _ENGINES_LOCK:
        lazy = _ENGINES.setdefault(path, _Lazy(lambda: RAGCacheEngine(EngineConfig(model=model))))
    return lazy.get()


def default_store(corpus_dir: Path | str | None = None) -> DocumentStore:
    """The document store of ``corpus_dir`` (default: the Python documentation), one per process.

    Built with :func:`~ragcache_backend.retrieval.docstore.build_index`, so it is persisted and reloaded
    while the corpus is unchanged. Raises CorpusError for a missing or empty corpus.
    """
    from ragcache_backend.demo.datasets import python_docs_dir

    folder = Path(corpus_dir).resolve() if corpus_dir is not None else python_docs_dir()
    with _STORES_LOCK:
        lazy = _STORES.setdefault(folder, _Lazy(lambda: build_index(folder, progress=False)))
    return lazy.get()


def known_documents() -> DocumentRecognizer:
    """The process-wide recognizer of documents our adapters may meet inside prompts."""
    return _RECOGNIZER


def segmenter(engine: RAGCacheEngine, recognizer: DocumentRecognizer | None = None, *,
              documents_alone: bool = False) -> PromptSegmenter:
    """A segmenter for ``engine``'s tokenizer over ``recognizer`` (default :func:`known_documents`);
    the engine's own store, if any, is watched. ``documents_alone``: documents tokenised on their
    own, so chunk caches can reuse them at any position (see :class:`PromptSegmenter`)."""
    recognizer = recognizer or _RECOGNIZER
    if engine.store is not None:
        recognizer.watch(engine.store)
    return PromptSegmenter(engine.prompts, recognizer, documents_alone=documents_alone)


class _Linked(threading.Event):
    """An event that also reads as set when its parent is set (per-attempt timeout + caller cancel)."""

    def __init__(self, parent: threading.Event) -> None:
        super().__init__()
        self._parent = parent

    def own_flag(self) -> bool:
        return super().is_set()

    def is_set(self) -> bool:
        return super().is_set() or self._parent.is_set()


@dataclass(slots=True)
class Generation:
    """One request ready to run on an engine.

    Attributes:
        engine: where it runs.
        segments: the segmented prompt.
        sampling: sampling parameters (``stop`` included).
        use_cache: None = the engine's setting; False = recompute everything (baseline).
        timeout: seconds per attempt; the request is cancelled at its next decode step after that.
        max_retries: further attempts after a transient error.
        reuse: None = the engine's setting; else ``exact``, ``chunk`` or ``auto``.
    """

    engine: RAGCacheEngine
    segments: tuple[Segment, ...]
    sampling: SamplingParams
    use_cache: bool | None = None
    timeout: float | None = None
    max_retries: int = 0
    reuse: str | None = None

    @property
    def target(self) -> RAGCacheEngine:
        """Where the request runs (speculative pipelining reads its pool)."""
        return self.engine

    def request_key(self) -> tuple:
        """What makes two generations the same request (engine, prompt tokens, sampling, cache
        settings): a speculative generation posted under this key answers exactly like this one."""
        return (id(self.engine), self.segments, self.sampling, self.use_cache, self.reuse)

    def _posted(self) -> SpeculationOutcome | None:
        """The speculative generation of exactly this request a retriever posted, taken off the board."""
        return speculation_board().take(self.request_key())

    def submit(self, on_text: Callable[[str], None]) -> RequestHandle:
        """Queue this generation once on the engine (no timeout, no retry): for speculation."""
        return self.engine.submit_segments(self.segments, self.sampling, use_cache=self.use_cache,
                                           on_text=on_text, reuse=self.reuse)

    def _retry_kwargs(self, may_retry: Callable[[], bool] = lambda: True) -> dict:
        return retry_policy(self.max_retries, may_retry)

    def run(self, on_text: Callable[[str], None] | None = None,
            cancel: threading.Event | None = None) -> GenerationResult:
        """Generate to the end; a transient error is retried unless text was already emitted.

        A speculative generation of exactly this request, posted by one of our retrievers, is
        taken instead of starting a new one (:mod:`ragcache_integrations._speculation`).
        """
        taken = self._posted()
        if taken is not None:
            return taken.finish(on_text, cancel)
        emitted = threading.Event()

        def emit(text: str) -> None:
            emitted.set()
            if on_text:
                on_text(text)

        for attempt in Retrying(**self._retry_kwargs(lambda: not emitted.is_set())):
            with attempt:
                return self._attempt(emit, cancel or threading.Event())
        raise AssertionError("unreachable: tenacity reraises the last error")

    def _attempt(self, on_text: Callable[[str], None], cancel: threading.Event) -> GenerationResult:
        expired = _Linked(cancel)  # set by the timer; also reads as set once the caller cancels
        timer = threading.Timer(self.timeout, expired.set) if self.timeout else None
        if timer:
            timer.daemon = True
            timer.start()
        try:
            return self.engine.generate_segments(self.segments, self.sampling, use_cache=self.use_cache,
                                                 on_text=on_text, cancel=expired, reuse=self.reuse)
        except RequestCancelledError:
            if expired.own_flag():
                raise GenerationTimeoutError(f"generation exceeded the timeout of {self.timeout} s") from None
            raise
        finally:
            if timer:
                timer.cancel()

    async def arun(self) -> GenerationResult:
        """Async :meth:`run` on the engine's step loop: concurrent calls (a LangChain ``abatch``,
        ``asyncio.gather``) share forward steps. Cancelling the task cancels the request."""
        taken = self._posted()
        if taken is not None:
            return await arun_taken(taken)
        async for attempt in AsyncRetrying(**self._retry_kwargs()):
            with attempt:
                call = self.engine.agenerate_segments(self.segments, self.sampling, use_cache=self.use_cache,
                                                      reuse=self.reuse)
                try:
                    return await asyncio.wait_for(call, self.timeout)
                except TimeoutError:
                    raise GenerationTimeoutError(f"generation exceeded the timeout of {self.timeout} s") from None
        raise AssertionError("unreachable: tenacity reraises the last error")

    def stream(self) -> Iterator[StreamChunk]:
        """Text deltas as they are generated; the last chunk carries the result."""
        taken = self._posted()
        if taken is not None:
            yield from stream_taken(taken)
            return
        for attempt in Retrying(**self._retry_kwargs()):
            with attempt:
                deadline = time.monotonic() + self.timeout if self.timeout else None
                chunks = self.engine.stream_segments(self.segments, self.sampling, use_cache=self.use_cache,
                                                     reuse=self.reuse)
                first = self._checked(next(chunks), chunks, deadline)
        try:
            yield first
            for chunk in chunks:
                yield self._checked(chunk, chunks, deadline)
        finally:
            chunks.close()  # a consumer that stops early cancels the request

    async def astream(self) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`."""
        taken = self._posted()
        if taken is not None:
            async for chunk in astream_taken(taken):
                yield chunk
            return
        async for attempt in AsyncRetrying(**self._retry_kwargs()):
            with attempt:
                deadline = time.monotonic() + self.timeout if self.timeout else None
                chunks = self.engine.astream_segments(self.segments, self.sampling, use_cache=self.use_cache,
                                                      reuse=self.reuse)
                first = await self._achecked(await anext(chunks), chunks, deadline)
        try:
            yield first
            async for chunk in chunks:
                yield await self._achecked(chunk, chunks, deadline)
        finally:
            await chunks.aclose()

    def _checked(self, chunk: StreamChunk, chunks: Iterator, deadline: float | None) -> StreamChunk:
        if chunk.result is None and deadline is not None and time.monotonic() > deadline:
            chunks.close()  # cancels the request
            raise GenerationTimeoutError(f"generation exceeded the timeout of {self.timeout} s")
        return chunk

    async def _achecked(self, chunk: StreamChunk, chunks: AsyncIterator, deadline: float | None) -> StreamChunk:
        if chunk.result is None and deadline is not None and time.monotonic() > deadline:
            await chunks.aclose()
            raise GenerationTimeoutError(f"generation exceeded the timeout of {self.timeout} s")
        return chunk


def retry_policy(max_retries: int, may_retry: Callable[[], bool] = lambda: True) -> dict:
    """tenacity keyword arguments of every adapter request, embedded or on a server: up to
    ``max_retries`` further attempts after a :data:`TRANSIENT_ERRORS` error, while ``may_retry()``
    (False once text was emitted), with exponential waits (0.1 s doubling, at most 2 s)."""
    return dict(
        stop=stop_after_attempt(max_retries + 1),
        retry=retry_if_exception(lambda exc: isinstance(exc, TRANSIENT_ERRORS) and may_retry()),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        reraise=True,
    )


def stream_taken(taken: SpeculationOutcome) -> Iterator[StreamChunk]:
    """A posted speculative generation as a stream of chunks (held text first, the result last)."""
    for item in taken.chunks():
        yield StreamChunk(item) if isinstance(item, str) else StreamChunk("", item)


async def arun_taken(taken: SpeculationOutcome) -> GenerationResult:
    """A posted speculative generation's result, awaited; cancelling the task cancels it."""
    cancel = threading.Event()
    return await run_cancellable(lambda: taken.finish(None, cancel), cancel)


async def astream_taken(taken: SpeculationOutcome) -> AsyncIterator[StreamChunk]:
    """A posted speculative generation as an async stream of chunks (held text first)."""
    loop = asyncio.get_running_loop()
    out: asyncio.Queue = asyncio.Queue()
    opened = time.perf_counter()
    taken.gate.open(lambda text: loop.call_soon_threadsafe(out.put_nowait, text))
    taken.handle.future.add_done_callback(lambda _f: loop.call_soon_threadsafe(out.put_nowait, None))
    try:
        while (text := await out.get()) is not None:
            yield StreamChunk(text)
        result = taken.handle.result()
    except BaseException:
        await asyncio.to_thread(taken.discard)
        raise
    yield StreamChunk("", taken.report(result, opened))
