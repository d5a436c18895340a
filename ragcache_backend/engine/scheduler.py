"""Continuous-batching scheduler with cache-aware reordering (RAGCache §5.2). Plain data only.

The scheduler never touches tensors nor the cache: the serving engine tells it, per pending
request, how many prompt tokens the knowledge tree holds now (``cached``) and how many would have
to be computed (``compute``); the scheduler answers, for each forward step, which running requests
decode and which pending requests are admitted for prefill.

**Cache-aware reordering.** Pending requests are admitted by
``order_priority = cached_length / computation_length`` (highest first; ties by arrival), which
favours requests that reuse much and compute little (§5.2). **Starvation window:** every time a
request is admitted ahead of an older pending request, that older request's ``bypassed`` count
grows by one; a request bypassed ``window`` times is admitted next (oldest first), so no request
is overtaken by more than ``window`` later arrivals. ``reorder=False`` gives plain FIFO.

**Each step.** Every running request decodes one token per step. Pending requests are
admitted for prefill while the step has fewer than ``max_batch_size`` sequences and the new
tokens of the step (one per decode plus each prefill's computed tokens) stay within
``max_batch_tokens``. A prompt larger than the whole token budget is admitted only into a step
with no other prefill, so it cannot starve (the one case where a step exceeds the budget).
Admission stops at the first request that does not fit, so the order above is respected.

**Speculation (RAGCache §5.3, Algorithm 2).** :func:`decide_speculation` says, from plain counts,
what a pipelined request does when its vector search produces a new stage: when the candidate
top-k changed, the stale speculative request is terminated (after its current step) and a new one
is started only while fewer than ``max_prefill_bs`` requests wait for prefill, so speculation uses
idle capacity and never adds load to a busy engine (Theorem 5.1). :meth:`Scheduler.waiting` is
that pool size.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from ragcache_backend.errors import InvalidRequestError


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Knobs of the continuous-batching scheduler.

    Attributes:
        max_batch_size: sequences (prefill + decode) in one forward step, >= 1.
        max_batch_tokens: new tokens computed in one forward step, >= 1.
        reorder: cache-aware reordering on (RAGCache §5.2) or FIFO (ablation).
        window: a pending request is overtaken by at most this many later requests (>= 0;
            0 means FIFO even when ``reorder`` is on).
    """

    max_batch_size: int = 8
    max_batch_tokens: int = 4096
    reorder: bool = True
    window: int = 32

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise InvalidRequestError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_batch_tokens < 1:
            raise InvalidRequestError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.window < 0:
            raise InvalidRequestError(f"window must be >= 0, got {self.window}")


def order_priority(cached_tokens: int, compute_tokens: int) -> float:
    """RAGCache §5.2: ``cached_length / computation_length`` (computation counted as >= 1 token)."""
    return cached_tokens / max(1, compute_tokens)


@dataclass(slots=True, frozen=True)
class SpeculationDecision:
    """What a pipelined request does after a search stage (RAGCache Algorithm 2, lines 6-10).

    Attributes:
        terminate: stop the request's current speculative generation after its current step
            (its blocks are freed; what its prefill committed stays in the tree, exact KV).
        start: start a speculative generation for the stage's candidate top-k.
    """

    terminate: bool
    start: bool


def decide_speculation(*, changed: bool, speculating: bool, waiting: int, max_prefill_bs: int) -> SpeculationDecision:
    """RAGCache Algorithm 2 for one search stage, as a pure function of plain data.

    Args:
        changed: the stage's top-k (ids, in order) differs from the previous stage's.
        speculating: the request has a speculative generation in the engine now.
        waiting: requests waiting for prefill in the engine (the pool), the stale speculative
            request excluded.
        max_prefill_bs: the pool size below which a speculative generation may start (>= 0).

    Returns:
        terminate the stale generation when the candidates changed; start a new one when they
        changed and ``waiting < max_prefill_bs``.
    """
    if not changed:
        return SpeculationDecision(terminate=False, start=False)
    return SpeculationDecision(terminate=speculating, start=waiting < max_prefill_bs)


