"""The embedded RAGCache engine: retrieval-aware generation with document-level KV reuse.

One request runs as (RAGCache §5.1):

1. **admit** — segment the prompt (:mod:`ragcache_backend.prompts.builder`), match its leading cacheable
   segments in the knowledge tree, lock and bring the matched nodes to device, allocate device
   blocks for every segment still to compute;
2. **prefill** — one forward over the non-cached tokens on top of the cached prefix KV;
3. **commit** — insert each newly computed document as a node of the tree (its blocks change
   owner, no copy) and update PGDSF statistics (Alg. 1 UPDATE_NODE);
4. **decode** — sample until a stop token, a stop string or ``max_tokens``;
5. **finish** — unlock the path and free the request's own blocks, on success *and* on error.

Nothing is inserted into the tree before its prefill succeeded, so a failed or cancelled request
never leaves a poisoned entry. Requests are serialized by a lock; the continuous-batching
scheduler drives the same admit/prefill/commit/decode/finish steps for many requests at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ragcache_backend.cache.blocks import blocks_for
from ragcache_backend.config import EngineConfig, ragcache_home
from ragcache_backend.retrieval.documents import Document, content_id
from ragcache_backend.errors import (
    CacheBudgetError,
    ContextWindowError,
    InvalidRequestError,
    RequestCancelledError,
)
from ragcache_backend.cache.knowledge_tree import Node
from ragcache_backend.model.loader import LoadedModel, load_model
from ragcache_backend.cache.profile import DEFAULT_ALPHAS, DEFAULT_BETAS, PrefillProfile, measure_profile
from ragcache_backend.prompts.builder import PromptBuilder, Segment, cacheable_lead
from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner, kv_bytes_per_token
from ragcache_backend.model.sampling import SamplingParams, sample_token
from ragcache_backend.engine.streaming import adrain, drain
from ragcache_backend.prompts.detokenizer import IncrementalText
from ragcache_backend.cache.tiers import AcquiredPrefix, TieredCache

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length"]


@dataclass(slots=True, frozen=True)
class GenerationResult:
    """What one request produced and how much of its prompt came from the cache.

    Attributes:
        answer: generated text (stop string excluded).
        token_ids: generated token ids (stop token excluded).
        finish_reason: ``"stop"`` (stop token or string) or ``"length"`` (``max_tokens``).
        ttft_s: seconds from the call to the first sampled token (admission + prefill).
        total_s: seconds from the call to the end of generation.
        prompt_tokens: tokens in the prompt.
        cached_tokens: prompt tokens whose KV was reused from the knowledge tree.
        computed_tokens: prompt tokens prefilled by this request (``prompt - cached``).
        device_hits, host_hits: matched tree nodes found in each tier.
        documents: ids of the documents in the prompt, in prompt order.
        dropped_documents: ids of retrieved documents left out to fit the context window.
        model: model name.
    """

    answer: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    device_hits: int
    host_hits: int
    documents: tuple[str, ...]
    dropped_documents: tuple[str, ...]
    model: str


@dataclass(slots=True, frozen=True)
class StreamChunk:
    """A streamed text delta; the last chunk of a stream carries the full ``result``."""

    text: str
    result: GenerationResult | None = None


@dataclass(slots=True)
class _Request:
    """Mutable state of one request between admit and finish (engine-internal)."""

    segments: list[Segment]
    sampling: SamplingParams
    use_cache: bool
    cancel: threading.Event = field(default_factory=threading.Event)
    acquired: AcquiredPrefix | None = None
    pending: list[tuple[Segment, list[int]]] = field(default_factory=list)  # to compute + insert
    tail: tuple[int, ...] = ()
    tail_blocks: list[int] = field(default_factory=list)
    path: list[Node] = field(default_factory=list)  # locked tree nodes, in prompt order
    generated: list[int] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)


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


class RAGCacheEngine:
    """Cache-aware generation over a Llama-family model (RAGCache §5).

    Args:
        config: engine configuration; defaults to the embedded SmolLM2 model, PGDSF, 512 MiB
            device tier and 2 GiB host tier.
        loaded: an already loaded model (shares weights between engines, e.g. cache on/off).
        profile: a prefill profile for PGDSF; by default loaded from ``profile_path`` or measured
            once per model/dtype/device/threads (about 15 s for the default model) and saved.
        store: a :class:`~ragcache_backend.retrieval.docstore.DocumentStore` for :meth:`ask`.

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
        self.store = store
        self.stop_ids = _stop_token_ids(self.loaded)
        self._lock = threading.RLock()

    # ---- profile -----------------------------------------------------------------------------
    def _load_or_measure_profile(self) -> PrefillProfile:
        threads = torch.get_num_threads()
        path = self.config.profile_path or (
            ragcache_home() / "profiles" / f"{self.loaded.fingerprint}-{self.loaded.device.type}-t{threads}.json"
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

    # ---- public API ----------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.loaded.name

    def segments_for(
        self, question: str, documents: Sequence[DocumentLike], sampling: SamplingParams
    ) -> tuple[list[Segment], tuple[str, ...]]:
        """Prompt segments for a RAG request, dropping trailing documents that do not fit.

        Documents are kept whole (their KV boundaries matter): the lowest-ranked ones are left out
        with a warning until ``prompt + max_tokens`` fits the context window.

        Returns:
            ``(segments, dropped_document_ids)``.

        Raises:
            EmptyQueryError: blank question.
            ContextWindowError: the prompt does not fit even with no document.
        """
        pairs = [_doc_text_id(d) for d in documents]
        segments = self.prompts.build(question, pairs)
        window = self.loaded.context_window
        dropped: list[str] = []
        while sum(len(s) for s in segments) + sampling.max_tokens > window and len(segments) > 2:
            gone = segments.pop(-2)
            dropped.append(gone.doc_id or gone.key)
        if dropped:
            log.warning("left out %d lowest-ranked document(s) to fit the %d-token context window", len(dropped), window)
        self._check_window(segments, sampling)
        return segments, tuple(reversed(dropped))

    def _check_window(self, segments: Sequence[Segment], sampling: SamplingParams) -> None:
        total = sum(len(s) for s in segments)
        if total + sampling.max_tokens > self.loaded.context_window:
            raise ContextWindowError(
                f"prompt of {total} tokens + max_tokens {sampling.max_tokens} exceeds the "
                f"{self.loaded.context_window}-token context window of {self.model_name}"
            )

    def generate(
        self,
        question: str,
        documents: Sequence[DocumentLike] = (),
        sampling: SamplingParams | None = None,
        *,
        use_cache: bool | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """Answer ``question`` from ``documents`` (in retrieval order), reusing cached document KV.

        Args:
            question: the user question (non-blank).
            documents: :class:`Document`, ``ScoredDocument`` or plain strings.
            sampling: defaults to greedy with ``max_tokens=128``.
            use_cache: override ``config.enable_cache`` for this request.
            on_text: called with each final text delta as it is generated (streaming).

        Raises:
            EmptyQueryError, ContextWindowError, CacheBudgetError, RequestCancelledError.
        """
        sampling = sampling or SamplingParams()
        segments, dropped = self.segments_for(question, documents, sampling)
        return self.generate_segments(segments, sampling, use_cache=use_cache, on_text=on_text, dropped=dropped)

    def generate_segments(
        self,
        segments: Sequence[Segment],
        sampling: SamplingParams | None = None,
        *,
        use_cache: bool | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        dropped: tuple[str, ...] = (),
    ) -> GenerationResult:
        """Generate from an already segmented prompt (used by the LangChain/LlamaIndex adapters).

        The leading cacheable segments (all but the last segment at most) are served from and
        inserted into the knowledge tree; everything from the first non-cacheable segment on is
        computed and never cached.

        Raises:
            InvalidRequestError: no segments; ContextWindowError; CacheBudgetError;
            RequestCancelledError when ``cancel`` is set during generation.
        """
        sampling = sampling or SamplingParams()
        if not segments:
            raise InvalidRequestError("a prompt needs at least one segment")
        self._check_window(segments, sampling)
        req = _Request(list(segments), sampling, self.config.enable_cache if use_cache is None else use_cache)
        if cancel is not None:
            req.cancel = cancel
        return self._execute(req, on_text or (lambda _t: None), dropped)

    def ask(self, question: str, k: int = 3, sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        """Retrieve the top-``k`` documents from ``store`` and answer from them."""
        if self.store is None:
            raise InvalidRequestError("this engine has no document store; pass store= or use generate()")
        hits = self.store.search(question, k)
        return self.generate(question, [h.document for h in hits], sampling, **kw)

    def stream(
        self, question: str, documents: Sequence[DocumentLike] = (), sampling: SamplingParams | None = None, **kw
    ) -> Iterator[StreamChunk]:
        """Like :meth:`generate` but yields text deltas; the last chunk carries the result.

        Closing the iterator early cancels the request (its KV blocks are freed).
        """
        sampling = sampling or SamplingParams()
        segments, dropped = self.segments_for(question, documents, sampling)
        return self.stream_segments(segments, sampling, dropped=dropped, **kw)

    def stream_segments(self, segments: Sequence[Segment], sampling: SamplingParams | None = None, *,
                        cancel: threading.Event | None = None, **kw) -> Iterator[StreamChunk]:
        """Streaming form of :meth:`generate_segments`; setting ``cancel`` cancels the request."""
        out: queue.Queue = queue.Queue()
        cancel = cancel or threading.Event()

        def work() -> None:
            try:
                result = self.generate_segments(segments, sampling, on_text=lambda t: out.put(StreamChunk(t)), cancel=cancel, **kw)
                out.put(StreamChunk("", result))
            except BaseException as exc:  # handed to the consumer thread
                out.put(exc)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        try:
            yield from drain(out)
        finally:
            cancel.set()
            worker.join()

    async def agenerate(self, question: str, documents: Sequence[DocumentLike] = (), sampling: SamplingParams | None = None, **kw) -> GenerationResult:
        """Async :meth:`generate` (runs in a worker thread; cancelling the task cancels the request)."""
        cancel = threading.Event()
        sampling = sampling or SamplingParams()
        segments, dropped = self.segments_for(question, documents, sampling)
        try:
            return await asyncio.to_thread(self.generate_segments, segments, sampling, cancel=cancel, dropped=dropped, **kw)
        finally:
            cancel.set()

    async def astream(self, question: str, documents: Sequence[DocumentLike] = (), sampling: SamplingParams | None = None, **kw) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`."""
        sampling = sampling or SamplingParams()
        segments, dropped = self.segments_for(question, documents, sampling)
        async for chunk in self.astream_segments(segments, sampling, dropped=dropped, **kw):
            yield chunk

    async def astream_segments(self, segments: Sequence[Segment], sampling: SamplingParams | None = None, *,
                               cancel: threading.Event | None = None, **kw) -> AsyncIterator[StreamChunk]:
        """Async streaming form of :meth:`generate_segments`; setting ``cancel`` cancels the request."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        cancel = cancel or threading.Event()

        def work() -> None:
            try:
                result = self.generate_segments(
                    segments, sampling, cancel=cancel,
                    on_text=lambda t: loop.call_soon_threadsafe(out.put_nowait, StreamChunk(t)), **kw,
                )
                loop.call_soon_threadsafe(out.put_nowait, StreamChunk("", result))
            except BaseException as exc:
                loop.call_soon_threadsafe(out.put_nowait, exc)

        task = loop.run_in_executor(None, work)
        try:
            async for item in adrain(out):
                yield item
        finally:
            cancel.set()
            await asyncio.shield(task)

    def reset_cache(self) -> None:
        """Drop every cached node that no running request holds."""
        with self._lock:
            self.cache.clear()

    # ---- request steps (admit, prefill, commit, decode, finish) ----------------------------------
    def _execute(self, req: _Request, on_text: Callable[[str], None], dropped: tuple[str, ...]) -> GenerationResult:
        t0 = time.perf_counter()
        text = IncrementalText(self.loaded.tokenizer, req.sampling.stop)
        gen = torch.Generator().manual_seed(req.sampling.seed) if req.sampling.seed is not None else None
        with self._lock:
            if req.cancel.is_set():  # cancelled (or timed out) while waiting for the engine
                raise RequestCancelledError("the request was cancelled before it started")
            try:
                self._admit(req)
                logits = self.runner.forward([self._prefill_input(req)])[0]
                computed = sum(len(s) for s, _ in req.pending) + len(req.tail)
                self._commit(req)
                token = sample_token(logits, req.sampling, gen)
                ttft = time.perf_counter() - t0
                reason = self._decode(req, token, text, on_text, gen)
            finally:
                self._finish(req)
        return self._result(req, text, reason, ttft, time.perf_counter() - t0, computed, dropped)

    def _result(self, req: _Request, text: IncrementalText, reason: FinishReason, ttft: float,
                total: float, computed: int, dropped: tuple[str, ...]) -> GenerationResult:
        """The :class:`GenerationResult` of a finished request (shared with the serving engine)."""
        acq = req.acquired
        return GenerationResult(
            answer=text.emitted,
            token_ids=tuple(req.generated),
            finish_reason=reason,
            ttft_s=ttft,
            total_s=total,
            prompt_tokens=req.prompt_tokens,
            cached_tokens=req.prompt_tokens - computed,
            computed_tokens=computed,
            device_hits=acq.device_hits if acq else 0,
            host_hits=acq.host_hits if acq else 0,
            documents=tuple(s.doc_id for s in req.segments if s.doc_id is not None),
            dropped_documents=dropped,
            model=self.model_name,
        )

    def _admit(self, req: _Request) -> None:
        segs = req.segments
        rest = segs
        if req.use_cache:
            lead = cacheable_lead(segs)
            req.acquired = self.cache.acquire(self.cache.match([s.key for s in lead]))
            req.path = list(req.acquired.nodes)
            for s in lead[len(req.path):]:
                req.pending.append((s, self.cache.allocate(blocks_for(len(s), self.runner.block_size))))
            rest = segs[len(lead):]
        req.tail = tuple(t for s in rest for t in s.token_ids)
        need = blocks_for(len(req.tail) + req.sampling.max_tokens, self.runner.block_size)
        req.tail_blocks = self.cache.allocate(need)

    def _node_runs(self, req: _Request) -> list[KVRun]:
        return [KVRun(tuple(n.device_blocks), 0, n.num_tokens) for n in req.path]

    def _prefill_input(self, req: _Request) -> ForwardInput:
        new = tuple(t for s, _ in req.pending for t in s.token_ids) + req.tail
        target = [KVRun(tuple(b), 0, len(s)) for s, b in req.pending]
        target.append(KVRun(tuple(req.tail_blocks), 0, len(req.tail)))
        return ForwardInput(new, tuple(self._node_runs(req)), tuple(target))

    def _commit(self, req: _Request) -> None:
        cached_nodes = len(req.path)
        alpha = sum(n.num_tokens for n in req.path)
        beta = sum(len(s) for s, _ in req.pending) + len(req.tail)
        parent = req.path[-1] if req.path else None
        while req.pending:
            seg, blocks = req.pending.pop(0)
            parent = self.cache.insert(parent, seg.key, len(seg), blocks)
            req.path.append(parent)
        if req.use_cache:
            computed = [False] * cached_nodes + [True] * (len(req.path) - cached_nodes)
            self.cache.record_request(req.path, computed, alpha, beta)

    def _decode_input(self, req: _Request, token: int) -> ForwardInput:
        """The one-token decode step of ``req`` that feeds ``token`` (its last sampled token)."""
        pos = len(req.tail) + len(req.generated) - 1
        blocks = tuple(req.tail_blocks)
        return ForwardInput((token,), tuple(self._node_runs(req)) + (KVRun(blocks, 0, pos),), (KVRun(blocks, pos, 1),))

    def _accept_token(self, req: _Request, token: int, text: IncrementalText,
                      on_text: Callable[[str], None]) -> FinishReason | None:
        """Take one sampled token: emit its text; return why the request ends, or None to go on."""
        if token in self.stop_ids:
            tail = text.flush()
            if tail:
                on_text(tail)
            return "stop"
        req.generated.append(token)
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

    def _decode(self, req, token, text, on_text, gen) -> FinishReason:
        while True:
            reason = self._accept_token(req, token, text, on_text)
            if reason is not None:
                return reason
            if req.cancel.is_set():
                raise RequestCancelledError("the request was cancelled")
            token = sample_token(self.runner.forward([self._decode_input(req, token)])[0], req.sampling, gen)

    def _finish(self, req: _Request) -> None:
        if req.path:
            self.cache.release(req.path)
            req.path = []
        for _, blocks in req.pending:
            self.cache.free(blocks)
        req.pending = []
        if req.tail_blocks:
            self.cache.free(req.tail_blocks)
            req.tail_blocks = []
