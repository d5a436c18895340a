"""The contract every tier keeps (device, host, disk; a new tier joins the parametrization).

Each tier is driven alone, through the :class:`~ragcache_backend.cache.tier.Tier` protocol only,
over a knowledge tree and a simulated arena of tiny tensors (no model): budgets held, victims in the policy's
order, no orphans (a node is never stored without its parent's KV reachable, and a parent never
leaves before its child), corrupt or foreign data never served, locked data never evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ragcache_backend.cache.device import DeviceTier
from ragcache_backend.cache.disk_tier import DiskTier
from ragcache_backend.cache.host import HostTier
from ragcache_backend.cache.knowledge_tree import KnowledgeTree, Node, SegmentKey
from ragcache_backend.cache.policy import get_policy
from ragcache_backend.cache.tier import NodeLocks, Tier
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.cache.sim_arena import SimArena, disk_store

TOKENS = 4  # every node here is one block of 4 tokens
CAPACITY = 3  # nodes each tier can hold


@dataclass
class Harness:
    """One tier under test, the tree its nodes belong to, and what the test needs around it."""

    kind: str
    tier: Tier
    tree: KnowledgeTree
    arena: SimArena
    locks: NodeLocks | None
    demoted: list[Node] = field(default_factory=list)
    _next_token: int = 1

    def node(self, parent: Node | None, name: str, *, frequency: int = 1, cost: float = 0.0) -> Node:
        """A new node of ``TOKENS`` fresh tokens, with PGDSF statistics (priority = frequency * cost)."""
        n = self.tree.add_child(parent or self.tree.root, SegmentKey(name), TOKENS)
        n.frequency, n.total_cost, n.num_computed = frequency, cost * frequency, frequency
        return n

    def copy_of(self, n: Node, num_tokens: int = TOKENS):
        """A host copy holding fresh tokens' KV (``num_tokens`` of them)."""
        tokens = list(range(self._next_token, self._next_token + num_tokens))
        self._next_token += num_tokens
        blocks = [self.arena.num_blocks - 1]  # a scratch block no tier hands out
        self.arena.write(blocks, tokens)
        return self.arena.swap_out(blocks, num_tokens), tokens

    def put(self, n: Node) -> list[int]:
        """Make room (memory tiers), store a copy of ``n``, let an asynchronous tier settle; the tokens."""
        kv, tokens = self.copy_of(n)
        assert self.tier.make_room(self.tier_bytes(), self.demote)
        assert self.tier.put(n, kv)
        self.settle()
        return tokens

    def tier_bytes(self) -> int:
        return self.arena.host_nbytes(TOKENS)

    def demote(self, n: Node) -> None:
        """The stack's role for a lone tier: a victim just leaves this tier."""
        self.demoted.append(n)
        self.tier.drop(n)

    def settle(self) -> None:
        if isinstance(self.tier, DiskTier):
            assert self.tier.store.flush(30)


@pytest.fixture(params=["device", "host", "disk"])
def h(request, tmp_path) -> Harness:
    policy = get_policy("pgdsf")
    tree = KnowledgeTree()
    kind = request.param
    if kind == "device":
        arena = SimArena(CAPACITY + 8, TOKENS)
        locks = NodeLocks()
        device = DeviceTier(CAPACITY, TOKENS, arena, policy, locks)
        locks.on_unlock(device.evictor.offer)
        return Harness(kind, device, tree, arena, locks)
    arena = SimArena(8, TOKENS)
    if kind == "host":
        locks = NodeLocks()
        host = HostTier(CAPACITY * arena.host_nbytes(TOKENS), arena, policy, locks)
        locks.on_unlock(host.evictor.offer)
        return Harness(kind, host, tree, arena, locks)
    probe = disk_store(tmp_path / "probe", 1 << 20)  # one file's size, to budget for CAPACITY of them
    probe_tier = DiskTier(probe, arena)
    probe_node = tree.add_child(tree.root, SegmentKey("probe"), TOKENS)
    probe_tier.put(probe_node, arena.host_from_tensors(*arena.host_tensors(arena.swap_out([0], TOKENS))))
    probe.close()
    tree.remove(probe_node)
    budget = CAPACITY * probe.used_bytes + probe.used_bytes // 2
    return Harness(kind, DiskTier(disk_store(tmp_path / "kv", budget), arena), tree, arena, None)


