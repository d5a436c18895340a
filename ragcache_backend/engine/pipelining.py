"""Dynamic speculative pipelining (RAGCache §5.3, Algorithm 2): prefill that starts before the
vector search ends.

A pipelined request is a question plus a *stream of candidate top-k lists*, one per stage of a
staged vector search (:meth:`~ragcache_backend.retrieval.docstore.DocumentStore.search_stages`),
the last list being the search's result. :class:`SpeculativePipeline` consumes the stream on the
caller's thread while the engine's step loop runs:

* after each stage whose candidates differ from the previous stage's, the stale speculative
  generation (if any) is terminated after its current step (its blocks are freed), and a new
  speculative generation for the new candidates is started only while fewer than
  ``max_prefill_bs`` requests wait for prefill (:func:`~ragcache_backend.engine.scheduler.decide_speculation`);
* when the search ends, the speculative generation is kept if its documents are the final ones;
  otherwise it is terminated and the answer is generated for the final documents.

A speculative generation's text is held back (:class:`OutputGate`) until it is kept, so no caller
ever sees output produced for a document list other than the final one, and the answer is exactly
the one the final documents give without speculation (same prompt, same sampling). KV that a
terminated speculative prefill committed is exact KV of its own prompt prefix and stays in the
knowledge tree like any other request's.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar

from ragcache_backend.engine.request import GenerationResult, RequestHandle
from ragcache_backend.engine.scheduler import decide_speculation
from ragcache_backend.errors import RequestCancelledError, RetrievalError

__all__ = ["OutputGate", "SpeculativePipeline", "SpeculativeTarget"]

D = TypeVar("D")


class SpeculativeTarget(Protocol):
    """What the pipeline needs from an engine (:class:`~ragcache_backend.engine.engine.RAGCacheEngine`)."""

    @property
    def waiting_requests(self) -> int: ...


class OutputGate:
    """Holds a generation's text deltas until :meth:`open`; then passes them through.

    ``deliver`` is called on the engine's thread, ``open`` on the caller's; a lock orders them, so
    the held text reaches the sink first and in order.
    """

    __slots__ = ("_held", "_lock", "_sink")

    def __init__(self) -> None:
        self._held: list[str] = []
        self._lock = threading.Lock()
        self._sink: Callable[[str], None] | None = None

    def deliver(self, text: str) -> None:
        with self._lock:
            if self._sink is None:
                self._held.append(text)
            else:
                self._sink(text)

    def open(self, sink: Callable[[str], None]) -> None:
        """Send the held text to ``sink``, then every later delta."""
        with self._lock:
            for text in self._held:
                sink(text)
            self._held.clear()
            self._sink = sink


@dataclass(slots=True)
class _Generation:
    """One generation the pipeline started: its documents' ids, handle and gate."""

    ids: tuple[Hashable, ...]
    handle: RequestHandle
    gate: OutputGate
    started_s: float


