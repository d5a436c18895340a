"""Continuous-batching scheduler with cache-aware reordering and chunked prefill (RAGCache §5.2;
vLLM's and SGLang's chunked prefill). Plain data only.

The scheduler never touches tensors nor the cache: the serving engine tells it, per pending
request, how many prompt tokens the knowledge tree holds now (``cached``) and how many would have
to be computed (``compute``), and, per admitted request, how many prompt tokens its prefill still
has to compute (:meth:`Scheduler.start`, :meth:`Scheduler.advance`). For each forward step the
scheduler answers which running requests decode and, per prefill, how many prompt tokens this
step computes (:class:`PrefillChunk`).

A request is *pending* (queued, not admitted), *prefilling* (admitted, prompt tokens left to
compute: its cache lease holds its blocks across steps) or *decoding* (its first token sampled).

**Cache-aware reordering.** Pending requests are admitted by
``order_priority = cached_length / computation_length`` (highest first; ties by arrival), which
favours requests that reuse much and compute little (§5.2). **Starvation window:** every time a
request is admitted ahead of an older pending request, that older request's ``bypassed`` count
grows by one; a request bypassed ``window`` times is admitted next (oldest first), so no request
is overtaken by more than ``window`` later arrivals. ``reorder=False`` gives plain FIFO.

**Each step** has a budget of ``max_batch_tokens`` new tokens (rows) and ``max_batch_size``
sequences:

1. every decoding request contributes one row (always, even when decodes alone fill the budget);
2. prefilling requests, in admission order, get chunks of what is left of the budget (each
   ``min(left, still to compute)`` tokens);
3. pending requests are admitted in the order above while a sequence slot is free (prefilling and
   decoding requests hold theirs) and budget is left: each computes ``min(left, compute)`` tokens
   now, so a prompt longer than what is left (or than the whole budget) is admitted and computes
   its first chunk in this step and the rest in later ones (step 2). Admission stops at the first
   request that cannot be admitted, so the order is respected. One exception: **a request whose
   next prompt piece is being computed** by an admitted prefill (or by one admitted earlier in
   the same step) is passed over, not admitted: it would compute the same KV a second time (two
   requests of a burst retrieving the same new document). It waits for that piece to be committed
   to the tree, where its refreshed estimate then finds it cached. vLLM gets the same effect by
   registering a block's hash when the block is scheduled. Pieces are opaque ids the engine gives
   (:attr:`PendingRequest.pieces`); a request without pieces is never passed over.

The prefills' rows never exceed the budget but, so that decodes filling it (``max_batch_tokens``
at or below the decode count) never stall a prefill for good, the prefills always get at least
one row. A request whose prefill cannot be split (``chunkable=False``: the chunk-cache modes,
whose variant statistics, quality guard and recompute selection need the whole prompt in one
forward) is admitted only when its whole ``compute`` fits what is left, or, when it is larger than
the budget left by the decodes, into a step with no other prefill (so it cannot starve; the one
case where a step exceeds the budget).

**Speculation (RAGCache §5.3, Algorithm 2).** :func:`decide_speculation` says, from plain counts,
what a pipelined request does when its vector search produces a new stage: when the candidate
top-k changed, the stale speculative request is terminated (after its current step) and a new one
is started only while fewer than ``max_prefill_bs`` requests wait for prefill, so speculation uses
idle capacity and never adds load to a busy engine (Theorem 5.1). :meth:`Scheduler.waiting` is
that pool size: pending requests plus prefilling ones (a request with prompt chunks left still
waits for prefill compute).
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
        max_batch_size: sequences in one forward step (decodes, continuing prefills and new
            admissions; an admitted request holds its slot until it finishes), >= 1.
        max_batch_tokens: the step's token budget, >= 1: one row per decode plus each prefill
            chunk's tokens (vLLM's ``max_num_batched_tokens``). It bounds how long a step, and so
            every running decode, waits behind prefills; a prompt longer than what is left of it
            is computed in chunks over several steps.
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
        waiting: requests waiting for prefill in the engine (the pool: queued, or admitted with
            prompt chunks left to compute), the stale speculative request excluded.
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
        compute: prompt tokens still to compute (estimate), >= 0.
        chunkable: its prefill may be split over several steps (False: it runs whole in one step).
        bypassed: how many later requests were admitted ahead of this one.
        arrival_s: ``time.perf_counter()`` at :meth:`Scheduler.add`.
        pieces: ids of the prompt pieces (tree nodes) its prefill would compute and commit, in
            prompt order, the first one right after its cached prefix (estimate, refreshed with
            ``cached``); empty when it commits nothing to the tree.
    """

    rid: int
    seq: int
    cached: int
    compute: int
    chunkable: bool = True
    bypassed: int = 0
    arrival_s: float = 0.0
    pieces: tuple[int, ...] = ()

    @property
    def priority(self) -> float:
        return order_priority(self.cached, self.compute)


