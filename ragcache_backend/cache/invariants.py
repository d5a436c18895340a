"""The cache's invariants, checked in one pass (tests run it after every engine step).

* the tree: parent links intact, the root holds nothing, every node resident somewhere, a
  resident node's parent resident too (no orphans), node counts consistent;
* locks: locked nodes sit on device; the lock table equals the nodes with ``lock_ref > 0``;
* tiers: a node has a priority exactly in the tiers it is in; every eviction candidate of a tier
  is in that tier's heap; each tier's own books (device blocks owned by nodes or requests, never
  both; host bytes counted = bytes held; budgets held); in a shared pool, every used block held by
  exactly one of the two tiers.
"""

from __future__ import annotations

from ragcache_backend.cache.knowledge_tree import KnowledgeTree, Node
from ragcache_backend.cache.stack import TierStack

__all__ = ["check_invariants"]


def check_invariants(tree: KnowledgeTree, stack: TierStack) -> None:
    """Raise AssertionError describing every broken invariant."""
    problems: list[str] = []
    nodes: list[Node] = []
    root = tree.root
    if root.resident or root.lock_ref or root.parent is not None:
        problems.append("root holds KV, a lock or a parent")
    memory = {stack.device.name: stack.device, stack.host.name: stack.host}
    candidates: dict[str, set[Node]] = {name: set() for name in memory}
    for n in tree:
        nodes.append(n)
        p = n.parent
        if p is None or p.children.get(n.key) is not n:  # type: ignore[arg-type]
            problems.append(f"{n!r}: broken parent link")
            continue
        if not n.resident:
            problems.append(f"{n!r}: in the tree but resident nowhere")
        if n.lock_ref < 0 or (n.lock_ref and not n.in_device):
            problems.append(f"{n!r}: bad lock (locked nodes must be on device)")
        if n.resident and not p.is_root and not p.resident:
            problems.append(f"{n!r}: resident but parent {p!r} is not")
        if set(n.priority) != set(n.tiers):
            problems.append(f"{n!r}: priorities for {sorted(n.priority)} but tiers {n.tiers}")
        for name in n.tiers:
            if memory[name].evictor.is_candidate(n):
                candidates[name].add(n)
    for name, tier in memory.items():
        missing = candidates[name] - tier.evictor.candidates()
        if missing:
            problems.append(f"{name} candidates missing from the heap: {missing}")
    problems += stack.device.problems(nodes)
    problems += stack.host.problems(nodes)
    if stack.shared_pool:  # every pool block is the device tier's or one host copy's, never both
        host_blocks = {b for n in nodes if n.host_kv is not None for b in getattr(n.host_kv, "blocks", ())}
        device_blocks = stack.device.held_blocks()
        if host_blocks & device_blocks:
            problems.append(f"pool blocks held by both tiers: {sorted(host_blocks & device_blocks)[:8]}")
        if host_blocks | device_blocks != stack.device.pool.used_blocks():
            problems.append("the pool's used blocks differ from device + host blocks")
    if stack.locks.as_set() != {n for n in nodes if n.lock_ref}:
        problems.append("locked-node set out of sync with lock_ref")
    if len(nodes) != len(tree):
        problems.append(f"tree counts {len(tree)} nodes, iteration finds {len(nodes)}")
    if problems:
        raise AssertionError("; ".join(problems))
