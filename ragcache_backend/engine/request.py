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
from ragcache_backend.cache.lease import ChunkLease, Lease
from ragcache_backend.model.sampling import SamplingParams
from ragcache_backend.prompts.builder import PromptPlan, Segment
from ragcache_backend.prompts.detokenizer import IncrementalText

if TYPE_CHECKING:
    import torch

__all__ = ["FinishReason", "GenerationResult", "ReuseMode", "Request", "RequestHandle", "RequestMetrics", "StreamChunk"]

FinishReason = Literal["stop", "length"]
ReuseMode = Literal["exact", "chunk", "auto"]


@dataclass(slots=True, frozen=True)
class GenerationResult:
    """What one request produced and how much of its prompt came from the cache.

    Attributes:
        answer: generated text (stop string excluded).
        token_ids: generated token ids (stop token excluded).
        finish_reason: ``"stop"`` (stop token or string) or ``"length"`` (``max_tokens``).
        ttft_s: seconds from submission to the first sampled token (queueing, admission, prefill).
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
        chunk_deviation: the quality guard's signal: the largest mean relative change of a reused
            chunk's recomputed K/V (0.0 when nothing was recomputed or the guard was off).
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
    disk_hits: int = 0


@dataclass(slots=True, frozen=True)
class StreamChunk:
    """A streamed text delta; the last chunk of a stream carries the full ``result``."""

    text: str
    result: GenerationResult | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Timing of one request (seconds, ``time.perf_counter`` clock).

    ``sched_s`` is the scheduling overhead charged to the request (RAGCache Table 4's scope): its
    share of the reordering estimate and planning, its admission (match, lock, allocate, evict)
    and its commit (insert + PGDSF update). KV copies between tiers made meanwhile are data
    movement, counted apart in ``kv_copy_s``.
    """

    submitted: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    sched_s: float = 0.0
    kv_copy_s: float = 0.0
    admit_attempts: int = 0
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

    __slots__ = ("rid", "future", "metrics", "first_logits", "_cancel")

    def __init__(self, rid: int, cancel: Callable[[int], None]) -> None:
        self.rid = rid
        self.future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        self.metrics = RequestMetrics(submitted=time.perf_counter())
        #: float32 ``[vocab]`` logits of the prompt's last token, kept only when asked for.
        self.first_logits: torch.Tensor | None = None
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
        lease: the request's hold on the cache from admission to finish (a ``ChunkLease`` in the
            chunk modes).
        generated: sampled token ids so far (stop token excluded).
        next_token: the last sampled token, fed to the next decode step.
        computed: prompt tokens this request prefilled (recomputed ones included).
        recomputed: tokens of reused chunks recomputed.
        chunk_cached: tokens served from chunk variants without recomputation.
        guarded: reused chunks the quality guard recomputed in full.
        deviation: the guard's signal (see ``GenerationResult.chunk_deviation``).
        layout: a chunk-mode prefill's :class:`~ragcache_backend.engine.chunk_step.ChunkLayout`.
        retried: the request failed before its first token and runs again by recomputation.
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
    lease: Lease | ChunkLease | None = None
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None
    computed: int = 0
    recomputed: int = 0
    chunk_cached: int = 0
    guarded: int = 0
    deviation: float = 0.0
    layout: object | None = None
    retried: bool = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def rest_tokens(self) -> int:
        """Prompt tokens past the lead (always computed)."""
        return len(self.plan.rest)