@dataclass(slots=True, frozen=True)
class PrefillChunk:
    """Prompt tokens one prefill computes in a step (vLLM/SGLang chunked prefill).

    Attributes:
        rid: the request.
        tokens: prompt tokens to compute in this step, >= 1: at most what the request has left
            (for a new admission: at most its ``compute`` estimate; the engine computes no more
            than the prompt actually needs once admitted). A request that is not ``chunkable`` is
            given its whole ``compute``.
        new: the request is admitted by this step (its first chunk); False: it continues a prefill
            admitted in an earlier step.
    """

    rid: int
    tokens: int
    new: bool


@dataclass(slots=True, frozen=True)
class ScheduledStep:
    """One forward step: requests to decode (one token each), then the prefill chunks, in order
    (continuing prefills first, then new admissions in admission order)."""

    decode: tuple[int, ...]
    prefill: tuple[PrefillChunk, ...]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def tokens(self) -> int:
        """New tokens (rows) of the step: one per decode plus every chunk's."""
        return len(self.decode) + sum(c.tokens for c in self.prefill)

    @property
    def admitted(self) -> tuple[int, ...]:
        """Ids of the requests this step admits, in order."""
        return tuple(c.rid for c in self.prefill if c.new)


@dataclass(slots=True)
class Scheduler:
    """Pending queue, prefilling and decoding sets; see the module docstring for the rules."""

    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    _pending: dict[int, PendingRequest] = field(default_factory=dict)
    _prefilling: dict[int, int] = field(default_factory=dict)  # rid -> prompt tokens still to compute, admission order
    _decoding: dict[int, None] = field(default_factory=dict)  # insertion-ordered set
    _computing: dict[int, frozenset[int]] = field(default_factory=dict)  # rid -> pieces its prefill commits
    _seq: itertools.count = field(default_factory=itertools.count)

    # ---- views ---------------------------------------------------------------------------------
    @property
    def pending(self) -> tuple[int, ...]:
        """Pending request ids in arrival order."""
        return tuple(self._pending)

    @property
    def prefilling(self) -> tuple[int, ...]:
        """Admitted requests with prompt tokens left to compute, in admission order."""
        return tuple(self._prefilling)

    @property
    def decoding(self) -> tuple[int, ...]:
        """Requests past their prefill (one decode row each step), in the order they got there."""
        return tuple(self._decoding)

    @property
    def running(self) -> tuple[int, ...]:
        """Admitted requests: prefilling, then decoding."""
        return tuple(self._prefilling) + tuple(self._decoding)

    def __len__(self) -> int:
        return len(self._pending) + len(self._prefilling) + len(self._decoding)

    @property
    def waiting(self) -> int:
        """Requests waiting for prefill (the pool of Algorithm 2): pending, and prefilling ones
        with chunks left (their prefill still competes for the step's budget)."""
        return len(self._pending) + len(self._prefilling)

    def entry(self, rid: int) -> PendingRequest:
        return self._pending[rid]

    def remaining(self, rid: int) -> int:
        """Prompt tokens a prefilling request still has to compute."""
        return self._prefilling[rid]

    # ---- changes -------------------------------------------------------------------------------
    def add(self, rid: int, cached: int = 0, compute: int = 1, *, chunkable: bool = True) -> PendingRequest:
        """Queue a new request (``chunkable``: its prefill may be split over several steps)."""
        if rid in self:
            raise InvalidRequestError(f"request {rid} is already scheduled")
        entry = PendingRequest(rid, next(self._seq), cached, compute, chunkable, arrival_s=time.perf_counter())
        self._pending[rid] = entry
        return entry

    def __contains__(self, rid: int) -> bool:
        return rid in self._pending or rid in self._prefilling or rid in self._decoding

    def update(self, rid: int, cached: int, compute: int, pieces: tuple[int, ...] = ()) -> None:
        """Refresh a pending request's cached / computed token estimate and the pieces it would
        compute (:attr:`PendingRequest.pieces`)."""
        entry = self._pending[rid]
        entry.cached, entry.compute, entry.pieces = cached, compute, tuple(pieces)

    def remove(self, rid: int) -> bool:
        """Drop a request (cancelled, failed or finished) wherever it is; False if unknown."""
        if self._pending.pop(rid, None) is not None:
            return True
        self._computing.pop(rid, None)
        if self._prefilling.pop(rid, None) is not None:
            return True
        return self._decoding.pop(rid, 1) is None

    def start(self, rid: int, remaining: int) -> None:
        """Mark a pending request as admitted, with ``remaining`` (>= 1) prompt tokens to compute
        (the engine's count from its lease, which may differ from the ``compute`` estimate);
        charges the bypass to older pending requests.

        Raises:
            InvalidRequestError: ``remaining`` below 1 (a prefill computes at least the prompt's
                last token).
        """
        if remaining < 1:
            raise InvalidRequestError(f"a prefill computes >= 1 token, got {remaining}")
        entry = self._pending.pop(rid)
        for other in self._pending.values():
            if other.seq < entry.seq:
                other.bypassed += 1
        self._prefilling[rid] = remaining
        if entry.pieces:
            self._computing[rid] = frozenset(entry.pieces)

    def advance(self, rid: int, tokens: int) -> bool:
        """A step computed ``tokens`` of a prefilling request's prompt; True when its prefill is
        complete (it decodes from the next step on).

        Raises:
            InvalidRequestError: fewer than 1 token, or more than it had left.
        """
        left = self._prefilling[rid]
        if not 1 <= tokens <= left:
            raise InvalidRequestError(f"request {rid} has {left} prompt tokens left, a step cannot compute {tokens}")
        if tokens < left:
            self._prefilling[rid] = left - tokens
            return False
        del self._prefilling[rid]
        self._computing.pop(rid, None)
        self._decoding[rid] = None
        return True

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
        """The next forward step (does not change state: call :meth:`start` for each admitted
        request and :meth:`advance` for each chunk computed)."""
        cfg = self.config
        decode = tuple(self._decoding)
        # decodes never wait; the prefills get what they leave, and at least one row (progress)
        left = max(1, cfg.max_batch_tokens - len(decode))
        chunks: list[PrefillChunk] = []
        for rid, remaining in self._prefilling.items():
            if left == 0:
                break
            take = min(left, remaining)
            chunks.append(PrefillChunk(rid, take, new=False))
            left -= take
        slots = cfg.max_batch_size - len(decode) - len(self._prefilling)
        computing = set().union(*self._computing.values())  # pieces admitted prefills will commit
        for entry in self.order():
            if slots > 0 and entry.pieces and entry.pieces[0] in computing:
                continue  # its next piece is being computed: wait for it in the tree, not compute it twice
            chunk = self._admission(entry, left, alone=not chunks) if slots > 0 else None
            if chunk is None:
                break  # keep the order: never admit a later request past one that waits
            chunks.append(chunk)
            computing.update(entry.pieces)
            slots -= 1
            left = max(0, left - chunk.tokens)
        return ScheduledStep(decode, tuple(chunks))

    def _admission(self, entry: PendingRequest, left: int, *, alone: bool) -> PrefillChunk | None:
        """The first chunk of a pending request admitted with ``left`` tokens of budget left
        (``alone``: no other prefill in the step yet), or None: it waits."""
        need = max(1, entry.compute)
        if entry.chunkable:
            return PrefillChunk(entry.rid, min(need, left), new=True) if left > 0 else None
        if need <= left or (alone and need > self.config.max_batch_tokens - len(self._decoding)):
            # (a prompt that cannot be split and is larger than the budget the decodes leave runs
            # alone, or it would never run)
            return PrefillChunk(entry.rid, need, new=True)
        return None
