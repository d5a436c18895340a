"""The embedded RAGCache engine: one request lifecycle and one step loop for every caller.

Every entry point (``generate``, ``stream``, ``agenerate``, ``astream``, the LangChain and
LlamaIndex adapters, the CLI, ``ragcache bench``) submits a :class:`~ragcache_backend.engine.request.Request`
to the engine's step loop and waits on its handle, as nano-vllm's ``generate`` drives ``step()``.
The loop runs on one background thread that owns the runner and the cache (neither is
thread-safe). Each :meth:`RAGCacheEngine.step` (RAGCache §5.1-5.2):

1. takes new requests and cancellations;
2. refreshes each waiting request's cached / to-compute estimate (knowledge-tree match) and asks
   the :class:`~ragcache_backend.engine.scheduler.Scheduler` for a plan (cache-aware reordering);
3. **admits** the planned prefills with the cache's protocol (:meth:`TieredCache.admit`: match,
   lock, swap in, allocate); "no room now" is a ``None`` the loop waits on, "can never fit"
   fails the request at once;
4. runs **one** ``runner.forward`` over every admitted prefill and every running decode
   (continuous batching);
5. **commits** each prefill (its documents become tree nodes, PGDSF statistics), samples,
   streams text, and **finishes** requests that stopped: their lease is released (path unlocked,
   blocks freed) on success, error and cancellation alike.

Nothing is inserted into the tree before its prefill succeeded, so a failed or cancelled request
never leaves a poisoned entry.

Reuse modes (``EngineConfig.reuse``, or per request): ``exact`` serves only exact prefixes from the
knowledge tree (answers equal those without the cache); ``chunk`` and ``auto`` also serve documents
from chunk caches at any position (Cache-Craft §3, :mod:`ragcache_backend.engine.chunk_step`): the
admission picks a variant per document, the prefill recomputes its most contextualised tokens, a
quality guard recomputes in full a chunk whose KV moved too far, and the commit records new
variants. Only exact computations ever enter the tree as prefix nodes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import platform
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ragcache_backend.cache.chunk_reuse import RecomputeRule
from ragcache_backend.cache.disk import DiskStore
from ragcache_backend.cache.lease import ChunkLease, SegmentSpec
from ragcache_backend.cache.profile import DEFAULT_ALPHAS, DEFAULT_BETAS, PrefillProfile, measure_profile
from ragcache_backend.cache.tiers import TieredCache
from ragcache_backend.config import EngineConfig, ragcache_home
from ragcache_backend.engine import chunk_step
from ragcache_backend.engine.pipelining import SpeculativePipeline, run_cancellable
from ragcache_backend.engine.request import (
    FinishReason,
    GenerationResult,
    Request,
    RequestHandle,
    RequestMetrics,
    ReuseMode,
    StreamChunk,
)
from ragcache_backend.engine.scheduler import Scheduler, SchedulerConfig
from ragcache_backend.engine.streaming import adrain, drain
from ragcache_backend.errors import (
    CacheBudgetError,
    ContextWindowError,
    InvalidRequestError,
    RAGCacheError,
    RequestCancelledError,
)
from ragcache_backend.model.loader import LoadedModel, load_model
from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner, StepOutput, kv_bytes_per_token
from ragcache_backend.model.sampling import SamplingParams, sample_token
from ragcache_backend.prompts.builder import PromptBuilder, PromptPlan, Segment, plan_prompt
from ragcache_backend.prompts.detokenizer import IncrementalText
from ragcache_backend.retrieval.documents import Document, content_id

log = logging.getLogger(__name__)

__all__ = ["EngineClosedError", "EngineStats", "GenerationResult", "RAGCacheEngine", "RequestHandle",
           "RequestMetrics", "StreamChunk"]


class EngineClosedError(RAGCacheError):
    """The engine is closed (or closing) and takes no new request."""


@dataclass(slots=True)
class EngineStats:
    """Totals over the engine's life (for ``ragcache bench``).

    Attributes:
        steps: forward steps run.
        forward_s: seconds inside ``runner.forward``.
        sched_s: seconds of scheduling (estimates, planning, admission, commit), KV copies excluded.
        finished, failed, cancelled: requests by outcome.
        retried: requests that failed before their first token and ran again by recomputation
            (RAGCache §6 fault tolerance).
    """

    steps: int = 0
    forward_s: float = 0.0
    sched_s: float = 0.0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    retried: int = 0


def _stop_token_ids(loaded: LoadedModel) -> frozenset[int]:
    tok, ids = loaded.tokenizer, set()
    for source in (loaded.model.config, getattr(loaded.model, "generation_config", None), tok):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple, set)) else [eos] if eos is not None else [])
    vocab = tok.get_vocab()
    ids.update(vocab[t] for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>") if t in vocab)
    return frozenset(int(i) for i in ids)


DocumentLike = Document | str


def _doc_text_id(doc: object) -> tuple[str, str | None]:
    inner = getattr(doc, "document", doc)  # ScoredDocument -> Document
    if isinstance(inner, Document):
        return inner.text, inner.doc_id
    if isinstance(inner, str):
        return inner, content_id(inner)
    raise InvalidRequestError(f"a document must be a Document or a str, got {type(doc).__name__}")


def _machine_tag() -> str:
    """A short hash of the CPU model name (``/proc/cpuinfo``; the platform string elsewhere)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return hashlib.sha256(name.encode()).hexdigest()[:8]


