"""The remote tier: nodes' KV in a Redis server shared by replicas, checksummed, never half-read.

RAGCache keeps KV in one machine's GPU and host memory (§5.1); our disk tier adds restarts. A
remote tier adds *replicas*: a node prefilled by one engine (one vLLM replica, one ``ragcache
serve``) is a hit for every other engine that reaches the same Redis, and for itself after a
restart.

* **Entries.** One Redis string per node, named ``<prefix>:v<FORMAT>:<fingerprint>:<path key>``,
  holding exactly the disk tier's file bytes (:mod:`ragcache_backend.cache.kv_file`: safetensors,
  metadata with the token ids, CRC-32 over tensors and tokens). A ``SET`` is atomic, so a reader
  sees the whole entry or none; ``NX`` makes the first of two replicas writing the same node win
  (both computed the same KV). Another model, dtype or format has another name and fails the
  metadata check besides. An entry that fails a check (truncated, foreign, another token list) is
  deleted and counted, and the caller recomputes.
* **Budget.** Redis's own ``maxmemory`` and eviction policy bound it (``allkeys-lru`` is the one to
  set); entries are independent values, so Redis may evict any of them: a lookup walks the prefix
  and stops at the first missing block, as for every tier.
* **Failure.** Redis down, slow or refusing: every call returns a miss (or skips the write) within
  ``timeout`` seconds, counts it and logs one line; after an error the store stays away for
  ``backoff`` seconds (no request pays a timeout while Redis is known down). It never raises to
  the request.
* **Writes off the critical path.** :meth:`RemoteStore.put` queues; one writer thread sends. A
  full queue (``max_pending_bytes``) skips the write, counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ragcache_backend.cache.disk import lower_thread_priority
from ragcache_backend.cache.kv_file import FORMAT, FileHeader, KVFileFormat, header_metadata, parse_tokens
from ragcache_backend.errors import CorruptFileError, InvalidRequestError

__all__ = ["RemoteStats", "RemoteStore"]

log = logging.getLogger(__name__)
MiB = 1 << 20


@dataclass(slots=True)
class RemoteStats:
    """Totals since start (entries; seconds)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    puts: int = 0
    put_skipped: int = 0
    read_s: float = 0.0


@dataclass(slots=True)
class _Put:
    name: str
    header: FileHeader
    k: torch.Tensor
    v: torch.Tensor
    nbytes: int
    done_reading: Callable[[], None] | None = None

    def release(self) -> None:
        """The writer no longer reads ``k`` and ``v``: tell the caller, once."""
        callback, self.done_reading = self.done_reading, None
        if callback is not None:
            callback()


