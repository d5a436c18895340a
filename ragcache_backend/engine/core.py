"""The engine's core: one step loop that every caller's requests go through (RAGCache §5.1-5.2).

The loop runs on one background thread that owns the runner and the cache (neither is
thread-safe), as nano-vllm's ``step()`` drives its scheduler, block manager and model runner.
Each :meth:`EngineCore.step`:

1. takes new requests and cancellations;
2. refreshes each waiting request's cached / to-compute estimate (knowledge-tree match) and asks
   the :class:`~ragcache_backend.engine.scheduler.Scheduler` for the step: every running request
   decodes one token, and prefills get chunks of the step's token budget (continuing prefills
   first, then new admissions in cache-aware order; vLLM's and SGLang's chunked prefill);
3. **admits** the newly scheduled prefills through the cache's protocol (:meth:`TieredCache.admit`:
   match, lock, swap in, choose chunk variants, allocate); "no room now" is a ``None`` the loop
   waits on, "can never fit" fails the request at once. The lease holds the request's blocks
   across the steps its prefill takes;
4. runs **one** forward step over every prefill chunk and every running decode (continuous
   batching), the inputs built from each request's lease by :mod:`ragcache_backend.engine.batch`
   (chunk ``k`` of a prefill: the prefix and the earlier chunks as cached context);
5. **commits** what each chunk completed: the segments (documents, block nodes) it computed whole
   become tree nodes at once (:meth:`TieredCache.commit_prefix`); after a prefill's last chunk the
   rest is committed (PGDSF statistics, chunk variants; in the chunk modes a reused chunk the
   quality guard flags is first recomputed in full by a second forward of that request), the first
   token is sampled, and then each step streams text; requests that stopped are **finished**: their
   lease is released on success, error and cancellation alike.

Only exact-mode prefills are chunked (:attr:`Request.chunked_prefill`); the chunk modes compute
theirs whole in one step. Nothing is inserted into the tree before its KV is complete (a whole
segment computed by a forward step that succeeded), so a request that fails or is cancelled
between chunks leaves only exact nodes of its own prefix, never a poisoned or partial one. A
request that fails before its first token with an error that is not its own fault runs once more,
computing everything (RAGCache §6).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragcache_backend.engine import batch
from ragcache_backend.engine.request import Request, RequestMetrics
from ragcache_backend.engine.scheduler import PrefillChunk
from ragcache_backend.engine.setup import EngineParts
from ragcache_backend.errors import CacheBudgetError, InvalidRequestError, RAGCacheError, RequestCancelledError
from ragcache_backend.model.forward import StepOutput
from ragcache_backend.model.sampling import SampledToken, choose_token
from ragcache_backend.prompts.builder import PromptPlan, Segment, plan_prompt

log = logging.getLogger("ragcache_backend.engine.engine")

__all__ = ["EngineClosedError", "EngineCore", "EngineStats"]

CHECK_INVARIANTS_ENV = "RAGCACHE_CHECK_INVARIANTS"
"""Set to 1 to run the cache's ``check_invariants`` after every step (the test suite does)."""


class EngineClosedError(RAGCacheError):
    """The engine is closed (or closing) and takes no new request."""