def test_what_is_put_comes_back_and_is_accounted(h: Harness):
    a = h.node(None, "a")
    assert not h.tier.contains(a) and h.tier.get(a) is None and h.tier.used_bytes == 0
    tokens = h.put(a)
    assert h.tier.contains(a)
    assert SimArena.tokens_of(h.tier.get(a)) == tokens  # device: a new copy out of the arena
    assert 0 < h.tier.used_bytes <= h.tier.budget_bytes
    h.tier.drop(a)
    assert not h.tier.contains(a) and h.tier.get(a) is None and h.tier.used_bytes == 0


def test_budget_held_and_victims_leave_in_the_policys_order(h: Harness):
    prios = {"a": 3.0, "b": 1.0, "c": 2.0}
    nodes = {name: h.node(None, name, cost=p) for name, p in prios.items()}
    for n in nodes.values():
        h.put(n)
        assert h.tier.used_bytes <= h.tier.budget_bytes
    assert h.tier.eviction_order() == [nodes[k].path_key for k in ("b", "c", "a")]
    for name, cost in (("d", 5.0), ("e", 6.0)):  # each needs one victim: the lowest priority present
        h.put(h.node(None, name, cost=cost))
        assert h.tier.used_bytes <= h.tier.budget_bytes
    kept = {n.key for n in list(nodes.values()) if h.tier.contains(n)}
    assert kept == {"a"}  # b (1.0) went first, then c (2.0)
    if h.demoted:  # memory tiers hand victims to the stack, in order
        assert [n.key for n in h.demoted] == ["b", "c"]


def test_a_node_is_never_stored_without_its_parent(h: Harness):
    parent = h.node(None, "p")
    child = h.node(parent, "c")
    kv, _ = h.copy_of(child)
    try:
        stored = h.tier.put(child, kv)  # memory tiers refuse with an error, the disk declines
    except InvalidRequestError:
        stored = False
    h.settle()
    assert not stored and not h.tier.contains(child)


def test_a_parent_never_leaves_before_its_child(h: Harness):
    a = h.node(None, "a", cost=0.1)  # the cheapest node, but its child's KV depends on it
    b = h.node(a, "b", cost=1.0)
    h.put(a)
    h.put(b)
    h.put(h.node(None, "x", cost=5.0))
    assert h.tier.eviction_order()[:2] == [b.path_key, h.tree.root.children["x"].path_key]
    assert a.path_key not in h.tier.eviction_order()
    h.put(h.node(None, "y", cost=6.0))  # one victim: b (a is no candidate while b is stored)
    assert h.tier.contains(a) and not h.tier.contains(b)
    h.put(h.node(None, "z", cost=7.0))  # now a, the cheapest, may go
    assert not h.tier.contains(a)
    if h.kind != "disk":
        assert [n.key for n in h.demoted] == ["b", "a"]


def test_foreign_kv_is_refused(h: Harness):
    a = h.node(None, "a")
    kv, _ = h.copy_of(a, num_tokens=TOKENS - 1)  # another length: not this node's KV
    with pytest.raises(InvalidRequestError):
        h.tier.put(a, kv)
    h.settle()
    assert not h.tier.contains(a) and h.tier.used_bytes == 0


def test_locked_data_is_never_evicted(h: Harness):
    if h.locks is None:
        pytest.skip("the disk tier holds no locked data: running requests lock memory copies")
    nodes = [h.node(None, name) for name in "abc"]
    for n in nodes:
        h.put(n)
        h.locks.lock(n)
    assert h.tier.eviction_order() == []
    assert not h.tier.make_room(h.tier_bytes(), h.demote)  # nothing evicted to try
    assert all(h.tier.contains(n) for n in nodes) and h.demoted == []
    h.locks.unlock(nodes[1])
    assert h.tier.make_room(h.tier_bytes(), h.demote) and h.demoted == [nodes[1]]


def test_a_damaged_copy_is_never_served(h: Harness):
    if not isinstance(h.tier, DiskTier):
        pytest.skip("memory copies carry no checksum; foreign copies are refused at put")
    a = h.node(None, "a")
    h.put(a)
    path = h.tier.store.directory / f"{a.path_key}.kv.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert h.tier.get(a) is None
    assert h.tier.store.stats.corrupt == 1 and not path.exists() and not h.tier.contains(a)
