"""Stop strings in incremental detokenisation: what is held back while a stop string may still
complete, for stop strings of any length."""

from __future__ import annotations

import random
import time

from ragcache_backend.prompts.detokenizer import held_back


def naive(text: str, stops) -> int:  # the definition
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_held_back_equals_its_definition_on_random_texts():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 4))]
        assert held_back(text, stops) == naive(text, stops), (text, stops)


def test_a_very_long_stop_string_costs_about_the_text_not_its_own_length_squared():
    stop = "ab" * 100_000  # 200,000 characters: the naive hold check sliced ~2e10 characters a token
    text = "x" * 2_000 + "abab"
    start = time.perf_counter()
    for _ in range(100):  # a hundred tokens' worth
        assert held_back(text, [stop] * 4) == 4
    assert time.perf_counter() - start < 2.0  # (naive: minutes)


class Reference:
    """The definition: every token, decode every id, cut at the first stop string, release all but
    an incomplete character and what may still become a stop string (the code before the window)."""

    def __init__(self, tokenizer, stop) -> None:
        self.tokenizer, self.stop, self.ids, self.emitted, self.stopped = tokenizer, stop, [], "", False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=None)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if text.endswith("\ufffd"):
            return ""
        return self._emit(text[: len(text) - naive(text, self.stop)])

    def flush(self) -> str:
        return "" if self.stopped else self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, final: str) -> str:
        delta = final[len(self.emitted):] if len(final) > len(self.emitted) else ""
        self.emitted = max(final, self.emitted, key=len)
        return delta


def _streams(tokenizer, ids, stop, ours_tokenizer=None):
    from ragcache_backend.prompts.detokenizer import IncrementalText

    ours, ref = IncrementalText(ours_tokenizer or tokenizer, stop), Reference(tokenizer, stop)
    a, b = [], []
    for token in ids:
        a.append(ours.push(token))
        b.append(ref.push(token))
        assert ours.stopped == ref.stopped
        if ref.stopped:
            break
    a.append(ours.flush())
    b.append(ref.flush())
    return a, b, ours


def test_the_windowed_detokenizer_gives_the_full_decodes_deltas(real_tokenizer):
    """Random answers of text pieces with multi-byte characters (split across tokens), special
    tokens and stop strings: every delta equals the definition's (a full decode every token)."""
    rng = random.Random(1)
    pieces = ["the", " quick", " fox", ",", " ", "\n", "é", "🐉", "日本語", "À", "ok", " <|im_end|>", "ab", "a", "b",
              "  ", "\u00a0", "x\u0301", "💡 idea"]
    vocab = [t for p in pieces for t in real_tokenizer.encode(p, add_special_tokens=False)]
    specials = [real_tokenizer.eos_token_id]
    for case in range(400):
        ids = [rng.choice(vocab + specials) if rng.random() < 0.9 else rng.randrange(len(real_tokenizer) - 1)
               for _ in range(rng.randint(0, 40))]
        stop = [rng.choice(["ab", "fox", "🐉", "\n\n", "日本", "b a", "quick fox,"]) for _ in range(rng.randint(0, 3))]
        ours, ref, _ = _streams(real_tokenizer, ids, stop)
        assert ours == ref, (case, ids, stop)


def test_the_windowed_detokenizer_decodes_a_bounded_window_per_token(real_tokenizer):
    """A 2,000-token answer: each token's decode covers a few ids, not the whole answer."""

    class Counting:
        def __init__(self, tokenizer) -> None:
            self.tokenizer, self.longest = tokenizer, 0

        def decode(self, ids, **kw):
            self.longest = max(self.longest, len(ids))
            return self.tokenizer.decode(ids, **kw)

    ids = real_tokenizer.encode("Lists grow with append; tuples 🐉 do not. " * 200, add_special_tokens=False)[:2000]
    counting = Counting(real_tokenizer)
    ours, ref, text = _streams(real_tokenizer, ids, ["never appears"], counting)
    assert ours == ref and "".join(ours) == real_tokenizer.decode(ids) == text.answer and len(ids) == 2000
    assert counting.longest <= 8  # the definition decodes all 2,000 ids at the last token
