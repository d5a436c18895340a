"""One request's life in the engine, and what it gives back (plain data, no tensors but logits).

A request is created by a caller (``generate``, ``stream``, the adapters, ``ragcache bench``),
queued on the engine's step loop and, step by step, admitted (a cache :class:`Lease`), prefilled,
committed, decoded and finished. The caller holds a :class:`RequestHandle`: a future of its
:class:`GenerationResult`, awaitable, cancellable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ragcache_backend.cache.chunk_reuse import RecomputeRule
from ragcache_backend.cache.lease import Lease
from ragcache_backend.model.grammar import GrammarMatcher
from ragcache_backend.model.sampling import SampledToken, SamplingParams
from ragcache_backend.prompts.builder import PromptPlan, Segment
from ragcache_backend.prompts.detokenizer import IncrementalText

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkReuse", "FinishReason", "GenerationResult", "ReuseMode", "Request", "RequestHandle", "RequestMetrics", "StreamChunk"]

FinishReason = Literal["stop", "length"]
ReuseMode = Literal["exact", "chunk", "auto"]


@dataclass(slots=True, frozen=True)
class ChunkReuse:
    """One document of a chunk-mode prompt served from a cached chunk variant (Cache-Craft §3):
    how it was fixed for this prompt and what the quality guard saw.

    Attributes:
        chunk: the document's segment key (content hash of its token ids).
        position: its first token's position in the prompt (tokens).
        tokens: its length (tokens).
        cfo: the variant's cache fix overhead for this prompt (eq. 12), the share of its tokens
            the rule chose to recompute, [0, 1].
        recomputed_tokens: its tokens chosen for recomputation over this prompt's context (eq. 14;
            before any guard pass), counted whole: under ``blend`` or ``focus_window`` a row that
            stops early counts 1 here but ``l / L`` in ``GenerationResult.recomputed_tokens``, so
            these records add up to that total only for the other rules.
        deviation: the mean relative change of those tokens' K/V (``||new - old|| / ||old||``,
            averaged over tokens and layers); times ``attention``, the guard's signal for this
            chunk. None when none of its tokens was recomputed or the rule has no guard.
        attention: the attention mass the prompt's last token (the one that yields the first
            output token) gave this chunk's span, averaged over layers and KV heads, in [0, 1]:
            how much the answer reads it. None when not measured (the rule has no guard, or no
            reused chunk had tokens recomputed). Where its reused chunks and the text between them
            make more than 64 spans, neighbouring spans are measured together and this is their
            group's mass (an upper bound on the chunk's own).
        guarded: the quality guard sent it back to full recomputation (it is then no longer
            counted in ``GenerationResult.chunk_hits``).
    """

    chunk: str
    position: int
    tokens: int
    cfo: float
    recomputed_tokens: int
    deviation: float | None
    attention: float | None
    guarded: bool


@dataclass(slots=True, frozen=True)
class GenerationResult:
    """What one request produced and how much of its prompt came from the cache.

    Attributes:
        answer: generated text (stop string excluded).
        token_ids: generated token ids (stop token excluded).
        finish_reason: ``"stop"`` (stop token or string) or ``"length"`` (``max_tokens``).
        ttft_s: seconds from submission to the first sampled token (queueing, admission, prefill);
            for ``ask`` and pipelined requests from the question, so the search is included.
        total_s: seconds from submission to the end of generation.
        prompt_tokens: tokens in the prompt.
        cached_tokens: prompt tokens whose KV was reused: from the knowledge tree (exact) and, in
            chunk mode, from chunk variants without recomputation (``chunk_cached_tokens``).
        computed_tokens: prompt tokens run through the model by this request (``prompt - cached``;
            includes ``recomputed_tokens``).
        device_hits, host_hits: reused tree nodes (and chunk variants) found in each tier.
        disk_hits: reused tree nodes read back from the disk tier (not counted in ``host_hits``).
        documents: ids of the documents in the prompt, in prompt order.
        dropped_documents: ids of retrieved documents left out to fit the context window.
        model: model name.
        reuse: the reuse mode the request ran in (``exact``, ``chunk`` or ``auto``).
        chunk_cached_tokens: the part of ``cached_tokens`` served from chunk variants at another
            position or after other documents (approximate hits, Cache-Craft); 0 in exact mode.
        recomputed_tokens: tokens of reused chunks recomputed over this prompt's context (eq. 14).
        chunk_hits: documents served from a chunk variant.
        guarded_chunks: reused chunks the quality guard sent back to full recomputation.
        chunk_deviation: the quality guard's signal: the largest, over reused chunks, of the mean
            relative change of a chunk's recomputed K/V times the attention the prompt's last token
            gives the chunk (0.0 when nothing was recomputed or the guard was off; each factor per
            chunk in ``chunk_reuse``).
        guard_tokens: prompt rows the quality guard's second pass computed again (the first pass's
            rows from the first flagged chunk on, full-depth equivalents); the work of the prefill
            is ``computed_tokens + guard_tokens``.
        chunk_reuse: per document served from a chunk variant, in prompt order, how it was fixed
            and what the guard saw (:class:`ChunkReuse`); empty in exact mode.
        search_s: a pipelined request (RAGCache §5.3): seconds of its vector search, from the
            question to the final top-k; 0.0 for a request given its documents.
        unoverlapped_search_s: the part of ``search_s`` not overlapped with the generation that
            produced this answer (RAGCache Table 3): ``search_s`` when no speculative generation
            for the final documents was running, less when one started during the search.
        speculative_requests: speculative generations started during the search (the kept one
            included).
        wasted_tokens: prompt tokens computed plus tokens generated by speculative generations
            that were terminated because the candidates changed.
        speculation_kept: the answer is the speculative generation started during the search
            (its documents were the final ones); False when it was (re)generated after the search.
        logprobs: with ``SamplingParams.logprobs``: one entry per token of ``token_ids`` (its
            log-probability and the top alternatives); empty otherwise.
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
    reuse: ReuseMode = "exact"
    chunk_cached_tokens: int = 0
    recomputed_tokens: int = 0
    chunk_hits: int = 0
    guarded_chunks: int = 0
    chunk_deviation: float = 0.0
    guard_tokens: int = 0
    disk_hits: int = 0
    search_s: float = 0.0
    unoverlapped_search_s: float = 0.0
    speculative_requests: int = 0
    wasted_tokens: int = 0
    speculation_kept: bool = False
    logprobs: tuple[SampledToken, ...] = ()
    chunk_reuse: tuple[ChunkReuse, ...] = ()


