"""The remote tier against a real Redis on loopback: entries round-trip byte for byte, a key is never
trusted alone, damaged entries are deleted and recomputed, another model never sees an entry, the
first of two writers wins, and Redis down costs a counted miss, never an error."""

from __future__ import annotations

import time

import redis
import torch

from ragcache_backend.cache.remote import RemoteStore

LAYOUT = (2, 3, 4)


def kv(n: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT[0], n, LAYOUT[1], LAYOUT[2], generator=g), torch.randn(LAYOUT[0], n, LAYOUT[1], LAYOUT[2], generator=g)


def store(url: str, fingerprint: str = "fp", **kw) -> RemoteStore:
    return RemoteStore(url, fingerprint, LAYOUT, torch.float32, **kw)


def test_entries_round_trip_and_are_shared_between_stores(redis_server) -> None:
    a, b = store(redis_server.url), store(redis_server.url)  # two replicas
    k, v = kv()
    tokens = (1, 2, 3, 4, 5)
    assert a.put("p1", "", "s1", k, v, tokens) and a.flush(10)
    assert b.exists(["p1", "p2"]) == [True, False]
    got = b.get("p1", tokens)
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], v)
    assert b.stats.hits == 1
    assert store(redis_server.url, fingerprint="other").exists(["p1"]) == [False]  # another model
    a.close()
    b.close()


def test_a_key_is_never_trusted_alone_and_damaged_entries_are_deleted(redis_server) -> None:
    s = store(redis_server.url)
    k, v = kv()
    s.put("p1", "", "s1", k, v, (1, 2, 3, 4, 5))
    s.flush(10)
    assert s.get("p1", (1, 2, 3, 4, 6)) is None  # another token list under the same key
    assert s.exists(["p1"]) == [False] and s.stats.corrupt == 1
    s.put("p2", "", "s2", k, v, (1, 2, 3, 4, 5))
    s.flush(10)
    r = redis.Redis.from_url(redis_server.url)
    data = r.get(s.name("p2"))
    r.set(s.name("p2"), data[:-9])  # truncated
    r.set(s.name("p3"), b"not an entry")
    assert s.get("p2", (1, 2, 3, 4, 5)) is None and s.get("p3", (1,)) is None
    assert s.exists(["p2", "p3"]) == [False, False] and s.stats.corrupt == 3
    s.close()


def test_the_first_of_two_writers_wins(redis_server) -> None:
    a, b = store(redis_server.url), store(redis_server.url)
    k1, v1 = kv(seed=1)
    k2, v2 = kv(seed=2)
    a.put("p", "", "s", k1, v1, (1, 2, 3, 4, 5))
    a.flush(10)
    b.put("p", "", "s", k2, v2, (1, 2, 3, 4, 5))
    b.flush(10)
    got = b.get("p", (1, 2, 3, 4, 5))
    assert got is not None and torch.equal(got[0], k1)
    a.close()
    b.close()


def test_redis_down_is_a_counted_miss_within_the_timeout_never_an_error(redis_server, caplog) -> None:
    s = store(redis_server.url, timeout=0.3, backoff=60)
    k, v = kv()
    s.put("p", "", "s", k, v, (1, 2, 3, 4, 5))
    s.flush(10)
    redis_server.stop()
    t0 = time.perf_counter()
    assert s.get("p", (1, 2, 3, 4, 5)) is None
    assert s.exists(["p"]) == [False]
    assert s.put("q", "", "s", k, v, (1, 2, 3, 4, 5)) is False  # known down: skipped, not queued
    assert time.perf_counter() - t0 < 2.0
    assert s.stats.errors == 1 and s.stats.put_skipped == 1
    assert sum("serving by recomputation" in r.message for r in caplog.records) == 1
    s.close(timeout=1)


def test_unreachable_at_start_is_not_an_error() -> None:
    s = store("redis://127.0.0.1:1/0", timeout=0.2)
    assert s.exists(["p"]) == [False]
    assert s.get("p", (1,)) is None
    s.close(timeout=1)


def test_a_bad_url_is_a_clear_error_and_serve_settings_carry_the_url() -> None:
    import pytest

    from ragcache_backend.errors import InvalidRequestError
    from ragcache_backend.server.settings import load_settings

    with pytest.raises(InvalidRequestError, match="bad remote tier URL"):
        store("http://127.0.0.1:6379/0")
    settings = load_settings(None, remote_url="redis://10.0.0.5:6379/1")
    assert settings.engine_config().remote_url == "redis://10.0.0.5:6379/1"
    assert load_settings(None).engine_config().remote_url is None
