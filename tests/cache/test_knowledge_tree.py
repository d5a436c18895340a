from __future__ import annotations

import pytest

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.cache.knowledge_tree import KnowledgeTree, Node, SegmentKey, TierName

S, D1, D2, D3 = (SegmentKey(k) for k in ("sys", "d1", "d2", "d3"))


def _resident(node: Node, blocks: list[int] | None = None) -> Node:
    node.device_blocks = blocks if blocks is not None else [0]
    return node


def _build() -> tuple[KnowledgeTree, dict[str, Node]]:
    """S -> D1 -> D3  and  S -> D2 -> D3 (the same document after a different prefix)."""
    t = KnowledgeTree()
    s = _resident(t.add_child(t.root, S, 10))
    d1 = _resident(t.add_child(s, D1, 20))
    d2 = _resident(t.add_child(s, D2, 30))
    d3a = _resident(t.add_child(d1, D3, 40))
    d3b = _resident(t.add_child(d2, D3, 40))
    return t, dict(s=s, d1=d1, d2=d2, d3a=d3a, d3b=d3b)


def test_tier_enum_is_str() -> None:
    assert TierName.DEVICE == "device" and TierName.HOST == "host"
    assert TierName("host") is TierName.HOST


def test_prefix_match_by_key() -> None:
    t, n = _build()
    assert t.match_prefix([S, D1, D3]) == [n["s"], n["d1"], n["d3a"]]
    assert t.match_prefix([S, D1]) == [n["s"], n["d1"]]
    assert t.match_prefix([S, D1, D3, SegmentKey("q")]) == [n["s"], n["d1"], n["d3a"]]
    assert t.match_prefix([D1]) == []  # D1 is not a first segment
    assert t.match_prefix([]) == []


def test_document_after_a_different_prefix_is_a_different_node() -> None:
    t, n = _build()
    via_d2 = t.match_prefix([S, D2, D3])
    assert via_d2[-1] is n["d3b"] and via_d2[-1] is not n["d3a"]
    # D3 after [S, D3]? not cached: the D3 nodes under D1/D2 are not reused
    assert t.match_prefix([S, D3]) == [n["s"]]


def test_walk_stops_at_first_non_resident_node() -> None:
    t, n = _build()
    n["d1"].device_blocks = None  # d1 evicted everywhere, d3a still (illegally) resident below
    assert t.match_prefix([S, D1, D3]) == [n["s"]]
    n["d1"].host_kv = object()  # host-only counts as resident
    assert t.match_prefix([S, D1, D3]) == [n["s"], n["d1"], n["d3a"]]
    assert n["d1"].resident and n["d1"].in_host and not n["d1"].in_device
    assert n["d1"].tiers == (TierName.HOST,)


class CountingDict(dict):
    lookups = 0

    def get(self, key, default=None):  # type: ignore[override]
        CountingDict.lookups += 1
        return super().get(key, default)


def test_walk_is_o_depth() -> None:
    t = KnowledgeTree()
    s = _resident(t.add_child(t.root, S, 1))
    for i in range(1000):  # a wide level must not be scanned
        _resident(t.add_child(s, SegmentKey(f"doc{i}"), 1))
    t.root.children = CountingDict(t.root.children)
    s.children = CountingDict(s.children)
    CountingDict.lookups = 0
    got = t.match_prefix([S, SegmentKey("doc777"), SegmentKey("x"), SegmentKey("y")])
    assert [x.key for x in got] == [S, "doc777"]
    assert CountingDict.lookups == 2  # one lookup per level (the third, in doc777, is uncounted)


def test_remove_returns_subtree_and_iteration() -> None:
    t, n = _build()
    assert len(t) == 5 and set(t) == set(n.values())
    order = list(t)
    for node in order:  # parents before children
        if node.parent is not t.root:
            assert order.index(node.parent) < order.index(node)  # type: ignore[arg-type]
    removed = t.remove(n["d1"])
    assert removed[0] is n["d1"] and set(removed) == {n["d1"], n["d3a"]}
    assert len(t) == 3 and D1 not in n["s"].children
    assert not t.contains(n["d1"]) and not t.contains(n["d3a"]) and t.contains(n["d3b"])
    assert t.match_prefix([S, D1, D3]) == [n["s"]]
    with pytest.raises(InvalidRequestError):
        t.remove(n["d1"])
    with pytest.raises(InvalidRequestError):
        t.remove(t.root)
    with pytest.raises(InvalidRequestError):
        t.add_child(n["d1"], D2, 5)  # detached parent


def test_add_child_rejects_duplicates() -> None:
    t, n = _build()
    with pytest.raises(InvalidRequestError):
        t.add_child(n["s"], D1, 5)


def test_node_stats_and_avg_cost() -> None:
    t = KnowledgeTree()
    node = t.add_child(t.root, S, 64)
    assert node.avg_cost == 0.0 and not node.resident
    node.frequency, node.total_cost, node.num_computed, node.last_access = 3, 0.006, 2, 7
    st = node.stats()
    assert (st.frequency, st.avg_cost, st.num_tokens, st.last_access) == (3, 0.003, 64, 7)
    assert KnowledgeTree.path_to(node) == [node]