@dataclass(slots=True, frozen=True)
class StreamChunk:
    """A streamed text delta; the last chunk of a stream carries the full ``result``."""

    text: str
    result: GenerationResult | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Timing of one request (seconds, ``time.perf_counter`` clock).

    ``computed_tokens`` (prompt tokens prefilled) and ``generated_tokens`` count the work done so
    far, also for a request that was cancelled (a speculative generation's waste).
    ``sched_s`` is the scheduling overhead charged to the request (RAGCache Table 4's scope): its
    share of the reordering estimate and planning, its admission (match, lock, allocate, evict)
    and its commit (insert + PGDSF update). KV copies between tiers made meanwhile are data
    movement, counted apart in ``kv_copy_s``; the chunk modes' quality guard's second forward of the
    request (when it flags a reused chunk) is a forward pass, counted apart in ``guard_forward_s``.
    """

    submitted: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    sched_s: float = 0.0
    kv_copy_s: float = 0.0
    guard_forward_s: float = 0.0
    admit_attempts: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def queue_s(self) -> float:
        """Seconds between submission and admission (0 if never admitted)."""
        return max(0.0, self.admitted - self.submitted) if self.admitted else 0.0


class RequestHandle:
    """A submitted request: a future of its :class:`GenerationResult`; awaitable; cancellable.

    ``result()`` raises the request's error: :class:`~ragcache_backend.errors.RequestCancelledError`
    when cancelled, the typed error of a request that cannot run, or the forward's error.
    """

    __slots__ = ("rid", "future", "metrics", "first_logits", "forced_logits", "_cancel")

    def __init__(self, rid: int, cancel: Callable[[int], None]) -> None:
        self.rid = rid
        self.future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        self.metrics = RequestMetrics(submitted=time.perf_counter())
        #: float32 ``[vocab]`` logits of the prompt's last token, kept only when asked for.
        self.first_logits: torch.Tensor | None = None
        #: with teacher forcing (``submit_segments(teacher_tokens=...)``): float32 ``[n, vocab]``, the
        #: logits that predicted each of the ``n`` forced tokens (row 0: the prompt's last token's).
        self.forced_logits: torch.Tensor | None = None
        self._cancel = cancel
        self.future.add_done_callback(self._on_done)

    def _on_done(self, fut: concurrent.futures.Future) -> None:
        if fut.cancelled():  # e.g. the awaiting asyncio task was cancelled
            self._cancel(self.rid)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until done and return the result (or raise the request's error)."""
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()

    def cancel(self) -> None:
        """Cancel the request (queued, prefilling or decoding); its blocks are freed at once."""
        self._cancel(self.rid)

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state of one request between submission and finish.

    Attributes:
        rid: engine-unique id.
        segments: the prompt, as segments.
        plan: which segments the knowledge tree may serve (``plan.lead``) and what is always
            computed (``plan.rest``); the lead is empty when the request does not use the cache.
        sampling: sampling parameters.
        dropped: ids of documents left out to fit the context window.
        on_text: called (on the engine thread) with each final text delta.
        handle: the caller's handle.
        text: incremental detokenizer with stop strings.
        cancel: set by a caller to cancel (checked every step).
        keep_logits: keep the first token's logits on the handle (tests, evaluation).
        generator: per-request RNG for seeded sampling.
        reuse: how the cache serves it (exact prefixes, chunk caches, or both).
        recompute: which tokens of a reused chunk are recomputed (chunk modes).
        store: keep what it computes in the cache (False: an evaluation's dry run; chunk modes).
        lease: the request's hold on the cache from admission to finish.
        prefilled: prompt tokens its prefill has computed so far (a chunked prefill computes them
            over several steps; see :attr:`chunked_prefill`).
        generated: sampled token ids so far (stop token excluded).
        next_token: the last sampled token, fed to the next decode step.
        computed: prompt tokens this request prefilled (recomputed ones included).
        recomputed: tokens of reused chunks recomputed.
        chunk_cached: tokens served from chunk variants without recomputation.
        guarded: reused chunks the quality guard recomputed in full.
        deviation: the guard's signal (see ``GenerationResult.chunk_deviation``).
        chunk_reuse: per reused chunk, how it was fixed (``GenerationResult.chunk_reuse``).
        guard_tokens: rows the guard's second pass computed again (``GenerationResult.guard_tokens``).
        layout: how the prefill's rows map to the lease's pieces
            (:class:`~ragcache_backend.engine.batch.ChunkLayout`).
        retried: the request failed before its first token and runs again by recomputation.
        matcher: the grammar's state (constrained decoding), or None.
        penalty_ids: the prompt's token ids when a repetition penalty needs them, else empty.
        logprobs: the sampled tokens with their log-probabilities (``sampling.logprobs`` set).
        teacher: teacher forcing (evaluation): these tokens are fed instead of sampled ones and
            each step's logits kept (``forced``); empty: ordinary sampling.
        forced: the logits kept under teacher forcing, one ``[vocab]`` float32 row per step.
    """

    rid: int
    segments: tuple[Segment, ...]
    plan: PromptPlan
    sampling: SamplingParams
    dropped: tuple[str, ...]
    on_text: Callable[[str], None]
    handle: RequestHandle
    text: IncrementalText
    cancel: threading.Event
    keep_logits: bool = False
    generator: object | None = None
    reuse: ReuseMode = "exact"
    recompute: RecomputeRule | None = None
    store: bool = True
    lease: Lease | None = None
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None
    computed: int = 0
    recomputed: int = 0
    chunk_cached: int = 0
    guarded: int = 0
    deviation: float = 0.0
    chunk_reuse: tuple[ChunkReuse, ...] = ()
    guard_tokens: int = 0
    layout: object | None = None
    retried: bool = False
    matcher: GrammarMatcher | None = None
    penalty_ids: tuple[int, ...] = ()
    logprobs: list[SampledToken] = field(default_factory=list)
    teacher: tuple[int, ...] = ()
    forced: list[torch.Tensor] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def chunked_prefill(self) -> bool:
        """Its prefill may be split over several steps (vLLM's and SGLang's chunked prefill): an
        exact request. The chunk modes compute theirs whole, in one forward: their variant
        statistics, quality guard (and its second pass) and recompute selection (CacheBlend-style,
        Algorithm 1) are measured over the whole prompt."""
        return self.reuse == "exact"

    @property
    def rest_tokens(self) -> int:
        """Prompt tokens past the lead (always computed)."""
        return len(self.plan.rest)

    def accept(self, choice: SampledToken, stop_ids: frozenset[int]) -> FinishReason | None:
        """Take one sampled token: follow it in the grammar, emit its text; return why the
        request ends, or None to go on. A complete grammar ends the request (``stop``).

        Raises whatever ``on_text`` raises (the caller's callback); GrammarError when the grammar
        refuses the token.
        """
        text, on_text, token = self.text, self.on_text, choice.token
        if token in stop_ids:
            tail = text.flush()
            if tail:
                on_text(tail)
            return "stop"
        if self.matcher is not None:
            self.matcher.advance(token)
        self.generated.append(token)
        if choice.logprob is not None:
            self.logprobs.append(choice)
        self.handle.metrics.generated_tokens = len(self.generated)
        delta = text.push(token)
        if delta:
            on_text(delta)
        if text.stopped:
            return "stop"
        if self.matcher is not None and self.matcher.done:
            tail = text.flush()
            if tail:
                on_text(tail)
            return "stop"
        if len(self.generated) >= self.sampling.max_tokens:
            tail = text.flush()
            if tail:
                on_text(tail)
            return "length"
        return None

    def result(self, reason: FinishReason, model: str) -> GenerationResult:
        """What the request gives back once it stopped for ``reason``."""
        m, lease = self.handle.metrics, self.lease
        return GenerationResult(
            answer=self.text.answer,
            token_ids=tuple(self.generated),
            finish_reason=reason,
            ttft_s=m.first_token - m.submitted,
            total_s=m.finished - m.submitted,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.prompt_tokens - self.computed,
            computed_tokens=self.computed,
            device_hits=lease.device_hits if lease else 0,
            host_hits=lease.host_hits if lease else 0,
            disk_hits=lease.disk_hits if lease else 0,
            documents=tuple(s.doc_id for s in self.segments if s.doc_id is not None),
            dropped_documents=self.dropped,
            model=model,
            reuse=self.reuse,
            chunk_cached_tokens=self.chunk_cached,
            recomputed_tokens=self.recomputed,
            chunk_hits=lease.chunk_hits if lease else 0,
            guarded_chunks=self.guarded,
            chunk_deviation=self.deviation,
            guard_tokens=self.guard_tokens,
            logprobs=tuple(self.logprobs),
            chunk_reuse=self.chunk_reuse,
        )