@dataclass(slots=True)
class PendingRequest:
    """A request waiting for admission (scheduler view).

    Attributes:
        rid: the caller's request id.
        seq: arrival order (assigned by the scheduler).
        cached: prompt tokens currently held by the cache (estimate, refreshed by the caller).
        compute: prompt tokens still to compute (estimate).
        bypassed: how many later requests were admitted ahead of this one.
        arrival_s: ``time.perf_counter()`` at :meth:`Scheduler.add`.
    """

    rid: int
    seq: int
    cached: int
    compute: int
    bypassed: int = 0
    arrival_s: float = 0.0

    @property
    def priority(self) -> float:
        return order_priority(self.cached, self.compute)


@dataclass(slots=True, frozen=True)
class ScheduledStep:
    """One forward step: requests to decode (one token each) and to admit for prefill, in order."""

    decode: tuple[int, ...]
    prefill: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass(slots=True)
class Scheduler:
    """Pending queue + running set; see the module docstring for the rules."""

    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    _pending: dict[int, PendingRequest] = field(default_factory=dict)
    _running: dict[int, None] = field(default_factory=dict)  # insertion-ordered set
    _seq: itertools.count = field(default_factory=itertools.count)

    # ---- views ---------------------------------------------------------------------------------
    @property
    def pending(self) -> tuple[int, ...]:
        """Pending request ids in arrival order."""
        return tuple(self._pending)

    @property
    def running(self) -> tuple[int, ...]:
        return tuple(self._running)

    def __len__(self) -> int:
        return len(self._pending) + len(self._running)

    @property
    def waiting(self) -> int:
        """Requests waiting for admission (the pool of Algorithm 2)."""
        return len(self._pending)

    def entry(self, rid: int) -> PendingRequest:
        return self._pending[rid]

    # ---- changes -------------------------------------------------------------------------------
    def add(self, rid: int, cached: int = 0, compute: int = 1) -> PendingRequest:
        """Queue a new request."""
        if rid in self._pending or rid in self._running:
            raise InvalidRequestError(f"request {rid} is already scheduled")
        entry = PendingRequest(rid, next(self._seq), cached, compute, arrival_s=time.perf_counter())
        self._pending[rid] = entry
        return entry

    def update(self, rid: int, cached: int, compute: int) -> None:
        """Refresh a pending request's cached / computed token estimate."""
        entry = self._pending[rid]
        entry.cached, entry.compute = cached, compute

    def remove(self, rid: int) -> bool:
        """Drop a request (cancelled, failed or finished) wherever it is; False if unknown."""
        if self._pending.pop(rid, None) is not None:
            return True
        return self._running.pop(rid, 1) is None

    def start(self, rid: int) -> None:
        """Mark an admitted request as running, charging the bypass to older pending requests."""
        entry = self._pending.pop(rid)
        for other in self._pending.values():
            if other.seq < entry.seq:
                other.bypassed += 1
        self._running[rid] = None

    # ---- decisions -------------------------------------------------------------------------------
    def order(self) -> list[PendingRequest]:
        """Pending requests in admission order (starving first, then by priority or arrival)."""
        entries = list(self._pending.values())  # arrival order
        cfg = self.config
        if not cfg.reorder or cfg.window == 0:
            return entries
        starving = [e for e in entries if e.bypassed >= cfg.window]
        rest = [e for e in entries if e.bypassed < cfg.window]
        rest.sort(key=lambda e: (-e.priority, e.seq))
        return starving + rest

    def schedule(self) -> ScheduledStep:
        """The next forward step (does not change state: call :meth:`start` for each admitted)."""
        cfg = self.config
        decode = tuple(self._running)
        slots = cfg.max_batch_size - len(decode)
        budget = cfg.max_batch_tokens - len(decode)
        prefill: list[int] = []
        if slots > 0:
            for entry in self.order():
                if len(prefill) >= slots:
                    break
                need = max(1, entry.compute)
                if need <= budget:
                    prefill.append(entry.rid)
                    budget -= need
                elif not prefill and need > cfg.max_batch_tokens - len(decode):
                    prefill.append(entry.rid)  # oversize prompt: alone, or it would never run
                    break
                else:
                    break  # keep the order: never admit a later request past one that waits
        return ScheduledStep(decode, tuple(prefill))
