"""The leak check the serving tests share: no request holds anything once the engine is idle."""

from __future__ import annotations


def node_blocks(cache) -> int:
    """Device blocks owned by tree nodes."""
    return sum(len(n.device_blocks or ()) for n in cache.tree if not n.is_root and n.in_device)


def assert_at_baseline(engine) -> None:
    """Every used block is a tree node's, nothing is locked, no tier is over its budget."""
    cache = engine.cache
    cache.check_invariants()
    assert cache.device_used_blocks == node_blocks(cache), "a request's KV blocks leaked"
    assert cache.request_blocks == 0 and cache.locked_nodes == 0
    assert cache.device_used_blocks <= cache.num_device_blocks
    assert cache.host_used_bytes <= cache.host_budget_bytes