class RAGCacheEngine:
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
        self.config = cfg = config or EngineConfig()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.loaded = loaded or load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
        block_bytes = kv_bytes_per_token(self.loaded) * cfg.block_size
        num_blocks = cfg.device_budget_bytes // block_bytes
        if num_blocks < 1:
            raise CacheBudgetError(
                f"device budget {cfg.device_budget_bytes} B is below one KV block ({block_bytes} B)"
            )
        self.runner = ModelRunner(self.loaded, num_device_blocks=num_blocks, block_size=cfg.block_size)
        self.prompts = PromptBuilder(self.loaded.tokenizer, cfg.system_prompt)
        if profile is None and cfg.policy == "pgdsf" and cfg.enable_cache:
            profile = self._load_or_measure_profile()
        self.profile = profile
        self.cache = TieredCache(
            num_blocks, cfg.block_size, cfg.host_budget_bytes, self.runner,
            policy=cfg.policy if profile is not None or cfg.policy != "pgdsf" else "gdsf",
            profile=profile,
        )
        if cfg.disk_dir is not None and cfg.enable_cache and cfg.disk_budget_bytes > 0:
            self.cache.attach_disk(DiskStore(
                cfg.disk_dir, self.loaded.fingerprint, self.runner.kv_layout, self.loaded.dtype, cfg.disk_budget_bytes,
                policy=self.cache.policy_name))
        self.cache.configure_variants(fingerprint=f"{self.loaded.fingerprint}/{self.loaded.dtype}",
                                      per_chunk=cfg.chunk_variants_per_chunk, total=cfg.chunk_max_variants)
        self.runner.sample_stat_layers(cfg.chunk_stat_layers)
        self._rule = cfg.recompute_rule()
        self.store = store
        self.stop_ids = _stop_token_ids(self.loaded)
        self.scheduler = Scheduler(scheduler or SchedulerConfig(
            max_batch_size=cfg.max_batch_size, max_batch_tokens=cfg.max_batch_tokens,
            reorder=cfg.reorder, window=cfg.reorder_window,
        ))
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Request] = {}
        self._ids = itertools.count()
        self._step_lock = threading.RLock()  # held for a whole step; also by reset_cache
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._closing = False
        self._queued = 0  # requests in the inbox (cancellations and wake-ups are not counted)
        self._waiting = 0  # requests waiting for admission, as of the loop's last look
        self._queued_lock = threading.Lock()

    # ---- profile -----------------------------------------------------------------------------
    def _load_or_measure_profile(self) -> PrefillProfile:
        threads = torch.get_num_threads()
        # the cost of a prefill depends on the machine and on which kernels run it: both name the file
        path = self.config.profile_path or (
            ragcache_home() / "profiles"
            / f"{self.loaded.fingerprint}-{self.loaded.device.type}-{_machine_tag()}-{self.runner.kernel_tag}-t{threads}.json"
        )
        if path.exists():
            return PrefillProfile.load(path)
        cap = self.runner.num_device_blocks * self.runner.block_size
        scale = min(1.0, cap / (DEFAULT_ALPHAS[-1] + DEFAULT_BETAS[-1]))
        alphas = sorted({int(a * scale) for a in DEFAULT_ALPHAS})
        betas = sorted({max(1, int(b * scale)) for b in DEFAULT_BETAS})
        if len(alphas) < 2 or len(betas) < 2:
            raise CacheBudgetError(f"device tier of {cap} tokens is too small to profile prefill cost")
        log.info("measuring the prefill profile once (saved to %s)", path)
        self.runner.time_prefill(0, betas[0])  # warm-up
        profile = measure_profile(
            self.runner.time_prefill, alphas, betas, repeats=3,
            model_fingerprint=self.loaded.fingerprint, dtype=str(self.loaded.dtype), threads=threads,
        )
        profile.save(path)
        return profile

    # ---- prompts -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.loaded.name

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

    def plan(self, segments: Sequence[Segment], use_cache: bool | None = None) -> PromptPlan:
        """How ``segments`` meet the knowledge tree under this engine's settings."""
        use = self.config.enable_cache if use_cache is None else use_cache
        if not use:
            return PromptPlan((), tuple(t for s in segments for t in s.token_ids))
        return plan_prompt(segments, whole_prompt=self.config.whole_prompt_reuse)

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

        Raises (at once, nothing queued):
            InvalidRequestError: no segments, or an unknown reuse mode. ContextWindowError.
            EngineClosedError.
        """
        sampling = sampling or SamplingParams()
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
        rid = next(self._ids)
        handle = RequestHandle(rid, self.cancel)
        seed = sampling.seed
        req = Request(
            rid=rid, segments=tuple(segments), plan=self.plan(segments, use_cache), sampling=sampling,
            dropped=dropped, on_text=on_text or (lambda _t: None), handle=handle,
            text=IncrementalText(self.loaded.tokenizer, sampling.stop), cancel=cancel or threading.Event(),
            keep_logits=keep_logits, reuse=mode, recompute=recompute or self._rule, store=store,
            generator=torch.Generator().manual_seed(seed) if seed is not None else None,
        )
        self._ensure_thread()
        with self._queued_lock:
            self._queued += 1
        self._inbox.put(req)
        return handle

    def submit(self, question: str, documents: Sequence[DocumentLike] = (), sampling: SamplingParams | None = None,
               *, question_first: bool = False, **kw) -> RequestHandle:
        """Queue a RAG request (question + documents in retrieval order); see :meth:`submit_segments`."""
        sampling = sampling or SamplingParams()
        segments, dropped = self.segments_for(question, documents, sampling, question_first=question_first)
        return self.submit_segments(segments, sampling, dropped=dropped, **kw)

    def cancel(self, rid: int) -> None:
        """Cancel request ``rid`` wherever it is (no-op once it finished)."""
        self._inbox.put(rid)

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
        try:
            return await asyncio.shield(asyncio.wrap_future(handle.future))
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

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is in flight; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.in_flight:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def live_request_ids(self) -> tuple[int, ...]:
        """Ids of the requests the loop holds now (waiting or running)."""
        return tuple(self._live)

    @property
    def waiting_requests(self) -> int:
        """Requests submitted and not yet admitted for prefill (the pool of RAGCache Algorithm 2)."""
        return self._waiting + self._queued

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._live) + self._queued

    def reset_cache(self) -> None:
        """Drop every cached node that no running request holds."""
        with self._step_lock:
            self.cache.clear()

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; finish (or with ``cancel`` cancel) those in flight; join the loop."""
        self._closing = True
        if cancel:
            for rid in list(self._live):
                self.cancel(rid)
        self._inbox.put(None)  # wakes the loop
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            self.cache.close_disk()  # queued KV files are written before close returns

    def __enter__(self) -> RAGCacheEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._thread_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=RAGCacheEngine._run_loop, args=(weakref.ref(self),),
                                                    name="ragcache-engine", daemon=False)
                    self._thread.start()

    @staticmethod
    def _run_loop(ref: weakref.ReferenceType[RAGCacheEngine]) -> None:
        """The loop thread's body. It holds the engine only weakly between turns, so an engine its
        caller dropped (and its KV arena) is freed: the thread then ends by itself. It is not a daemon:
        when the main thread ends it finishes its requests and returns before Python finalizes (a
        daemon thread stopped inside torch at finalization aborts the process)."""
        while True:
            engine = ref()
            if engine is None or not engine._loop_once():
                return
            del engine

    def _loop_once(self) -> bool:
        """One turn of the loop thread: wait (at most 0.5 s) for work, then step; False to stop."""
        try:
            if not self._live:
                if (self._closing or not threading.main_thread().is_alive()) and self._inbox.empty():
                    # closed, or the program is exiting: leave the disk tier complete, end before Python finalizes
                    with self._step_lock:
                        self._persist()
                        self.cache.close_disk()
                    return False
                if not self._take(block=True):
                    return True
            self.step()
            return True
        except BaseException as exc:  # a bug: fail everyone loudly rather than hang callers
            log.exception("engine step loop crashed")
            self._closing = True
            err = exc if isinstance(exc, Exception) else RAGCacheError(repr(exc))
            for req in list(self._live.values()):
                self._fail(req, err)
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Request):
                    with self._queued_lock:
                        self._queued -= 1
                    item.handle.future.set_exception(EngineClosedError(f"the engine loop stopped: {exc!r}"))
            return False

    def _take(self, *, block: bool) -> bool:
        """Move inbox items (new requests, cancellations) into the loop; True if any came."""
        got = False
        while True:
            try:
                item = self._inbox.get(timeout=0.5) if block and not got else self._inbox.get_nowait()
            except queue.Empty:
                return got
            got = True
            if isinstance(item, Request):
                with self._queued_lock:
                    self._queued -= 1
                self._live[item.rid] = item
                self.scheduler.add(item.rid, 0, item.prompt_tokens)
                self._waiting = self.scheduler.waiting
            elif isinstance(item, int):
                req = self._live.get(item)
                if req is not None:
                    self._fail(req, RequestCancelledError("the request was cancelled"))

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> int:
        """Run one forward step over the admitted prefills and running decodes.

        Returns:
            the number of sequences in the step (0 when nothing could run).
        """
        with self._step_lock:
            self._take(block=False)
            for req in [r for r in self._live.values() if r.cancel.is_set()]:
                self._fail(req, RequestCancelledError("the request was cancelled"))
            t0 = time.perf_counter()
            cfg = self.scheduler.config
            if cfg.reorder and cfg.window > 0:
                self._refresh_estimates()
            plan = self.scheduler.plan()
            plan_s = time.perf_counter() - t0
            decoders = [self._live[rid] for rid in plan.decode]
            admitted: list[Request] = []
            for rid in plan.prefill:
                req = self._live[rid]
                if self._admit(req):
                    admitted.append(req)
                elif rid in self._live:  # no room now: waits for running requests' blocks
                    break
            self._waiting = self.scheduler.waiting
            share = plan_s / max(1, len(admitted) + len(decoders))
            for req in admitted + decoders:
                req.handle.metrics.sched_s += share
            self.stats.sched_s += time.perf_counter() - t0
            if not admitted and not decoders:
                self._unblock()
                return 0
            t1 = time.perf_counter()
            try:
                batch = [self._prefill_input(r) for r in admitted] + [self._decode_input(r) for r in decoders]
                out = self.runner.forward_step(batch)
            except Exception as exc:
                log.warning("forward step of %d sequences failed: %r", len(admitted) + len(decoders), exc)
                for req in admitted + decoders:
                    self._fail(req, exc)
                return 0
            self.stats.forward_s += time.perf_counter() - t1
            self.stats.steps += 1
            logits = out.logits
            for i, req in enumerate(admitted):
                req.handle.metrics.batch_sizes.append(len(batch))
                self._after_prefill(req, out, i)
            for req, lg in zip(decoders, logits[len(admitted):]):
                if req.rid in self._live:
                    req.handle.metrics.batch_sizes.append(len(batch))
                    self._after_token(req, lg)
            self._persist()
            return len(batch)

    def _persist(self) -> None:
        """Hand the nodes this step inserted to the disk tier (after the step's tokens went out)."""
        try:
            self.cache.persist_pending()
        except Exception:  # the disk tier is a cache: losing a write never fails a request
            log.exception("disk tier: queuing KV for writing failed; it stays in memory only")

    def _unblock(self) -> None:
        """Nothing runs and the first waiting request still got no room: only possible when the
        arena is held by something outside the loop; fail it rather than spin."""
        if self.scheduler.running or not self.scheduler.pending:
            return
        req = self._live[self.scheduler.order()[0].rid]
        self._fail(req, CacheBudgetError(
            f"no room in the device arena for request {req.rid} although no other request runs"))

    def _refresh_estimates(self) -> None:
        for rid in self.scheduler.pending:
            req = self._live[rid]
            lead = req.plan.lead
            cached = self.cache.match([s.key for s in lead]).cached_tokens if lead else 0
            self.scheduler.update(rid, cached, req.prompt_tokens - cached)

    def _admit(self, req: Request) -> bool:
        m = req.handle.metrics
        m.admit_attempts += 1
        t0, c0 = time.perf_counter(), self.cache.stats.copy_s
        tail = req.rest_tokens + req.sampling.max_tokens
        try:
            if req.reuse == "exact" or not req.plan.lead:
                lease = self.cache.admit([SegmentSpec(s.key, len(s)) for s in req.plan.lead], tail)
            else:
                lease = self._admit_chunks(req, tail)
        except Exception as exc:  # can never fit, or a swap-in failed
            self._fail(req, exc)
            return False
        finally:
            self._charge(m, t0, c0)
        if lease is None:
            return False
        req.lease = lease
        m.admitted = time.perf_counter()
        self.scheduler.start(req.rid)
        return True

    def _admit_chunks(self, req: Request, tail: int) -> ChunkLease | None:
        cfg = self.config
        specs = chunk_step.chunk_specs(req.plan.lead, req.rest_tokens)
        exact_upto = len(specs)
        if req.reuse == "chunk":  # the tree serves what precedes the first document; documents come from variants
            exact_upto = next((i for i, s in enumerate(specs) if s.chunk), len(specs))
        return self.cache.admit_chunks(specs, tail, exact_upto=exact_upto, rule=req.recompute,
                                       fresh_above=cfg.chunk_fresh_above)

    def _charge(self, m: RequestMetrics, t0: float, c0: float) -> None:
        copy = self.cache.stats.copy_s - c0
        m.kv_copy_s += copy
        m.sched_s += time.perf_counter() - t0 - copy

    def _prefill_input(self, req: Request) -> ForwardInput:
        lease = req.lease
        if isinstance(lease, ChunkLease):
            t0 = time.perf_counter()
            chunk_step.copy_variants(lease, self.runner)
            req.handle.metrics.kv_copy_s += time.perf_counter() - t0
            item, req.layout = chunk_step.build_input(req.plan, lease, rule=req.recompute)
            return item
        cached = tuple(KVRun(tuple(n.device_blocks or ()), 0, n.num_tokens) for n in lease.path[: lease.reused])
        target = [KVRun(tuple(p.blocks), 0, p.spec.num_tokens) for p in lease.pending]
        target.append(KVRun(tuple(lease.tail_blocks), 0, req.rest_tokens))
        new = tuple(t for s in req.plan.lead[lease.reused:] for t in s.token_ids) + req.plan.rest
        return ForwardInput(new, cached, tuple(target))

    def _decode_input(self, req: Request) -> ForwardInput:
        """The one-token decode step that feeds ``req.next_token`` (its last sampled token)."""
        lease = req.lease
        pos = req.rest_tokens + len(req.generated) - 1
        tail = tuple(lease.tail_blocks)
        if isinstance(lease, ChunkLease):
            ctx = chunk_step.context_runs(lease, 0)[:-1]
            return ForwardInput((req.next_token,), ctx + (KVRun(tail, 0, pos),), (KVRun(tail, pos, 1),), decode=True)
        nodes = tuple(KVRun(tuple(n.device_blocks or ()), 0, n.num_tokens) for n in lease.path)
        return ForwardInput((req.next_token,), nodes + (KVRun(tail, 0, pos),), (KVRun(tail, pos, 1),), decode=True)

    def _after_prefill(self, req: Request, out: StepOutput, index: int) -> None:
        m = req.handle.metrics
        logits = out.logits[index]
        try:
            t0, c0 = time.perf_counter(), self.cache.stats.copy_s
            if isinstance(req.lease, ChunkLease):
                logits = self._commit_chunks(req, out, index)
            else:
                req.computed = m.computed_tokens = req.lease.pending_tokens + req.rest_tokens
                self.cache.commit(req.lease, req.rest_tokens)
            self._charge(m, t0, c0)
            if req.keep_logits:
                req.handle.first_logits = logits.clone()
        except Exception as exc:
            self._fail(req, exc)
            return
        m.first_token = time.perf_counter()
        self._after_token(req, logits)

    def _commit_chunks(self, req: Request, out: StepOutput, index: int) -> torch.Tensor:
        """Guard, statistics and commit of a chunk-mode prefill; returns the first token's logits.

        A reused chunk whose recomputed tokens moved too far (the quality guard) is recomputed in
        full, with everything after it, in a second forward of this request alone."""
        lease, layout = req.lease, req.layout
        logits, attention, depth = out.logits[index], out.attention[index], out.depth[index]
        deviations = chunk_step.chunk_deviations(lease, layout, out.deviation[index])
        req.deviation = max(deviations.values(), default=0.0)
        flagged = chunk_step.guard_flags(deviations, req.recompute.guard)
        if flagged:
            item, layout = chunk_step.build_input(req.plan, lease, rule=req.recompute, guard=False, full=flagged)
            again = self.runner.forward_step([item])
            logits, attention, depth = again.logits[0], again.attention[0], again.depth[0]
            for i in flagged:  # computed in full now: no longer served from a variant
                lease.pieces[i].use = None
            req.guarded = len(flagged)
        req.recomputed = chunk_step.recomputed_tokens(lease, layout, depth, self.runner.num_layers)
        # cached = exact prefix nodes + approximate ones (earlier chunk reuse) + reused chunks not recomputed
        req.chunk_cached = (lease.approximate_prefix_tokens - req.recomputed
                            + sum(p.spec.num_tokens for p in lease.pieces if p.use is not None))
        req.computed = req.prompt_tokens - (lease.cached_tokens - lease.approximate_prefix_tokens) - req.chunk_cached
        req.handle.metrics.computed_tokens = req.computed
        if req.store:
            self.cache.commit_chunks(lease, req.rest_tokens, chunk_step.variant_stats(lease, layout, attention))
        return logits

    def _after_token(self, req: Request, logits: torch.Tensor) -> None:
        try:
            token = sample_token(logits, req.sampling, req.generator)
            reason = self._accept_token(req, token)
        except Exception as exc:  # e.g. the caller's on_text raised
            self._fail(req, exc)
            return
        if reason is None:
            req.next_token = token
            return
        m = req.handle.metrics
        try:
            self.cache.finish(req.lease)
        finally:
            self._forget(req)
        m.finished = time.perf_counter()
        self.stats.finished += 1
        if not req.handle.future.done():
            req.handle.future.set_result(self._result(req, reason))

    def _accept_token(self, req: Request, token: int) -> FinishReason | None:
        """Take one sampled token: emit its text; return why the request ends, or None to go on."""
        text, on_text = req.text, req.on_text
        if token in self.stop_ids:
            tail = text.flush()
            if tail:
                on_text(tail)
            return "stop"
        req.generated.append(token)
        req.handle.metrics.generated_tokens = len(req.generated)
        delta = text.push(token)
        if delta:
            on_text(delta)
        if text.stopped:
            return "stop"
        if len(req.generated) >= req.sampling.max_tokens:
            tail = text.flush()
            if tail:
                on_text(tail)
            return "length"
        return None

    def _result(self, req: Request, reason: FinishReason) -> GenerationResult:
        m, lease = req.handle.metrics, req.lease
        return GenerationResult(
            answer=req.text.emitted,
            token_ids=tuple(req.generated),
            finish_reason=reason,
            ttft_s=m.first_token - m.submitted,
            total_s=m.finished - m.submitted,
            prompt_tokens=req.prompt_tokens,
            cached_tokens=req.prompt_tokens - req.computed,
            computed_tokens=req.computed,
            device_hits=lease.device_hits if lease else 0,
            host_hits=lease.host_hits if lease else 0,
            disk_hits=lease.disk_hits if lease else 0,
            documents=tuple(s.doc_id for s in req.segments if s.doc_id is not None),
            dropped_documents=req.dropped,
            model=self.model_name,
            reuse=req.reuse,
            chunk_cached_tokens=req.chunk_cached,
            recomputed_tokens=req.recomputed,
            chunk_hits=sum(p.use is not None for p in lease.pieces) if isinstance(lease, ChunkLease) else 0,
            guarded_chunks=req.guarded,
            chunk_deviation=req.deviation,
        )

    def _forget(self, req: Request) -> None:
        self._live.pop(req.rid, None)
        self.scheduler.remove(req.rid)
        self._waiting = self.scheduler.waiting

    def _may_retry(self, req: Request, exc: BaseException) -> bool:
        """RAGCache §6: a request that failed before its first token (a forward or KV-copy error,
        not bad input) runs once more, computing its whole prompt without the cache."""
        deterministic = (InvalidRequestError, CacheBudgetError, RequestCancelledError, EngineClosedError)
        return (not req.retried and not self._closing and req.handle.metrics.first_token == 0.0
                and not req.generated and isinstance(exc, Exception) and not isinstance(exc, deterministic)
                and not req.cancel.is_set())

    def _retry(self, req: Request, exc: BaseException) -> None:
        log.warning("request %d failed before its first token (%r): retrying it by recomputation", req.rid, exc)
        try:
            if req.lease is not None:
                self.cache.finish(req.lease)
        finally:
            req.lease, req.layout = None, None
        req.retried = True
        req.plan = self.plan(req.segments, use_cache=False)
        req.reuse = "exact"
        req.computed = req.recomputed = req.chunk_cached = req.guarded = 0
        req.deviation = 0.0
        self.stats.retried += 1
        self.scheduler.remove(req.rid)
        self.scheduler.add(req.rid, 0, req.prompt_tokens)

    def _fail(self, req: Request, exc: BaseException) -> None:
        if req.rid in self._live and self._may_retry(req, exc):
            self._retry(req, exc)
            return
        try:
            if req.lease is not None:
                self.cache.finish(req.lease)
        finally:
            self._forget(req)
            req.handle.metrics.finished = time.perf_counter()
            if isinstance(exc, RequestCancelledError):
                self.stats.cancelled += 1
            else:
                self.stats.failed += 1
            if not req.handle.future.done():
                req.handle.future.set_exception(exc)


async def _settled(handle: RequestHandle) -> None:
    """Wait until a cancelled request has been finished by the loop (its blocks freed)."""
    fut = asyncio.wrap_future(handle.future)
    await asyncio.wait([fut])
    if not fut.cancelled():
        fut.exception()  # retrieved: the caller asked for the cancellation


def _final_chunk(fut) -> StreamChunk | BaseException:
    """The last item of a stream: the result chunk, or the request's error."""
    if fut.cancelled():
        return RequestCancelledError("the request was cancelled")
    exc = fut.exception()
    return exc if exc is not None else StreamChunk("", fut.result())
