"""The remote tier (Redis shared by replicas) through the engine, on the random tiny Llama and a
real redis-server on loopback: a prompt one engine computed is read back by another engine with
nothing in memory or on disk, exactly; salts isolate replicas' entries too; a damaged entry is
recomputed; Redis down costs recomputation, never an error."""

from __future__ import annotations

import redis
import torch

from ragcache_backend.model.sampling import SamplingParams
from tests.engine.test_disk_tier import path_nodes
from tests.engine.test_engine import DOCS, assert_no_leak, make_engine

GREEDY = SamplingParams(max_tokens=8)
Q = "What is the GIL?"


def replica(tiny_model, fixed_profile, url: str, **kw):
    return make_engine(tiny_model, fixed_profile, remote_url=url, **kw)


def sent(engine) -> None:
    """Wait until what a finished request inserted is in Redis (its last step queues the nodes
    after the result is set: wait for that step first)."""
    assert engine.wait_idle(30)
    assert engine.cache.remote.flush(30)


def test_a_prompt_computed_on_one_replica_is_read_exactly_by_another(tiny_model, fixed_profile, redis_server, tmp_path):
    a = replica(tiny_model, fixed_profile, redis_server.url, disk_dir=tmp_path / "a")
    segs, _ = a.segments_for(Q, DOCS, GREEDY)
    reference, _ = a.first_token_logits(segs, use_cache=False)
    r1 = a.generate(Q, DOCS, GREEDY)
    sent(a)
    assert a.cache.stats.remote_queued >= path_nodes(a, Q, DOCS)
    a.close()

    b = replica(tiny_model, fixed_profile, redis_server.url)  # no disk tier, empty memory
    logits, cached = b.first_token_logits(segs)
    assert cached == r1.prompt_tokens - 1
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert b.cache.stats.remote_hits == path_nodes(b, Q, DOCS)
    r2 = b.generate(Q, DOCS, GREEDY)
    assert r2.token_ids == r1.token_ids
    assert_no_leak(b)
    b.close()


def test_salts_isolate_replicas_and_a_damaged_entry_is_recomputed(tiny_model, fixed_profile, redis_server):
    a = replica(tiny_model, fixed_profile, redis_server.url)
    r1 = a.generate(Q, DOCS, GREEDY, cache_salt="tenant-a")
    sent(a)
    a.close()
    b = replica(tiny_model, fixed_profile, redis_server.url)
    assert b.generate(Q, DOCS, GREEDY, cache_salt="tenant-b").cached_tokens == 0
    assert b.generate(Q, DOCS, GREEDY).cached_tokens == 0
    b.close()
    # damage every entry tenant-a wrote: the next replica recomputes, same answer, entries deleted
    r = redis.Redis.from_url(redis_server.url)
    keys = r.keys("ragcache:*")
    assert keys
    for k in keys:
        r.set(k, r.get(k)[:-5])
    c = replica(tiny_model, fixed_profile, redis_server.url)
    r3 = c.generate(Q, DOCS, GREEDY, cache_salt="tenant-a")
    assert r3.token_ids == r1.token_ids and r3.cached_tokens == 0
    assert c.cache.remote.stats.corrupt >= 1
    c.close()


def test_redis_down_is_served_by_recomputation(tiny_model, fixed_profile, redis_server):
    a = replica(tiny_model, fixed_profile, redis_server.url)
    r1 = a.generate(Q, DOCS, GREEDY)
    redis_server.stop()
    b = replica(tiny_model, fixed_profile, redis_server.url)
    r2 = b.generate(Q, DOCS, GREEDY)
    assert r2.token_ids == r1.token_ids and r2.cached_tokens == 0
    r3 = b.generate("Another question?", DOCS, GREEDY)  # and it keeps serving, from memory
    assert r3.cached_tokens > 0
    assert b.cache.remote.stats.errors >= 1
    a.close()
    b.close()