@dataclass(slots=True)
class SpeculativePipeline(Generic[D]):
    """Algorithm 2 for one request: consume candidate top-k lists, speculate, keep or regenerate.

    Args:
        engine: gives the pool size (``waiting_requests``).
        submit: starts a generation for a document list: ``submit(documents, on_text)`` returns
            its handle (the engine's ``submit``/``submit_segments`` with the prompt built from
            those documents); it must raise at once for bad input.
        key: a document's identity for comparing stages (its id).
        max_prefill_bs: a speculative generation starts only while fewer requests wait for
            prefill (0: never speculate; the pipeline then only measures the search).
        deadline_s: ``time.perf_counter()`` value after which the search counts as timed out.
        cancel: set by the caller to abandon the request (checked between stages).

    One pipeline runs one request; :meth:`run` or :meth:`stream` may be called once.
    """

    engine: SpeculativeTarget
    submit: Callable[[Sequence[D], Callable[[str], None]], RequestHandle]
    key: Callable[[D], Hashable]
    max_prefill_bs: int = 1
    deadline_s: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    _current: _Generation | None = None
    _terminated: list[_Generation] = field(default_factory=list)
    _started: int = 0
    _t0: float = 0.0
    _search_end: float = 0.0

    # ---- the search, stage by stage ----------------------------------------------------------
    def _search(self, candidates: Iterable[Sequence[D]]) -> Sequence[D]:
        """Run the staged search to its end, speculating; returns the final documents."""
        self._t0 = time.perf_counter()
        final: Sequence[D] = ()
        previous: tuple[Hashable, ...] | None = None
        stages = iter(candidates)
        try:
            while True:
                self._check()
                try:
                    docs = next(stages)
                except StopIteration:
                    break
                except (RequestCancelledError, RetrievalError):
                    raise
                except Exception as exc:
                    raise RetrievalError(f"the vector search failed: {exc!r}") from exc
                final = tuple(docs)
                ids = tuple(self.key(d) for d in final)
                current = self._current
                waiting = self.engine.waiting_requests
                if current is not None and current.handle.metrics.admitted == 0.0:
                    waiting -= 1  # the stale request itself is not load
                decision = decide_speculation(changed=ids != previous, speculating=current is not None,
                                              waiting=max(0, waiting), max_prefill_bs=self.max_prefill_bs)
                previous = ids
                if decision.terminate:
                    self._terminate()
                if decision.start:
                    self._current = self._start(final, ids)
            self._check()
        finally:
            close = getattr(stages, "close", None)
            if close is not None:
                close()  # an abandoned staged search stops at once
        self._search_end = time.perf_counter()
        return final

    def _check(self) -> None:
        if self.cancel.is_set():
            raise RequestCancelledError("the request was cancelled during its vector search")
        if self.deadline_s is not None and time.perf_counter() > self.deadline_s:
            raise RetrievalError("the vector search ran past its timeout")

    def _start(self, docs: Sequence[D], ids: tuple[Hashable, ...]) -> _Generation:
        gate = OutputGate()
        handle = self.submit(docs, gate.deliver)
        self._started += 1
        return _Generation(ids, handle, gate, time.perf_counter())

    def _terminate(self) -> None:
        if self._current is not None:
            self._current.handle.cancel()
            self._terminated.append(self._current)
            self._current = None

    def _decide_final(self, docs: Sequence[D]) -> tuple[_Generation, bool]:
        """The generation whose answer the caller gets, and whether it is the speculative one."""
        ids = tuple(self.key(d) for d in docs)
        current = self._current
        if current is not None and current.ids == ids and not _failed(current.handle):
            return current, True
        self._terminate()
        gate = OutputGate()
        handle = self.submit(docs, gate.deliver)
        self._current = generation = _Generation(ids, handle, gate, time.perf_counter())
        return generation, False

    # ---- what the caller gets ----------------------------------------------------------------------
    def run(self, candidates: Iterable[Sequence[D]], on_text: Callable[[str], None] | None = None) -> GenerationResult:
        """Search, speculate, and return the answer for the final documents (blocking).

        ``on_text`` gets the answer's text deltas, only once its documents are final.

        Raises:
            RetrievalError: the search failed or timed out (every generation it started is freed).
            RequestCancelledError: ``cancel`` was set.
            The generation's own error (e.g. ContextWindowError from ``submit``).
        """
        try:
            generation, kept = self._decide_final(self._search(candidates))
            opened = time.perf_counter()
            generation.gate.open(on_text or (lambda _t: None))
            result = self._wait(generation)
        except BaseException:
            self._abandon()
            raise
        return self._report(result, generation, kept, opened)

    def stream(self, candidates: Iterable[Sequence[D]]) -> Iterator[str | GenerationResult]:
        """Like :meth:`run`, yielding text deltas as they come and finally the result.

        Closing the iterator early cancels the request and frees every generation it started.
        """
        import queue

        out: queue.SimpleQueue = queue.SimpleQueue()
        try:
            generation, kept = self._decide_final(self._search(candidates))
            opened = time.perf_counter()
            generation.gate.open(out.put)
            generation.handle.future.add_done_callback(lambda _f: out.put(None))
            while (item := out.get()) is not None:  # the engine emits all text before the result
                yield item
            result = self._wait(generation)
        except BaseException:
            self._abandon()
            raise
        yield self._report(result, generation, kept, opened)

    def _wait(self, generation: _Generation) -> GenerationResult:
        while True:
            try:
                return generation.handle.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if self.cancel.is_set():
                    raise RequestCancelledError("the request was cancelled") from None

    def _abandon(self) -> None:
        """Cancel everything this request started and wait until the engine freed it."""
        self._terminate()
        self._settle()

    def _settle(self) -> None:
        concurrent.futures.wait([g.handle.future for g in self._terminated])

    def _report(self, result: GenerationResult, generation: _Generation, kept: bool, opened: float) -> GenerationResult:
        self._settle()
        m = generation.handle.metrics
        search_s = self._search_end - self._t0
        overlap_from = min(m.admitted or self._search_end, self._search_end) if kept else self._search_end
        wasted = sum(g.handle.metrics.computed_tokens + g.handle.metrics.generated_tokens for g in self._terminated)
        return replace(
            result,
            ttft_s=max(m.first_token, opened) - self._t0,
            total_s=max(m.finished, opened) - self._t0,
            search_s=search_s,
            unoverlapped_search_s=max(0.0, overlap_from - self._t0),
            speculative_requests=self._started,
            wasted_tokens=wasted,
            speculation_kept=kept,
        )


def _failed(handle: RequestHandle) -> bool:
    future = handle.future
    return future.done() and (future.cancelled() or future.exception() is not None)
