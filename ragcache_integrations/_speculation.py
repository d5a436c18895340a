"""Speculative pipelining inside an ordinary chain (RAGCache §5.3), framework-independent.

In a LangChain or LlamaIndex chain the retriever finishes before the prompt exists, so the
retriever cannot hand its candidates to the model directly. Two pieces close the gap:

* **prompt frames.** When one of our models runs a chat prompt that contains the documents a
  retriever of ours just returned and the query it searched for, the prompt's shape is learned:
  the chat turns with the documents' and the query's positions, and the model's settings. The next
  retrieval with the same number of documents predicts its prompt by putting its own query and
  candidate documents into that frame.
* **the speculation board.** While a retriever's staged search runs, its candidates are
  speculated on with the predicted prompt (Algorithm 2: terminate the stale one, start a new one
  only while the engine's pool is below ``max_prefill_bs``). A speculative generation whose
  documents are the final ones is posted on the board, its text held back; when the model is then
  called with *exactly* that prompt and sampling (token for token), it takes the posted generation
  instead of starting one. Anything else (another template, a rewritten question, other sampling)
  never matches, and the posted generation is cancelled after ``ttl_s`` seconds; what it prefilled
  stays in the knowledge tree as exact KV of its prefix.

So the answer a chain gets is always the one its own prompt gives; speculation only changes when
the work was done.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from ragcache_backend.engine.pipelining import SpeculationOutcome, SpeculativePipeline
from ragcache_backend.engine.request import RequestHandle
from ragcache_backend.prompts.recognition import ChatTurn, DocumentRecognizer

__all__ = ["PromptFrame", "SpeculationBoard", "speculation_board"]

log = logging.getLogger(__name__)

#: Generation factory of a model adapter: (chat turns) -> a ready Generation (``_runtime.Generation``).
MakeGeneration = Callable[[Sequence[ChatTurn]], object]


@dataclass(slots=True, frozen=True)
class _Slot:
    """A place in a turn's content: ``doc`` is the document's index in retrieval order, or -1 for
    the query."""

    turn: int
    start: int
    end: int
    doc: int


@dataclass(slots=True, frozen=True)
class PromptFrame:
    """The shape of a chat prompt built around retrieved documents and a query.

    Attributes:
        turns: the prompt's chat turns as the model saw them.
        slots: where each document (in retrieval order) and the query sit in the turns.
        num_documents: how many documents the prompt held.
        make: turns -> the model adapter's ready generation (same settings as the learned call).
        engine: where the model's requests run, an engine or a server client (its pool decides
            whether to speculate: ``waiting_requests`` against ``max_prefill_bs``).
    """

    turns: tuple[ChatTurn, ...]
    slots: tuple[_Slot, ...]
    num_documents: int
    make: MakeGeneration
    engine: object

    def turns_for(self, query: str, documents: Sequence[str]) -> list[ChatTurn]:
        """The turns with ``query`` and ``documents`` (texts, retrieval order) in the frame's slots."""
        out = []
        for i, turn in enumerate(self.turns):
            content, done, parts = turn.content, 0, []
            for slot in sorted((s for s in self.slots if s.turn == i), key=lambda s: s.start):
                parts.append(content[done:slot.start])
                parts.append(query if slot.doc < 0 else documents[slot.doc])
                done = slot.end
            parts.append(content[done:])
            out.append(ChatTurn(turn.role, "".join(parts)))
        return out


def learn_frame(turns: Sequence[ChatTurn], recognizer: DocumentRecognizer, retrieved: Sequence[tuple[str, tuple[str, ...]]],
                make: MakeGeneration, engine: object) -> PromptFrame | None:
    """The frame of ``turns`` if they hold, in order, the documents of one recent retrieval and its
    query (each document once, the query at least once outside them); else None.

    ``retrieved``: recent ``(query, document ids)`` pairs of our retrievers, newest last.
    """
    found: list[tuple[int, int, int, str]] = []  # (turn, start, end, doc id)
    for t, turn in enumerate(turns):
        found.extend((t, s.start, s.end, s.doc_id) for s in recognizer.find(turn.content))
    if not found:
        return None
    ids = tuple(f[3] for f in found)
    for query, doc_ids in reversed(retrieved):
        if ids != doc_ids or not query:
            continue
        slots = [_Slot(t, start, end, i) for i, (t, start, end, _) in enumerate(found)]
        for t, turn in enumerate(turns):
            at = turn.content.find(query)
            while at >= 0:
                if not any(s.turn == t and s.start < at + len(query) and at < s.end for s in slots):
                    slots.append(_Slot(t, at, at + len(query), -1))
                at = turn.content.find(query, at + len(query))
        if not any(s.doc < 0 for s in slots):
            return None  # the query was rewritten: the next prompt cannot be predicted
        return PromptFrame(tuple(turns), tuple(slots), len(ids), make, engine)
    return None


@dataclass(slots=True)
class _Posted:
    outcome: SpeculationOutcome
    timer: threading.Timer


