"""The embedded RAGCache engine's public API: every way to submit a request and get its answer.

Every entry point (``generate``, ``stream``, ``agenerate``, ``astream``, the pipelined ones, the
LangChain and LlamaIndex adapters, the CLI, ``ragcache bench``) builds a prompt's segments and
goes through :meth:`RAGCacheEngine.submit_segments`, which queues one
:class:`~ragcache_backend.engine.request.Request` on the step loop
(:class:`~ragcache_backend.engine.core.EngineCore`, built from the parts
:func:`~ragcache_backend.engine.setup.build_parts` makes) and returns its handle; the blocking,
async and streaming forms wait on that handle, as nano-vllm's ``generate`` drives ``step()``.

Reuse modes (``EngineConfig.reuse``, or per request): ``exact`` serves only exact prefixes from the
knowledge tree (answers equal those without the cache); ``chunk`` and ``auto`` also serve documents
from chunk caches at any position (Cache-Craft §3): the admission picks a variant per document,
the prefill recomputes its most contextualised tokens, a quality guard recomputes in full a chunk
whose KV moved too far, and the commit records new variants. Only exact computations ever enter
the tree as prefix nodes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence

import torch

from ragcache_backend.cache.chunk_reuse import RecomputeRule
from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.core import EngineClosedError, EngineCore, EngineStats
from ragcache_backend.engine.pipelining import SpeculativePipeline, run_cancellable
from ragcache_backend.engine.request import (
    GenerationResult,
    Request,
    RequestHandle,
    RequestMetrics,
    ReuseMode,
    StreamChunk,
)
from ragcache_backend.engine.scheduler import Scheduler, SchedulerConfig
from ragcache_backend.engine.setup import build_parts
from ragcache_backend.engine.streaming import adrain, drain
from ragcache_backend.errors import ContextWindowError, InvalidRequestError, RequestCancelledError
from ragcache_backend.model.kernels import openmp
from ragcache_backend.model.loader import LoadedModel
from ragcache_backend.model.sampling import SamplingParams
from ragcache_backend.cache.profile import PrefillProfile
from ragcache_backend.prompts.builder import Segment
from ragcache_backend.prompts.detokenizer import IncrementalText
from ragcache_backend.retrieval.documents import Document, content_id

log = logging.getLogger(__name__)

__all__ = ["EngineClosedError", "EngineStats", "GenerationResult", "RAGCacheEngine", "RequestHandle",
           "RequestMetrics", "StreamChunk"]

DocumentLike = Document | str


def _doc_text_id(doc: object) -> tuple[str, str | None]:
    inner = getattr(doc, "document", doc)  # ScoredDocument -> Document
    if isinstance(inner, Document):
        return inner.text, inner.doc_id
    if isinstance(inner, str):
        return inner, content_id(inner)
    raise InvalidRequestError(f"a document must be a Document or a str, got {type(doc).__name__}")


class RAGCacheEngine(EngineCore):
    """Cache-aware generation over a Llama-family model (RAGCache §5), one step loop for all callers.

    Args:
        config: engine configuration; defaults to the embedded SmolLM2 model, PGDSF, 512 MiB
            device tier and 2 GiB host tier, continuous batching of up to 8 sequences.
        loaded: an already loaded model (shares weights between engines, e.g. cache on/off).
        profile: a prefill profile for PGDSF; by default loaded from ``profile_path`` or measured
            once per model/dtype/device/threads (about 15 s for the default model) and saved.
        store: a :class:`~ragcache_backend.retrieval.docstore.DocumentStore` for :meth:`ask`.
        scheduler: batching and reordering knobs; default from ``config``.

    The step loop's thread starts with the first request; :meth:`close` stops it.

    Raises:
        ModelLoadError: the model cannot be loaded.
        CacheBudgetError: the device budget holds less than one block.
        CorruptFileError: the saved profile fails its checksum (delete it to re-measure).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        loaded: LoadedModel | None = None,
        profile: PrefillProfile | None = None,
        store=None,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        super().__init__(build_parts(config or EngineConfig(), loaded=loaded, profile=profile, scheduler=scheduler),
                         store=store)
        self._ids = itertools.count()
        # this thread loaded the model: its OpenMP workers would slow every region of the step loop's thread
        openmp.release_thread_pool()

    # ---- prompts -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def dtype(self) -> torch.dtype:
        """The weights' and the KV's dtype (``EngineConfig.dtype`` resolved: ``"auto"`` picks
        bfloat16 where the native bf16 kernels run, :func:`~ragcache_backend.model.loader.choose_dtype`)."""
        return self.loaded.dtype

    def segments_for(
        self, question: str, documents: Sequence[DocumentLike], sampling: SamplingParams, *,
        question_first: bool = False,
    ) -> tuple[list[Segment], tuple[str, ...]]:
        """Prompt segments for a RAG request, dropping trailing documents that do not fit.

        Documents are kept whole (their KV boundaries matter): the lowest-ranked ones are left out
        with a warning until ``prompt + max_tokens`` fits the context window. ``question_first``
        puts the question before the documents (see :meth:`PromptBuilder.build`).

        Returns:
            ``(segments, dropped_document_ids)``.

        Raises:
            EmptyQueryError: blank question.
            ContextWindowError: the prompt does not fit even with no document.
        """
        pairs = [_doc_text_id(d) for d in documents]
        segments = self.prompts.build(question, pairs, question_first=question_first)
        window = self.loaded.context_window
        dropped: list[str] = []
        fixed = 3 if question_first else 2
        while sum(len(s) for s in segments) + sampling.max_tokens > window and len(segments) > fixed:
            gone = segments.pop(-2)
            dropped.append(gone.doc_id or gone.key)
        if dropped:
            log.warning("left out %d lowest-ranked document(s) to fit the %d-token context window", len(dropped), window)
        self.check_window(segments, sampling)
        return segments, tuple(reversed(dropped))

    def check_window(self, segments: Sequence[Segment], sampling: SamplingParams) -> None:
        """Raise :class:`ContextWindowError` if ``segments`` plus ``max_tokens`` exceed the window."""
        total = sum(len(s) for s in segments)
        if total + sampling.max_tokens > self.loaded.context_window:
            raise ContextWindowError(
                f"prompt of {total} tokens + max_tokens {sampling.max_tokens} exceeds the "
                f"{self.loaded.context_window}-token context window of {self.model_name}"
            )

    # ---- submission (every public call goes through here) ----------------------------------------
    def submit_segments(
        self,
        segments: Sequence[Segment],
        sampling: SamplingParams | None = None,
        *,
        use_cache: bool | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        dropped: tuple[str, ...] = (),
        keep_logits: bool = False,
        reuse: ReuseMode | None = None,
        recompute: RecomputeRule | None = None,
        store: bool = True,
        cache_salt: str | None = None,
        teacher_tokens: Sequence[int] | None = None,
    ) -> RequestHandle:
        """Queue an already segmented prompt on the step loop and return its handle at once.

        The leading cacheable segments (with whole-prompt reuse: all but the last token) are
        served from and inserted into the knowledge tree; the rest is computed.

        Args:
            segments: the prompt (see :class:`~ragcache_backend.prompts.builder.PromptBuilder`).
            sampling: defaults to greedy with ``max_tokens=128``.
            use_cache: override ``config.enable_cache`` for this request.
            on_text: called on the engine thread with each final text delta (keep it short).
            cancel: an event that cancels the request when set (checked every step).
            dropped: ids of documents left out to fit the window, reported in the result.
            keep_logits: keep the prompt's last-token logits on the handle (tests, evaluation).
            reuse: override ``config.reuse`` for this request (``exact``, ``chunk`` or ``auto``).
            recompute: override the chunk modes' recompute rule (``config.recompute_rule()``).
            store: False keeps nothing this request computes in the cache (chunk modes only: an
                evaluation runs several rules over the same cache state).
            cache_salt: a tenant's salt (at most 256 characters): every segment key is salted, so
                KV computed under one salt is never served under another (any tier, chunk caches
                included); None or "" = the shared, unsalted cache.
            teacher_tokens: teacher forcing (evaluation of approximate reuse): these tokens are fed
                one per step instead of sampled ones (``sampling`` is then ignored past the window
                check, done with ``max_tokens = len(teacher_tokens)``), and the logits that
                predicted each are kept on the handle (``forced_logits``, float32 ``[n, vocab]``).
                A stop token among them ends the request there.

        Raises (at once, nothing queued):
            InvalidRequestError: no segments, an unknown reuse mode, a ``logit_bias`` token id
                outside the vocabulary. GrammarError: ``sampling.grammar`` does not compile.
            ContextWindowError. EngineClosedError.
            InvalidRequestError also: ``teacher_tokens`` empty or holding an id outside the vocabulary.
        """
        sampling = sampling or SamplingParams()
        teacher = tuple(int(t) for t in teacher_tokens) if teacher_tokens is not None else ()
        if teacher_tokens is not None:
            if not teacher or min(teacher) < 0 or max(teacher) >= self.runner.vocab_size:
                raise InvalidRequestError(f"teacher_tokens must be 1 or more ids in [0, {self.runner.vocab_size})")
            sampling = SamplingParams(max_tokens=len(teacher))
        if not segments:
            raise InvalidRequestError("a prompt needs at least one segment")
        if cache_salt:
            segments = [dataclasses.replace(s, salt=cache_salt) for s in segments]
        mode = self.config.reuse if reuse is None else reuse
        if mode not in ("exact", "chunk", "auto"):
            raise InvalidRequestError(f"reuse must be 'exact', 'chunk' or 'auto', got {reuse!r}")
        if not store and mode == "exact":
            raise InvalidRequestError("store=False is only for the chunk reuse modes")
        self.check_window(segments, sampling)
        if self._closing:
            raise EngineClosedError("the engine is closed")
        vocab = self.runner.vocab_size
        if sampling.logit_bias and sampling.logit_bias[-1][0] >= vocab:
            raise InvalidRequestError(f"logit_bias token id {sampling.logit_bias[-1][0]} is outside the "
                                      f"vocabulary of {vocab} tokens")
        matcher = self.grammars.matcher(sampling.grammar) if sampling.grammar is not None else None
        penalty_ids = (tuple(t for s in segments for t in s.token_ids) if sampling.repetition_penalty != 1.0 else ())
        rid = next(self._ids)
        handle = RequestHandle(rid, self.cancel)
        seed = sampling.seed
        req = Request(
            rid=rid, segments=tuple(segments), plan=self.prompt_plan(segments, use_cache), sampling=sampling,
            dropped=dropped, on_text=on_text or (lambda _t: None), handle=handle,
            text=IncrementalText(self.loaded.tokenizer, sampling.stop), cancel=cancel or threading.Event(),
            keep_logits=keep_logits, reuse=mode, recompute=recompute or self._rule, store=store,
            generator=torch.Generator().manual_seed(seed) if seed is not None else None,
            matcher=matcher, penalty_ids=penalty_ids, teacher=teacher,
        )
        # the caller's thread may have run torch of its own (an application's embedding model): its
        # OpenMP workers would slow the step loop's regions and barriers while this request runs
        openmp.release_thread_pool()
        self._enqueue(req)
        return handle

    def submit(self, question: str, documents: Sequence[DocumentLike] = (), sampling: SamplingParams | None = None,
               *, question_first: bool = False, **kw) -> RequestHandle:
        """Queue a RAG request (question + documents in retrieval order); see :meth:`submit_segments`."""
        sampling = sampling or SamplingParams()
        segments, dropped = self.segments_for(question, documents, sampling, question_first=question_first)
        return self.submit_segments(segments, sampling, dropped=dropped, **kw)

    # ---- blocking and async clients of the loop ---------------------------------------------------
    def generate(self, question: str, documents: Sequence[DocumentLike] = (), sampling: SamplingParams | None = None,
                 *, use_cache: bool | None = None, on_text: Callable[[str], None] | None = None,
                 reuse: ReuseMode | None = None, cache_salt: str | None = None) -> GenerationResult:
        """Answer ``question`` from ``documents`` (in retrieval order), reusing cached KV.

        Args:
            question: the user question (non-blank).
            documents: :class:`Document`, ``ScoredDocument`` or plain strings.
            sampling: defaults to greedy with ``max_tokens=128``.
            use_cache: override ``config.enable_cache`` for this request.
            on_text: called with each final text delta as it is generated (streaming).
            reuse: override ``config.reuse`` (``exact``, ``chunk``, ``auto``) for this request.
            cache_salt: tenant salt (see :meth:`submit_segments`).

        Raises:
            EmptyQueryError, ContextWindowError, CacheBudgetError (the prompt can never fit the
            device arena), RequestCancelledError, InvalidRequestError (unknown reuse mode).
        """
        return self.submit(question, documents, sampling, use_cache=use_cache, on_text=on_text, reuse=reuse,
                           cache_salt=cache_salt).result()

    def generate_segments(self, segments: Sequence[Segment], sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        """Blocking form of :meth:`submit_segments` (used by the adapters)."""
        handle = self.submit_segments(segments, sampling, **kw)
        try:
            return handle.result()
        finally:
            if not handle.done():  # interrupted while waiting
                handle.cancel()

    def ask(self, question: str, k: int = 3, sampling: SamplingParams | None = None, *, pipelined: bool = False,
            num_stages: int | None = None, **kw) -> GenerationResult:
        """Retrieve the top-``k`` documents from ``store`` and answer from them.

        ``pipelined``: search in ``num_stages`` stages (default ``config.search_stages``) and
        speculate on the candidates while searching (:meth:`generate_pipelined`); the answer is the
        same, the result also reports the search time and its unoverlapped part.
        """
        if self.store is None:
            raise InvalidRequestError("this engine has no document store; pass store= or use generate()")
        if pipelined:
            stages = self.store.search_stages(question, k, num_stages or self.config.search_stages)
            return self.generate_pipelined(question, ([h.document for h in hits] for hits in stages), sampling, **kw)
        t0 = time.perf_counter()
        hits = self.store.search(question, k)
        search_s = time.perf_counter() - t0
        result = self.generate(question, [h.document for h in hits], sampling, **kw)
        return dataclasses.replace(result, ttft_s=result.ttft_s + search_s, total_s=result.total_s + search_s,
                                   search_s=search_s, unoverlapped_search_s=search_s)

    # ---- pipelined requests (RAGCache §5.3) ---------------------------------------------------------
    def speculative_pipeline(
        self, question: str, sampling: SamplingParams | None = None, *, question_first: bool = False,
        search_timeout_s: float | None = None, cancel: threading.Event | None = None,
        max_prefill_bs: int | None = None, **kw,
    ) -> SpeculativePipeline[DocumentLike]:
        """A :class:`~ragcache_backend.engine.pipelining.SpeculativePipeline` that answers
        ``question`` from candidate document lists (Algorithm 2); ``kw`` as :meth:`submit_segments`.

        Raises (at once): EmptyQueryError (blank question), InvalidRequestError (a bad search timeout).
        """
        sampling = sampling or SamplingParams()
        self.prompts.build(question, [])  # a blank question fails here, before any search
        if search_timeout_s is not None and not search_timeout_s > 0:
            raise InvalidRequestError(f"search_timeout_s must be > 0, got {search_timeout_s!r}")

        def submit(docs: Sequence[DocumentLike], on_text: Callable[[str], None]) -> RequestHandle:
            return self.submit(question, docs, sampling, question_first=question_first, on_text=on_text, **kw)

        return SpeculativePipeline(
            self, submit, key=lambda d: _doc_text_id(d)[1],
            max_prefill_bs=self.config.max_prefill_bs if max_prefill_bs is None else max_prefill_bs,
            deadline_s=None if search_timeout_s is None else time.perf_counter() + search_timeout_s,
            cancel=cancel or threading.Event(),
        )

    def generate_pipelined(self, question: str, candidates: Iterable[Sequence[DocumentLike]],
                           sampling: SamplingParams | None = None, *, on_text: Callable[[str], None] | None = None,
                           **kw) -> GenerationResult:
        """Answer ``question`` while its vector search runs (RAGCache §5.3, Algorithm 2).

        Args:
            question: the user question.
            candidates: the current top-k after each stage of a staged search (e.g.
                ``[h.document for h in hits] for hits in store.search_stages(q, k, 4)``); the last
                list is the search's result. Consumed on the calling thread.
            sampling: as :meth:`generate`.
            on_text: text deltas of the answer, only once its documents are final.
            kw: ``question_first``, ``search_timeout_s`` (seconds), ``cancel`` (an event),
                ``max_prefill_bs`` (override ``config.max_prefill_bs``), and :meth:`submit_segments`'s.

        Returns:
            the answer for the final documents, identical to ``generate(question, final)``; its
            ``ttft_s``/``total_s`` count from the start of the search, and ``search_s``,
            ``unoverlapped_search_s``, ``speculative_requests``, ``wasted_tokens`` and
            ``speculation_kept`` say what the pipelining did.

        Raises:
            RetrievalError: the search failed or timed out (speculative work freed).
            RequestCancelledError, EmptyQueryError, ContextWindowError, as :meth:`generate`.
        """
        return self.speculative_pipeline(question, sampling, **kw).run(candidates, on_text)

    def stream_pipelined(self, question: str, candidates: Iterable[Sequence[DocumentLike]],
                         sampling: SamplingParams | None = None, **kw) -> Iterator[StreamChunk]:
        """Streaming :meth:`generate_pipelined`: text deltas once the documents are final, the last
        chunk carrying the result. Closing the iterator early cancels the request and frees its
        speculative work."""
        for item in self.speculative_pipeline(question, sampling, **kw).stream(candidates):
            yield StreamChunk(item) if isinstance(item, str) else StreamChunk("", item)

    async def agenerate_pipelined(self, question: str, candidates: Iterable[Sequence[DocumentLike]],
                                  sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        """Async :meth:`generate_pipelined`: the search runs on a worker thread; cancelling the task
        cancels the request (between stages) and frees its speculative work."""
        cancel = threading.Event()
        pipeline = self.speculative_pipeline(question, sampling, cancel=cancel, **kw)
        return await run_cancellable(lambda: pipeline.run(candidates), cancel)

    def stream(self, question: str, documents: Sequence[DocumentLike] = (), sampling: SamplingParams | None = None,
               **kw) -> Iterator[StreamChunk]:
        """Like :meth:`generate` but yields text deltas; the last chunk carries the result.

        Closing the iterator early cancels the request (its KV blocks are freed).
        """
        sampling = sampling or SamplingParams()
        segments, dropped = self.segments_for(question, documents, sampling)
        return self.stream_segments(segments, sampling, dropped=dropped, **kw)

    def stream_segments(self, segments: Sequence[Segment], sampling: SamplingParams | None = None, **kw) -> Iterator[StreamChunk]:
        """Streaming form of :meth:`submit_segments`; closing the iterator cancels the request."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        handle = self.submit_segments(segments, sampling, on_text=lambda t: out.put(StreamChunk(t)), **kw)
        handle.future.add_done_callback(lambda fut: out.put(_final_chunk(fut)))
        return self._stream(out, handle)

    @staticmethod
    def _stream(out: queue.SimpleQueue, handle: RequestHandle) -> Iterator[StreamChunk]:
        try:
            yield from drain(out)
        finally:
            if not handle.done():  # the consumer walked away: cancel, and return once blocks are freed
                handle.cancel()
                concurrent.futures.wait([handle.future])

    async def agenerate(self, question: str, documents: Sequence[DocumentLike] = (), sampling: SamplingParams | None = None,
                        **kw) -> GenerationResult:
        """Async :meth:`generate`: concurrent calls share forward steps; cancelling the task cancels the request."""
        return await self._await(self.submit(question, documents, sampling, **kw))

    async def agenerate_segments(self, segments: Sequence[Segment], sampling: SamplingParams | None = None,
                                 **kw) -> GenerationResult:
        """Async form of :meth:`generate_segments`."""
        return await self._await(self.submit_segments(segments, sampling, **kw))

    @staticmethod
    async def _await(handle: RequestHandle) -> GenerationResult:
        inner = asyncio.wrap_future(handle.future)
        inner.add_done_callback(_retrieved)  # its error reaches the caller through the shield, or is moot
        try:
            return await asyncio.shield(inner)
        finally:
            if not handle.done():  # the awaiting task was cancelled
                handle.cancel()
                await _settled(handle)

    async def astream(self, question: str, documents: Sequence[DocumentLike] = (), sampling: SamplingParams | None = None,
                      **kw) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`."""
        sampling = sampling or SamplingParams()
        segments, dropped = self.segments_for(question, documents, sampling)
        async with contextlib.aclosing(self.astream_segments(segments, sampling, dropped=dropped, **kw)) as inner:
            async for chunk in inner:
                yield chunk

    async def astream_segments(self, segments: Sequence[Segment], sampling: SamplingParams | None = None,
                               **kw) -> AsyncIterator[StreamChunk]:
        """Async streaming form of :meth:`submit_segments`; closing the stream cancels the request."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        put = out.put_nowait
        handle = self.submit_segments(segments, sampling, on_text=lambda t: loop.call_soon_threadsafe(put, StreamChunk(t)), **kw)
        handle.future.add_done_callback(lambda fut: loop.call_soon_threadsafe(put, _final_chunk(fut)))
        try:
            async for item in adrain(out):
                yield item
        finally:
            if not handle.done():
                handle.cancel()
                await _settled(handle)

    def first_token_logits(self, segments: Sequence[Segment], *, use_cache: bool | None = None,
                           **kw) -> tuple[torch.Tensor, int]:
        """Float32 ``[vocab]`` logits of the prompt's last token and the prompt tokens reused,
        through the normal request path (admit, prefill, commit, finish). For tests and evaluation;
        ``kw`` as :meth:`submit_segments` (``reuse``, ``recompute``, ``store``)."""
        handle = self.submit_segments(segments, SamplingParams(max_tokens=1), use_cache=use_cache, keep_logits=True, **kw)
        result = handle.result()
        assert handle.first_logits is not None
        return handle.first_logits, result.cached_tokens

    # ---- lifecycle -------------------------------------------------------------------------------
    def configure_scheduler(self, config: SchedulerConfig) -> None:
        """Replace the batching and reordering knobs; only while no request is in flight.

        Raises:
            InvalidRequestError: requests are in flight.
        """
        with self._step_lock:
            if self.in_flight:
                raise InvalidRequestError("the scheduler can only be reconfigured while no request is in flight")
            self.scheduler = Scheduler(config)

    def __enter__(self) -> RAGCacheEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)


def _retrieved(fut: asyncio.Future) -> None:
    """Mark an asyncio future's exception as retrieved (asyncio logs one nobody read)."""
    if not fut.cancelled():
        fut.exception()


async def _settled(handle: RequestHandle) -> None:
    """Wait until a cancelled request has been finished by the loop (its blocks freed). The
    request's error is retrieved whenever it comes: the caller asked for the cancellation, and may
    itself be cancelled while it waits (a server shutting down)."""
    fut = asyncio.wrap_future(handle.future)
    fut.add_done_callback(_retrieved)
    await asyncio.wait([fut])


def _final_chunk(fut) -> StreamChunk | BaseException:
    """The last item of a stream: the result chunk, or the request's error."""
    if fut.cancelled():
        return RequestCancelledError("the request was cancelled")
    exc = fut.exception()
    return exc if exc is not None else StreamChunk("", fut.result())