@dataclass(slots=True)
class EngineStats:
    """Totals over the engine's life (for ``ragcache bench``).

    Attributes:
        steps: forward steps run.
        forward_s: seconds inside ``runner.forward`` (the quality guard's second passes included).
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


@dataclass(slots=True, frozen=True)
class StepPrefill:
    """One prefill's share of a forward step (a chunk of its prompt, or all of it).

    Attributes:
        request: the admitted request.
        start: prompt tokens its prefill computed in earlier steps (this chunk's first token's
            index among the tokens :func:`~ragcache_backend.engine.batch.prefill_tokens` counts).
        tokens: prompt tokens computed in this step, >= 1.
        last: this chunk completes the prefill (the step's logits give the first token).
    """

    request: Request
    start: int
    tokens: int
    last: bool


class EngineCore:
    """The step loop over an engine's parts; :class:`~ragcache_backend.engine.engine.RAGCacheEngine`
    adds the public entry points. The loop's thread starts with the first request."""

    def __init__(self, parts: EngineParts, *, store=None) -> None:
        self.config = parts.config
        self.loaded = parts.loaded
        self.runner = parts.runner
        self.cache = parts.cache
        self.profile = parts.profile
        self.prompts = parts.prompts
        self.scheduler = parts.scheduler
        self.stop_ids = parts.stop_ids
        self.grammars = parts.grammars
        self.store = store
        self.stats = EngineStats()
        self._rule = parts.config.recompute_rule(parts.loaded.name)
        self._check = os.environ.get(CHECK_INVARIANTS_ENV, "") == "1"
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Request] = {}
        self._step_lock = threading.RLock()  # held for a whole step; also by reset_cache
        self._arena_commit = parts.runner.arena.commit_in_background() if parts.config.host_commit == "background" else None
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._closing = False
        self._queued = 0  # requests in the inbox (cancellations and wake-ups are not counted)
        self._waiting = 0  # requests whose prefill has not finished (queued or chunks left), as of the loop's last look
        self._queued_lock = threading.Lock()

    # ---- the loop thread -------------------------------------------------------------------------
    @property
    def recompute_rule(self):
        """The chunk modes' :class:`~ragcache_backend.cache.chunk_reuse.RecomputeRule` (from the
        settings; with ``chunk_kl_target``, the calibrated CFO scale)."""
        return self._rule

    def _enqueue(self, req: Request) -> None:
        """Hand a new request to the loop (starting its thread on first use)."""
        self._ensure_thread()
        with self._queued_lock:
            self._queued += 1
        self._inbox.put(req)

    def cancel(self, rid: int) -> None:
        """Cancel request ``rid`` wherever it is (no-op once it finished)."""
        self._inbox.put(rid)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._thread_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=EngineCore._run_loop, args=(weakref.ref(self),),
                                                    name="ragcache-engine", daemon=False)
                    self._thread.start()

    @staticmethod
    def _run_loop(ref: weakref.ReferenceType[EngineCore]) -> None:
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
                self.scheduler.add(item.rid, 0, item.prompt_tokens, chunkable=item.chunked_prefill)
                self._waiting = self.scheduler.waiting
            elif isinstance(item, int):
                req = self._live.get(item)
                if req is not None:
                    self._fail(req, RequestCancelledError("the request was cancelled"))

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> int:
        """Run one forward step over the scheduled prefill chunks and running decodes.

        Returns:
            the number of sequences in the step (0 when nothing could run).
        """
        with self._step_lock:
            try:
                return self._step()
            finally:
                if self._check:
                    self.cache.check_invariants()

    def _step(self) -> int:
        self._take(block=False)
        for req in [r for r in self._live.values() if r.cancel.is_set()]:
            self._fail(req, RequestCancelledError("the request was cancelled"))
        t0 = time.perf_counter()
        cfg = self.scheduler.config
        if cfg.reorder and cfg.window > 0:
            self._refresh_estimates()
        scheduled = self.scheduler.schedule()
        plan_s = time.perf_counter() - t0
        decoders = [self._live[rid] for rid in scheduled.decode]
        prefills = self._prefills(scheduled.prefill)
        self._waiting = self.scheduler.waiting
        stepping = [p.request for p in prefills] + decoders
        share = plan_s / max(1, len(stepping))
        for req in stepping:
            req.handle.metrics.sched_s += share
        self.stats.sched_s += time.perf_counter() - t0
        if not stepping:
            self._unblock()
            return 0
        t1 = time.perf_counter()
        try:
            inputs = [self._prefill_input(p) for p in prefills]
            inputs += [batch.decode_input(r.lease, r.next_token, r.rest_tokens + len(r.generated) - 1) for r in decoders]
            out = self.runner.forward_step(inputs)
        except Exception as exc:
            log.warning("forward step of %d sequences failed: %r", len(stepping), exc)
            for req in stepping:
                self._fail(req, exc)
            return 0
        self.stats.forward_s += time.perf_counter() - t1
        self.stats.steps += 1
        for i, p in enumerate(prefills):
            p.request.handle.metrics.batch_sizes.append(len(inputs))
            self._after_chunk(p, out, i)
        self._waiting = self.scheduler.waiting
        for req, lg in zip(decoders, out.logits[len(prefills):]):
            if req.rid in self._live:
                req.handle.metrics.batch_sizes.append(len(inputs))
                self._after_token(req, lg)
        self._persist()
        return len(inputs)

    def _prefills(self, chunks: Sequence[PrefillChunk]) -> list[StepPrefill]:
        """The step's prefill chunks: new requests admitted (in the scheduler's order, stopping at
        the first that gets no room now), each sized to what its prompt still needs (a prefill
        that cannot be chunked computes all of it).

        In the step's rows, chunks of more than one token come first and one-token chunks after
        them (each group in the scheduler's order), then the decodes: in float32 on the native path
        the runner runs a one-token chunk over a cached context (a full cache hit's last token) as a
        generated token's row, and a step whose prompt rows are its first rows gives every layer
        GEMM a slice of them instead of a gather and a scatter
        (:class:`~ragcache_backend.model.kernels.linear.StepRowClasses`). Admission keeps the
        scheduler's order; only the rows are reordered."""
        out: list[StepPrefill] = []
        for chunk in chunks:
            req = self._live[chunk.rid]
            if chunk.new and not self._admit(req):
                if req.rid in self._live:
                    break  # no room now: waits for running requests' blocks
                continue  # failed (it can never fit)
            left = batch.prefill_tokens(req.plan, req.lease) - req.prefilled
            n = min(chunk.tokens, left) if req.chunked_prefill else left
            out.append(StepPrefill(req, req.prefilled, n, n == left))
        return sorted(out, key=lambda p: p.tokens == 1)  # stable: multi-token chunks, then one-token ones

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
        """Each pending request's cached / computed tokens from the tree now, and the tree nodes
        its prefill would commit (ids of their key paths: the scheduler passes over a request
        whose next node another prefill is computing)."""
        for rid in self.scheduler.pending:
            req = self._live[rid]
            keys = [s.key for s in req.plan.lead]
            match = self.cache.match(keys) if keys else None
            cached = match.cached_tokens if match else 0
            pieces: list[int] = []
            if match is not None and req.store and req.reuse == "exact":
                path = 0  # a node's id: a hash chain over its key path from the root
                for i, key in enumerate(keys):
                    path = hash((path, key))
                    if i >= len(match.nodes):
                        pieces.append(path)
            self.scheduler.update(rid, cached, req.prompt_tokens - cached, tuple(pieces))

    # ---- admission, prefill, commit --------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        m = req.handle.metrics
        m.admit_attempts += 1
        t0, c0 = time.perf_counter(), self.cache.stats.copy_s
        if req.plan.repeat is not None and req.plan.rest_blocks:  # an exact repeat: the prompt's last block is cached
            path = (*req.plan.lead, req.plan.repeat)
            if self.cache.holds([s.key for s in path], [s.token_ids for s in path],
                                approximate=req.reuse != "exact" and req.recompute.kind != "all", rule=req.recompute.key):
                req.plan = req.plan.with_repeat()
        chunks = req.reuse != "exact" and bool(req.plan.lead)
        tail = req.rest_tokens + req.sampling.max_tokens
        specs = batch.lead_specs(req.plan.lead, chunks=chunks)
        try:
            if not chunks:
                lease = self.cache.admit(specs, tail)
            else:  # "chunk": the tree serves what precedes the first document; documents come from variants
                upto = next((i for i, s in enumerate(specs) if s.chunk), len(specs)) if req.reuse == "chunk" else len(specs)
                lease = self.cache.admit(specs, tail, exact_upto=upto, rule=req.recompute,
                                         fresh_above=self.config.chunk_fresh_above)
        except Exception as exc:  # can never fit, or a swap-in failed
            self._fail(req, exc)
            return False
        finally:
            self._charge(m, t0, c0)
        if lease is None:
            return False
        req.lease = lease
        m.admitted = time.perf_counter()
        self.scheduler.start(req.rid, batch.prefill_tokens(req.plan, lease))
        return True

    def _charge(self, m: RequestMetrics, t0: float, c0: float, forward_s: float = 0.0) -> None:
        """Charge the time since ``t0`` to the request: KV copies (the cache's ``copy_s`` since ``c0``)
        to ``kv_copy_s``, ``forward_s`` (a forward pass run meanwhile) to neither, the rest to ``sched_s``."""
        copy = self.cache.stats.copy_s - c0
        m.kv_copy_s += copy
        m.sched_s += time.perf_counter() - t0 - copy - forward_s

    def _prefill_input(self, p: StepPrefill):
        req = p.request
        if req.chunked_prefill:
            req.layout = None  # nothing reused: no chunk rows to map back
            return batch.prefill_chunk_input(req.plan, req.lease, p.start, p.tokens)
        if req.lease.chunk_hits:
            t0 = time.perf_counter()
            batch.copy_variants(req.lease, self.runner.arena)
            req.handle.metrics.kv_copy_s += time.perf_counter() - t0
        item, req.layout = batch.prefill_input(req.plan, req.lease, rule=req.recompute)
        return item

    def _after_chunk(self, p: StepPrefill, out: StepOutput, index: int) -> None:
        """After a prefill's chunk: its progress, then the first token after the last chunk, or
        the segments this chunk completed into the tree."""
        req = p.request
        req.prefilled += p.tokens
        self.scheduler.advance(req.rid, p.tokens)
        req.handle.metrics.computed_tokens = req.prefilled  # work done so far (a cancelled request's waste)
        if p.last:
            self._after_prefill(req, out, index)
        else:
            self._commit_chunk(req)

    def _commit_chunk(self, req: Request) -> None:
        """Commit the lead segments the chunks so far completed, so other requests (and the disk
        tier) reuse them before this prefill ends; a failure fails the request (retried if it may)."""
        lease = req.lease
        done = batch.complete_pieces(lease, req.prefilled)
        if not req.store or done <= lease.committed_pieces:
            return
        m = req.handle.metrics
        t0, c0 = time.perf_counter(), self.cache.stats.copy_s
        try:
            self.cache.commit_prefix(lease, done, req.rest_tokens)
        except Exception as exc:
            self._fail(req, exc)
        finally:
            self._charge(m, t0, c0)

    def _after_prefill(self, req: Request, out: StepOutput, index: int) -> None:
        m = req.handle.metrics
        try:
            t0, c0, g0 = time.perf_counter(), self.cache.stats.copy_s, m.guard_forward_s
            logits = self._commit(req, out, index)
            self._charge(m, t0, c0, m.guard_forward_s - g0)
            if req.keep_logits:
                req.handle.first_logits = logits.clone()
        except Exception as exc:
            self._fail(req, exc)
            return
        m.first_token = time.perf_counter()
        self._after_token(req, logits)

    def _commit(self, req: Request, out: StepOutput, index: int) -> torch.Tensor:
        """Guard, statistics and commit of a prefill; returns the first token's logits.

        In the chunk modes a reused chunk whose recomputed tokens moved too far (the quality guard)
        is recomputed in full, with everything after it, in a second forward of this request alone;
        what precedes the first flagged chunk keeps the first pass's KV (and statistics). The first
        pass's rows that the second computes again are counted (``guard_tokens``).
        An exact prefill (``layout`` None; maybe chunked) reused nothing but its prefix: no guard,
        no variant, and the segments earlier chunks completed are in the tree already."""
        lease, layout = req.lease, req.layout
        if layout is None:
            req.computed = req.prompt_tokens - lease.cached_tokens
            req.handle.metrics.computed_tokens = req.computed
            if req.store:
                self.cache.commit(lease, req.rest_tokens)
            return out.logits[index]
        logits, attention, depth = out.logits[index], out.attention[index], out.depth[index]
        deviations = batch.chunk_deviations(lease, layout, out.deviation[index])
        reads = batch.chunk_attention(layout, out.last_mass[index])  # how much the answer reads each chunk
        signals = batch.guard_signals(deviations, reads)
        req.deviation = max(signals.values(), default=0.0)
        flagged = batch.guard_flags(signals, req.recompute.guard)
        req.chunk_reuse = batch.chunk_reuse(lease, deviations, reads, flagged)
        stats = batch.variant_stats(lease, layout, attention) if req.store else []
        if flagged:
            first = min(flagged)
            req.guard_tokens = batch.rows_from(layout, first, req.rest_tokens, depth, self.runner.num_layers)
            item, layout = batch.prefill_input(req.plan, lease, rule=req.recompute, guard=False, full=flagged)
            t1 = time.perf_counter()
            again = self.runner.forward_step([item])
            spent = time.perf_counter() - t1
            req.handle.metrics.guard_forward_s += spent  # a forward pass: not scheduling (see _after_prefill)
            self.stats.forward_s += spent
            logits, attention, depth = again.logits[0], again.attention[0], again.depth[0]
            for i in flagged:  # computed in full now: no longer served from a variant
                lease.pieces[i].use = None
            req.guarded = len(flagged)
            if req.store:  # the pieces before the first flagged one kept the first pass's KV and statistics
                stats = stats[:first] + batch.variant_stats(lease, layout, attention)[first:]
        req.recomputed = batch.recomputed_tokens(lease, layout, depth, self.runner.num_layers)
        # cached = exact prefix nodes + approximate ones (earlier chunk reuse) + reused chunks not recomputed
        req.chunk_cached = (lease.approximate_prefix_tokens - req.recomputed
                            + sum(p.spec.num_tokens for p in lease.pieces if p.use is not None))
        req.computed = req.prompt_tokens - (lease.cached_tokens - lease.approximate_prefix_tokens) - req.chunk_cached
        req.handle.metrics.computed_tokens = req.computed
        if req.store:
            self.cache.commit(lease, req.rest_tokens, stats)
        return logits

    # ---- tokens and results ----------------------------------------------------------------------
    def _after_token(self, req: Request, logits: torch.Tensor) -> None:
        try:
            if req.teacher:  # teacher forcing: keep the logits, feed the given token
                req.forced.append(logits.float().clone())
                choice = SampledToken(req.teacher[len(req.generated)])
            else:
                allowed = req.matcher.allowed(logits.shape[-1]) if req.matcher is not None else None
                choice = choose_token(logits, req.sampling, req.generator, prompt_ids=req.penalty_ids,
                                      generated=req.generated, allowed=allowed)
            reason = req.accept(choice, self.stop_ids)
            if reason is not None and req.teacher:
                req.handle.forced_logits = torch.stack(req.forced)
        except Exception as exc:  # e.g. the caller's on_text raised
            self._fail(req, exc)
            return
        if reason is None:
            req.next_token = choice.token
            return
        m = req.handle.metrics
        try:
            self._keep_tail(req)
            self.cache.finish(req.lease)
        finally:
            self._forget(req)
        m.finished = time.perf_counter()
        self.stats.finished += 1
        if not req.handle.future.done():
            req.handle.future.set_result(req.result(reason, self.loaded.name))

    def _keep_tail(self, req: Request) -> None:
        """A finished request's full tail blocks (prompt rest, then its answer) become block nodes,
        so the next turn of a chat reuses them. Generated tokens' KV comes from decode steps; it is
        kept in float32 only, where it equals a prefill's to rounding (1e-4 on the logits; bf16
        kernels compute decode rows on another path)."""
        block_tokens = self.block_tokens
        if block_tokens is None or not req.store or req.lease is None or req.retried:
            return
        fed = req.generated[:-1] if self.loaded.dtype == torch.float32 else []
        specs = batch.tail_block_specs(req.plan, fed, block_tokens, req.segments[-1].salt if req.segments else "")
        repeat = req.plan.repeat if req.plan.rest_blocks else None
        if not specs and repeat is None:
            return
        try:
            self.cache.keep_tail(req.lease, specs, req.lease.cached_tokens + sum(p.spec.num_tokens for p in req.lease.pieces),
                                 batch.lead_specs([repeat], chunks=False)[0] if repeat is not None else None)
        except Exception:  # the cache is a cache: a failure to keep the tail never fails the request
            log.exception("keeping request %d's tail blocks failed; they are freed", req.rid)

    @property
    def block_tokens(self) -> int | None:
        """Tokens per block node (None: block-granular reuse is off)."""
        if not self.config.block_reuse:
            return None
        return self.config.block_size * self.config.block_reuse_blocks

    # ---- failures ----------------------------------------------------------------------------------
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
            req.lease, req.layout, req.prefilled = None, None, 0
        req.retried = True
        req.plan = self.prompt_plan(req.segments, use_cache=False)
        req.reuse = "exact"
        req.computed = req.recomputed = req.chunk_cached = req.guarded = req.guard_tokens = 0
        req.deviation, req.chunk_reuse = 0.0, ()  # the failed attempt's chunk records go with it
        self.stats.retried += 1
        self.scheduler.remove(req.rid)
        self.scheduler.add(req.rid, 0, req.prompt_tokens, chunkable=req.chunked_prefill)

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

    # ---- lifecycle -------------------------------------------------------------------------------
    def prompt_plan(self, segments: Sequence[Segment], use_cache: bool | None = None) -> PromptPlan:
        """How ``segments`` meet the knowledge tree under this engine's settings: the lead the tree
        may serve and the rest always computed (everything computed when the cache is off)."""
        use = self.config.enable_cache if use_cache is None else use_cache
        if not use:
            return PromptPlan((), tuple(t for s in segments for t in s.token_ids))
        return plan_prompt(segments, whole_prompt=self.config.whole_prompt_reuse, block_tokens=self.block_tokens)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is in flight and the step that finished the last one has ended
        (a request's result is set inside its last step, before the step hands the nodes it
        inserted to the disk and remote tiers); False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.in_flight:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        if not self._step_lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
        self._step_lock.release()
        return True

    def live_request_ids(self) -> tuple[int, ...]:
        """Ids of the requests the loop holds now (waiting or running)."""
        return tuple(self._live)

    @property
    def waiting_requests(self) -> int:
        """Requests submitted whose prefill has not finished: queued, waiting for admission, or
        admitted with prompt chunks left to compute (the pool of RAGCache Algorithm 2: they all
        still compete for prefill compute)."""
        return self._waiting + self._queued

    @property
    def max_prefill_bs(self) -> int:
        """Speculation starts only while fewer than this many requests wait for prefill
        (``config.max_prefill_bs``, RAGCache Algorithm 2)."""
        return self.config.max_prefill_bs

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
        if self._arena_commit is not None:
            self._arena_commit.stop()
        if cancel:
            for rid in list(self._live):
                self.cancel(rid)
        self._inbox.put(None)  # wakes the loop
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            self.cache.close_disk()  # queued KV files are written before close returns
