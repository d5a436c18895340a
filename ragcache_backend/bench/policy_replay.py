"""Replacement-policy hit rates on a long trace (RAGCache Table 2's shape), without the model.

Hit rate depends only on which nodes the policy keeps, not on how fast the forward pass runs, so
this replays a trace through the real :class:`~ragcache_backend.cache.tiers.TieredCache` (same
knowledge tree, PGDSF/GDSF/LRU/LFU, swap-out-once, budgets) with a KV mover that copies nothing.
Requests run one at a time through the same cache protocol as the engine: ``admit`` (match,
lock, allocate), ``commit`` (insert, Alg. 1 statistics), ``finish``. PGDSF costs come
from the prefill profile measured on this machine. Deterministic: same trace, same numbers,
whatever the machine load.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragcache_backend.cache.lease import SegmentSpec
from ragcache_backend.cache.tiers import TieredCache
from ragcache_backend.prompts.builder import plan_prompt


@dataclass(slots=True)
class _NoKV:
    num_tokens: int


class _CountingMover:
    def __init__(self, bytes_per_token: int) -> None:
        self.bytes_per_token = bytes_per_token

    def swap_out(self, blocks, num_tokens):
        return _NoKV(num_tokens)

    def kv_tokens(self, host_kv) -> int:
        return host_kv.num_tokens

    def swap_in(self, host_kv, blocks) -> None:
        pass

    def host_nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens

    def free_host(self, host_kv) -> None:
        pass


def replay(prompts, *, policy: str, profile, device_bytes: int, host_bytes: int, bytes_per_token: int,
           block_size: int = 16, max_tokens: int = 4, whole_prompt: bool = True, block_reuse: bool = True) -> dict:
    """Hit rates of one policy over ``prompts`` (lists of segments, in arrival order); with
    ``whole_prompt`` the question tail is cached too, and with ``block_reuse`` text that no
    document marks is cached in block nodes of ``block_size`` tokens, as the engine does by default
    (answers are not replayed: ``max_tokens`` only reserves room)."""
    num_blocks = device_bytes // (bytes_per_token * block_size)
    cache = TieredCache(num_blocks, block_size, host_bytes, _CountingMover(bytes_per_token), policy=policy,
                        profile=profile if policy == "pgdsf" else None)
    total = cached = 0
    for segs in prompts:
        plan = plan_prompt(segs, whole_prompt=whole_prompt, block_tokens=block_size if block_reuse else None)
        if plan.repeat is not None and cache.holds([s.key for s in (*plan.lead, plan.repeat)]):
            plan = plan.with_repeat()
        lease = cache.admit([SegmentSpec(s.key, len(s), token_ids=s.token_ids) for s in plan.lead],
                            len(plan.rest) + max_tokens)
        if lease is None:  # one request at a time: the arena is never held by another
            raise AssertionError("replay: no room with no request running")
        try:
            alpha = lease.cached_tokens
            cache.commit(lease, len(plan.rest))
            if plan.repeat is not None and plan.rest_blocks:  # kept for an exact repeat, as the engine does
                cache.keep_tail(lease, [], alpha, SegmentSpec(plan.repeat.key, len(plan.repeat),
                                                              token_ids=plan.repeat.token_ids))
        finally:
            cache.finish(lease)
        total += sum(len(s) for s in segs)
        cached += alpha
    cache.check_invariants()
    st = cache.stats
    nodes = st.device_hits + st.host_hits + st.misses
    return {"token_hit_rate": cached / max(1, total), "node_hit_rate": (st.device_hits + st.host_hits) / max(1, nodes),
            "device_hits": st.device_hits, "host_hits": st.host_hits, "misses": st.misses,
            "swap_outs": st.swap_outs, "requests": len(prompts)}


def policy_table(prompts, *, profile, device_bytes: int, host_sizes_bytes, bytes_per_token: int,
                 policies=("pgdsf", "gdsf", "lru", "lfu"), **kw) -> dict:
    """``{host_bytes: {policy: replay(...)}}``."""
    return {h: {p: replay(prompts, policy=p, profile=profile, device_bytes=device_bytes, host_bytes=h,
                          bytes_per_token=bytes_per_token, **kw) for p in policies} for h in host_sizes_bytes}