class RemoteStore:
    """Nodes' KV in Redis (see the module docstring).

    Args:
        url: ``redis://host:port/db``.
        fingerprint: the model's identity (part of every entry's name and metadata).
        layout: ``(layers, kv_heads, head_dim)`` of the ``(k, v)`` tensors.
        dtype: their dtype.
        prefix: the first part of every entry's name.
        timeout: seconds a Redis call may take before it counts as a miss.
        backoff: seconds the store stays away from Redis after an error.
        max_pending_bytes: queued writes above which a put is skipped.

    Raises:
        InvalidRequestError: a URL the Redis client does not accept, or the ``redis`` package is missing.
    """

    def __init__(self, url: str, fingerprint: str, layout: tuple[int, int, int], dtype: torch.dtype, *,
                 prefix: str = "ragcache", timeout: float = 0.5, backoff: float = 5.0,
                 max_pending_bytes: int = 256 * MiB) -> None:
        try:
            import redis
        except ImportError:
            raise InvalidRequestError("the remote tier needs the 'redis' package (pip install redis)") from None
        try:
            self._redis = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        except ValueError as exc:
            raise InvalidRequestError(f"bad remote tier URL {url!r}: {exc}") from None
        self._errors = (redis.RedisError, OSError)
        self.url = url
        self.format = KVFileFormat(fingerprint, tuple(int(x) for x in layout), dtype)
        self.prefix = f"{prefix}:v{FORMAT}:{fingerprint}:"
        self.backoff = backoff
        self.max_pending_bytes = max_pending_bytes
        self.stats = RemoteStats()
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._pending = 0
        self._queue: queue.Queue[_Put | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="ragcache-remote-writer", daemon=True)
        self._writer.start()

    # ---- reads ---------------------------------------------------------------------------------
    def name(self, pkey: str) -> str:
        """The Redis key of path key ``pkey``."""
        return self.prefix + pkey

    def exists(self, pkeys: Sequence[str]) -> list[bool]:
        """Whether each entry is in Redis (one round trip); all False while Redis is unreachable."""
        if not pkeys or not self._usable():
            return [False] * len(pkeys)
        try:
            pipe = self._redis.pipeline(transaction=False)
            for pkey in pkeys:
                pipe.exists(self.name(pkey))
            return [bool(x) for x in pipe.execute()]
        except self._errors as exc:
            self._failed("exists", exc)
            return [False] * len(pkeys)

    def get(self, pkey: str, tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k, v)`` ``[layers, tokens, kv_heads, head_dim]`` of entry ``pkey`` if it is there, passes
        every check and records exactly ``tokens``; else None (a bad entry is deleted)."""
        if not self._usable():
            self.stats.misses += 1
            return None
        t0 = time.perf_counter()
        try:
            data = self._redis.get(self.name(pkey))
        except self._errors as exc:
            self._failed("get", exc)
            self.stats.misses += 1
            return None
        finally:
            self.stats.read_s += time.perf_counter() - t0
        if data is None:
            self.stats.misses += 1
            return None
        try:
            k, v = self.format.decode(data, pkey)
            meta = header_metadata(data) or {}
            if parse_tokens(meta.get("tokens", ""), int(meta.get("num_tokens", "0"))) != tuple(tokens):
                raise CorruptFileError("its token ids differ from the request's")
        except CorruptFileError as exc:
            self.stats.corrupt += 1
            log.warning("remote tier: entry %s is unusable (%s): deleted; its KV will be recomputed", pkey, exc)
            self._delete(pkey)
            return None
        self.stats.hits += 1
        return k, v

    # ---- writes --------------------------------------------------------------------------------
    def put(self, pkey: str, parent: str, segment: str, k: torch.Tensor, v: torch.Tensor, tokens: tuple[int, ...],
            avg_cost: float = 0.0, done_reading: Callable[[], None] | None = None) -> bool:
        """Queue an entry (``k``, ``v``: ``[layers, tokens, kv_heads, head_dim]`` CPU tensors, any
        strides, that the caller does not change until ``done_reading`` is called, once, from the
        writer thread after it encoded them or dropped the write; the writer thread encodes them);
        False when skipped (Redis known down, or the writer is behind; ``done_reading`` is then
        never called).

        Raises:
            InvalidRequestError: tensors that do not fit the layout or dtype.
        """
        shape = (self.format.layout[0], len(tokens), self.format.layout[1], self.format.layout[2])
        if tuple(k.shape) != shape or tuple(v.shape) != shape or k.dtype != self.format.dtype:
            raise InvalidRequestError(f"KV of shape {tuple(k.shape)} {k.dtype} does not fit the remote tier's "
                                      f"{shape} {self.format.dtype}")
        if not self._usable():
            self.stats.put_skipped += 1
            return False
        nbytes = k.nbytes + v.nbytes
        with self._lock:
            if self._pending + nbytes > self.max_pending_bytes:
                self.stats.put_skipped += 1
                return False
            self._pending += nbytes
        header = FileHeader(pkey, parent, segment, len(tokens), 1, avg_cost, tokens=tuple(tokens))
        self._queue.put(_Put(self.name(pkey), header, k, v, nbytes, done_reading))  # encoded by the writer, off the step
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued writes are sent; False if ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending == 0 and self._queue.empty():
                    return True
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (bounded wait) and stop the writer."""
        self.flush(timeout)
        self._queue.put(None)
        self._writer.join(timeout)

    # ---- internals ---------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        lower_thread_priority()
        while (job := self._queue.get()) is not None:
            try:
                if self._usable():
                    data = self.format.encode(job.header, job.k, job.v)
                    job.release()
                    self._redis.set(job.name, data, nx=True)
                    self.stats.puts += 1
                else:
                    self.stats.put_skipped += 1
            except self._errors as exc:
                self._failed("set", exc)
                self.stats.put_skipped += 1
            except Exception:  # a bug must not kill the writer: log it, drop the entry
                log.exception("remote tier: writing %s failed", job.name)
            finally:
                job.release()
                with self._lock:
                    self._pending -= job.nbytes

    def _delete(self, pkey: str) -> None:
        try:
            self._redis.delete(self.name(pkey))
        except self._errors as exc:
            self._failed("delete", exc)

    def _usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, op: str, exc: Exception) -> None:
        self.stats.errors += 1
        first = self._usable()
        self._down_until = time.monotonic() + self.backoff
        if first:
            log.warning("remote tier: Redis at %s failed on %s (%s: %s); serving by recomputation, retrying in %.0f s",
                        self.url, op, type(exc).__name__, exc, self.backoff)
