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

    Attributes:
        tokenizer: a transformers tokenizer (``decode`` with ``skip_special_tokens``).
        stop: stop strings; the first occurrence ends the text (excluded from it).
    """

    tokenizer: object
    stop: Sequence[str] = ()
    ids: list[int] = field(default_factory=list)
    emitted: str = ""
    stopped: bool = False

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (possibly empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=None)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if text.endswith("\ufffd"):  # incomplete multi-byte character
            return ""
        return self._emit(text[: len(text) - held_back(text, self.stop)])

    def flush(self) -> str:
        """At the end of generation: release whatever is held back (no stop string completed)."""
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, final: str) -> str:
        if len(final) <= len(self.emitted):
            return ""
        delta = final[len(self.emitted) :]
        self.emitted = final
        return delta
