"""Drive ragcache's cache core with token ids only: no model, no runner, no engine.

This is the seam another engine (a vLLM KV connector, say) uses. Prompts are cut into blocks of
8 tokens; each block is a knowledge-tree node keyed by its tokens' hash, chained under the blocks
before it, so two prompts share exactly their common leading blocks. A simulated arena of tiny
tensors stands in for the model's KV arena: a "prefill" writes each token's id as its KV, so we
can check that what comes back from device, host or disk is exactly the right tokens' KV.

    python examples/cache_core.py
"""

from __future__ import annotations

import hashlib
import tempfile

from ragcache_backend.cache.knowledge_tree import SegmentKey
from ragcache_backend.cache.lease import SegmentSpec
from ragcache_backend.cache.sim_arena import SimArena, disk_store
from ragcache_backend.cache.tiers import TieredCache

BLOCK = 8  # tokens per node (and per arena block)


def block_specs(tokens: list[int]) -> list[SegmentSpec]:
    """The prompt's whole blocks before its last token (the last token is always computed)."""
    n = (len(tokens) - 1) // BLOCK * BLOCK
    return [SegmentSpec(SegmentKey(hashlib.sha256(str(tokens[i:i + BLOCK]).encode()).hexdigest()[:16]), BLOCK)
            for i in range(0, n, BLOCK)]


def serve(cache: TieredCache, arena: SimArena, tokens: list[int], max_tokens: int = 4) -> dict:
    """One request through the cache protocol: admit, "prefill" what is not cached, commit, finish."""
    specs = block_specs(tokens)
    lead = len(specs) * BLOCK
    lease = cache.admit(specs, tail_tokens=len(tokens) - lead + max_tokens)
    assert lease is not None, "no room now (only when other requests hold the arena)"
    hits = {"cached_tokens": lease.cached_tokens, "device": lease.device_hits, "host": lease.host_hits,
            "disk": lease.disk_hits}
    try:
        pos = 0
        for node in lease.prefix:  # reused: its KV must be exactly these tokens'
            assert arena.read(node.device_blocks, node.num_tokens) == tokens[pos:pos + node.num_tokens]
            pos += node.num_tokens
        for piece in lease.pieces:  # computed by "the model"
            arena.write(piece.blocks, tokens[piece.start:piece.start + piece.spec.num_tokens])
        arena.write(lease.tail_blocks, tokens[lead:])
        cache.commit(lease, rest_tokens=len(tokens) - lead)
    finally:
        cache.finish(lease)
    cache.check_invariants()
    return hits


def main() -> None:
    system = list(range(1000, 1032))  # a 32-token shared prefix (4 blocks)
    a = system + list(range(1, 20))
    b = system + list(range(500, 530))
    with tempfile.TemporaryDirectory() as folder:
        arena = SimArena(num_blocks=12, block_size=BLOCK)
        cache = TieredCache(12, BLOCK, host_budget_bytes=64 * arena.host_nbytes(BLOCK), mover=arena, policy="lru")
        cache.attach_disk(disk_store(folder, 1 << 20))
        print("prompt A, cold:          ", serve(cache, arena, a))
        print("prompt B, shared prefix: ", serve(cache, arena, b))  # the 4 system blocks reused
        for i in range(3):  # other prompts push A and B out of the 12-block arena into host memory
            serve(cache, arena, list(range(2000 + 100 * i, 2060 + 100 * i)))
        print("prompt A, from host:     ", serve(cache, arena, a))
        cache.persist_pending()
        cache.close_disk()

        arena2 = SimArena(num_blocks=12, block_size=BLOCK)  # a restart: empty memory, same folder
        restarted = TieredCache(12, BLOCK, 64 * arena2.host_nbytes(BLOCK), arena2, policy="lru")
        restarted.attach_disk(disk_store(folder, 1 << 20))
        print("prompt A, after restart: ", serve(restarted, arena2, a))
        restarted.close_disk()


if __name__ == "__main__":
    main()
