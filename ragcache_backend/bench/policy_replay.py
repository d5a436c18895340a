"""Replacement-policy hit rates on a long trace (RAGCache Table 2's shape), without the model.

Hit rate depends only on which nodes the policy keeps, not on how fast the forward pass runs, so
this replays a trace through the real :class:`~ragcache_backend.cache.tiers.TieredCache` (same
knowledge tree, PGDSF/GDSF/LRU/LFU, swap-out-once, budgets) with a KV mover that copies nothing.
Requests run one at a time as the engine runs them: match + acquire, allocate the missing
documents and the tail, insert, ``record_request(alpha, beta)``, release, free. PGDSF costs come
from the prefill profile measured on this machine. Deterministic: same trace, same numbers,
whatever the machine load.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragcache_backend.cache.blocks import blocks_for
from ragcache_backend.prompts.builder import cacheable_lead
from ragcache_backend.cache.tiers import TieredCache


@dataclass(slots=True)
class _NoKV:
    nbytes: int


class _CountingMover:
    def __init__(self, bytes_per_token: int) -> None:
        self.bytes_per_token = bytes_per_token

    def swap_out(self, blocks, num_tokens):
        return _NoKV(self.host_nbytes(num_tokens))

    def swap_in(self, host_kv, blocks) -> None:
        pass

    def host_nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens

    def free_host(self, host_kv) -> None:
        pass


def replay(prompts, *, policy: str, profile, device_bytes: int, host_bytes: int, bytes_per_token: int,
           block_size: int = 16, max_tokens: int = 4) -> dict:
    """Hit rates of one policy over ``prompts`` (lists of segments, in arrival order)."""
    num_blocks = device_bytes // (bytes_per_token * block_size)
    cache = TieredCache(num_blocks, block_size, host_bytes, _CountingMover(bytes_per_token), policy=policy,
                        profile=profile if policy == "pgdsf" else None)
    total = cached = 0
    for segs in prompts:
        lead = cacheable_lead(segs)
        acq = cache.acquire(cache.match([s.key for s in lead]))
        path = list(acq.nodes)
        pending = [(s, cache.allocate(blocks_for(len(s), block_size))) for s in lead[len(path):]]
        tail = sum(len(s) for s in segs[len(lead):])
        tail_blocks = cache.allocate(blocks_for(tail + max_tokens, block_size))
        alpha = sum(n.num_tokens for n in path)
        beta = sum(len(s) for s, _ in pending) + tail
        parent = path[-1] if path else None
        for s, blocks in pending:
            parent = cache.insert(parent, s.key, len(s), blocks)
            path.append(parent)
        cache.record_request(path, [False] * len(acq.nodes) + [True] * len(pending), alpha, beta)
        cache.release(path)
        cache.free(tail_blocks)
        total += alpha + beta
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
