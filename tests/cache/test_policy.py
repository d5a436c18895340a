from __future__ import annotations

import pytest

from ragcache_backend.errors import UnknownPolicyError
from ragcache_backend.cache.policy import POLICIES, NodeStats, get_policy

STATS = NodeStats(frequency=3, avg_cost=0.002, num_tokens=400, last_access=17)


def test_pgdsf_is_clock_plus_frequency_times_avg_cost() -> None:
    # eq. 1 with eq. 3: 1.5 + 3 * 0.002
    assert get_policy("pgdsf")(STATS, 1.5) == pytest.approx(1.506)


def test_gdsf_cost_proportional_to_size_is_clock_plus_frequency() -> None:
    assert get_policy("gdsf")(STATS, 1.5) == pytest.approx(4.5)
    # size does not matter once cost is proportional to it
    bigger = NodeStats(frequency=3, avg_cost=0.002, num_tokens=4000, last_access=17)
    assert get_policy("gdsf")(bigger, 1.5) == get_policy("gdsf")(STATS, 1.5)


def test_lru_and_lfu_ignore_the_clock() -> None:
    assert get_policy("lru")(STATS, 99.0) == 17.0
    assert get_policy("lfu")(STATS, 99.0) == 3.0


def test_lower_priority_is_the_cheaper_node_under_pgdsf() -> None:
    cheap = NodeStats(frequency=5, avg_cost=0.001, num_tokens=100, last_access=9)
    dear = NodeStats(frequency=2, avg_cost=0.004, num_tokens=100, last_access=1)
    pg = get_policy("pgdsf")
    assert pg(cheap, 0.0) == pytest.approx(0.005)
    assert pg(dear, 0.0) == pytest.approx(0.008)
    assert get_policy("lru")(dear, 0.0) < get_policy("lru")(cheap, 0.0)


def test_registry_names() -> None:
    assert set(POLICIES) == {"pgdsf", "gdsf", "lru", "lfu"}


def test_unknown_policy_lists_valid_names() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        get_policy("fifo")
    msg = str(info.value)
    assert "fifo" in msg
    for name in ("pgdsf", "gdsf", "lru", "lfu"):
        assert name in msg
    assert isinstance(info.value, ValueError)
