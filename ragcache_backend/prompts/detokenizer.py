"""Incremental detokenisation with stop strings.

Token ids arrive one at a time; the text they decode to may end in the middle of a UTF-8
character or in the middle of a stop string. :class:`IncrementalText` only releases text that is
final: never half a character, never the start of a stop string that may still complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["IncrementalText", "held_back"]


def held_back(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of a stop string (it may
    still become that stop string, so it is not released yet): the largest ``k < len(s)`` with
    ``text.endswith(s[:k])`` over ``stops``, 0 if none. Only the positions of the text's last
    ``len(s) - 1`` characters that hold the stop string's first character are tried, so the work
    is bounded by the text's length (squared at worst, for a text of that one character), never by
    the stop string's length squared (this runs on the engine thread, every token)."""
    hold = 0
    for s in stops:
        m = min(len(s) - 1, len(text))
        if m < 1:
            continue
        j = text.find(s[0], len(text) - m)
        while j != -1 and len(text) - j > hold:
            if s.startswith(text[j:]):  # the leftmost such position: the longest end for this stop
                hold = len(text) - j
                break
            j = text.find(s[0], j + 1)
    return hold


@dataclass(slots=True)
class IncrementalText:
    """Turns generated token ids into text deltas.

    Each token decodes only a window of the last few ids (as vLLM's incremental detokenizer): the
    ids from the last point where the text was whole (``read_offset``) on, together with the ids
    before it back to the previous such point (``prefix_offset``), whose text is subtracted. Both
    points end complete characters, so the window's text is the whole text's end: the result is the
    full decode's (a property test checks it against decoding every id each token), at a cost per
    token that does not grow with the answer (decoding every id each token made a request's
    detokenisation quadratic in its length, on the engine thread). Stop strings are searched for
    only where a new occurrence can be: in the new text and the ``len(stop) - 1`` characters before it.

    Attributes:
        tokenizer: a transformers tokenizer (``decode`` with ``skip_special_tokens``).
        stop: stop strings; the first occurrence ends the text (excluded from it).
        ids: the token ids pushed so far.
        text: the final text so far (whole characters; a stop string and what follows it cut off).
        emitted: how much of ``text`` was released, in characters (the rest may start a stop string).
        stopped: a stop string occurred.
        prefix_offset, read_offset: the window's start and the end of the ids already in ``text``
            (both at whole characters).
    """

    tokenizer: object
    stop: Sequence[str] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    stopped: bool = False
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (possibly empty)."""
        self.ids.append(token_id)
        if self.stopped:
            return ""
        pending = self._pending()
        if self._cut(pending):
            return self._release(0)
        if pending.endswith("\ufffd"):  # incomplete multi-byte character: wait for its other bytes
            return ""
        self.text += pending
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(held_back(self.text, self.stop))

    def flush(self) -> str:
        """At the end of generation: release whatever is held back (no stop string completed)."""
        if self.stopped:
            return ""
        pending = self._pending()
        if not self._cut(pending):
            self.text += pending
            self.prefix_offset = self.read_offset = len(self.ids)
        return self._release(0)

    @property
    def answer(self) -> str:
        """The text released so far."""
        return self.text[: self.emitted]

    def _pending(self) -> str:
        """The text of the ids past ``read_offset`` (it may end in half a character)."""
        decode = self.tokenizer.decode
        window = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        return window[len(decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)):]

    def _cut(self, pending: str) -> bool:
        """Whether a stop string occurs in ``text + pending``; if so, keep the text before its first
        occurrence. Earlier text holds none (it was checked), so the search starts where an
        occurrence could end in ``pending``."""
        if not self.stop or not pending:
            return False
        longest = max(len(s) for s in self.stop)
        start = max(0, len(self.text) - longest + 1)
        tail = self.text[start:] + pending
        cut = min((i for i in (tail.find(s) for s in self.stop) if i >= 0), default=None)
        if cut is None:
            return False
        self.text = self.text[:start] + tail[:cut]
        self.stopped = True
        return True

    def _release(self, hold: int) -> str:
        """Release ``text`` but its last ``hold`` characters; return what was not released before."""
        end = len(self.text) - hold
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
