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
