"""Incremental detokenisation with stop strings.

Token ids arrive one at a time; the text they decode to may end in the middle of a UTF-8
character or in the middle of a stop string. :class:`IncrementalText` only releases text that is
final: never half a character, never the start of a stop string that may still complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._emit(text[: len(text) - hold])

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