class SpeculationBoard:
    """Learned prompt frames and posted speculative generations (one per process, thread-safe).

    Args:
        ttl_s: a posted generation no model call takes within this many seconds is cancelled.
        max_posted: at most this many posted at once (the oldest is cancelled first).
    """

    def __init__(self, *, ttl_s: float = 30.0, max_posted: int = 32) -> None:
        self.ttl_s, self.max_posted = ttl_s, max_posted
        self._lock = threading.Lock()
        self._frames: dict[int, PromptFrame] = {}  # by number of documents
        self._retrieved: collections.deque[tuple[str, tuple[str, ...]]] = collections.deque(maxlen=16)
        self._posted: collections.OrderedDict[Hashable, _Posted] = collections.OrderedDict()
        self.taken = 0  # posted generations a model call took (for tests and reports)

    # ---- frames ------------------------------------------------------------------------------
    def note_retrieval(self, query: str, doc_ids: Sequence[str]) -> None:
        """A retriever of ours answered ``query`` with these documents (retrieval order)."""
        with self._lock:
            self._retrieved.append((query, tuple(doc_ids)))

    def learn(self, turns: Sequence[ChatTurn], recognizer: DocumentRecognizer, make: MakeGeneration,
              engine: object) -> None:
        """Learn the frame of a chat prompt a model of ours is about to run (no-op if none)."""
        with self._lock:  # only retrievals whose query is in the prompt (a cheap test before recognition)
            retrieved = [r for r in self._retrieved if r[0] and any(r[0] in t.content for t in turns)]
        if not retrieved:
            return
        frame = learn_frame(turns, recognizer, retrieved, make, engine)
        if frame is not None:
            with self._lock:
                self._frames[frame.num_documents] = frame

    def frame(self, num_documents: int) -> PromptFrame | None:
        with self._lock:
            return self._frames.get(num_documents)

    def forget(self) -> None:
        """Drop every learned frame and cancel every posted generation."""
        with self._lock:
            self._frames.clear()
            self._retrieved.clear()
            posted, self._posted = list(self._posted.values()), collections.OrderedDict()
        for p in posted:
            p.timer.cancel()
            p.outcome.discard()

    # ---- posted generations ---------------------------------------------------------------------
    def post(self, key: Hashable, outcome: SpeculationOutcome) -> None:
        """Hold a kept speculative generation for the model call whose request key is ``key``."""
        timer = threading.Timer(self.ttl_s, self._expire, args=(key, outcome))
        timer.daemon = True
        with self._lock:
            old = self._posted.pop(key, None)
            self._posted[key] = _Posted(outcome, timer)
            evicted = [self._posted.popitem(last=False)[1] for _ in range(max(0, len(self._posted) - self.max_posted))]
        for p in ([old] if old else []) + evicted:
            p.timer.cancel()
            p.outcome.discard()
        timer.start()

    def take(self, key: Hashable) -> SpeculationOutcome | None:
        """The generation posted for ``key`` (removed from the board), or None."""
        with self._lock:
            posted = self._posted.pop(key, None)
            if posted is not None:
                self.taken += 1
        if posted is None:
            return None
        posted.timer.cancel()
        return posted.outcome

    def _expire(self, key: Hashable, outcome: SpeculationOutcome) -> None:
        with self._lock:
            posted = self._posted.get(key)
            if posted is None or posted.outcome is not outcome:
                return
            del self._posted[key]
        log.info("a speculative generation was not taken within %.0f s; cancelled", self.ttl_s)
        outcome.discard()

    @property
    def posted(self) -> int:
        with self._lock:
            return len(self._posted)


_BOARD = SpeculationBoard()


def speculation_board() -> SpeculationBoard:
    """The process-wide board shared by our retrievers and models."""
    return _BOARD


def speculative_retrieval(query: str, stages, key: Callable[[object], str], text: Callable[[object], str],
                          *, board: SpeculationBoard | None = None) -> list:
    """Run a retriever's staged search (``stages``: candidate lists, the last one final), speculating
    with the learned frame for its size when there is one; returns the final documents.

    Raises RetrievalError / RequestCancelledError as :meth:`SpeculativePipeline.speculate`.
    """
    board = board or _BOARD
    stages = iter(stages)
    first = next(stages, None)
    if first is None:
        return []
    frame = board.frame(len(first))
    if frame is None:  # nothing learned yet: a plain staged search
        final = first
        for final in stages:
            pass
        board.note_retrieval(query, [key(d) for d in final])
        return list(final)
    made: dict[tuple[str, ...], object] = {}

    def submit(docs: Sequence[object], on_text: Callable[[str], None]) -> RequestHandle:
        try:
            generation = frame.make(frame.turns_for(query, [text(d) for d in docs]))
            handle = generation.submit(on_text)
        except Exception as exc:  # a prediction that cannot run (e.g. too long) never fails the retrieval
            log.info("speculation skipped: %r", exc)
            return _failed_handle(exc)
        made[tuple(key(d) for d in docs)] = generation
        return handle

    target = frame.engine
    pipeline = SpeculativePipeline(target, submit, key=key, max_prefill_bs=target.max_prefill_bs)
    outcome = pipeline.speculate(itertools.chain([first], stages))
    ids = [key(d) for d in outcome.documents]
    board.note_retrieval(query, ids)
    if outcome.handle is not None:
        board.post(made[tuple(ids)].request_key(), outcome)
    return list(outcome.documents)


def _failed_handle(exc: BaseException) -> RequestHandle:
    """A handle that has already failed with ``exc`` (the pipeline then generates nothing for it)."""
    handle = RequestHandle(-1, lambda _rid: None)
    handle.future.set_exception(exc)
    return handle
