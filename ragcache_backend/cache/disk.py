"""The disk tier: knowledge-tree nodes' KV as checksummed safetensors files that survive restarts.

RAGCache keeps KV in GPU and host memory (§5.1, Fig. 8); a server restart loses it. This tier adds
a third level below host memory: a folder of files, one per exact knowledge-tree node, written
off the request's critical path and read back when a prefix match runs past what memory holds.

* **Identity.** A node's KV depends on every token before it, so a file is named by its *path
  key*: a hash chained over the segment keys from the root (:func:`path_key`). Segment keys
  already carry a tenant's ``cache_salt`` (:func:`~ragcache_backend.prompts.builder.segment_key`),
  so salts never share files. Files live in ``<root>/v<FORMAT>-<model fingerprint>/``: another
  model, dtype or format version never even lists them; the fingerprint, format and KV shape are
  also in each file's metadata and checked on load.
* **Integrity.** Each file holds the node's K and V and checksummed metadata
  (:mod:`ragcache_backend.cache.kv_file`). A file is written to a temporary name (around the page
  cache where the file system allows: :mod:`ragcache_backend.cache.direct_write`), fsync'ed and
  renamed (atomic on POSIX): a kill -9 mid-write leaves at most a ``.tmp`` file, removed at the
  next start. A truncated, corrupt or foreign file is detected on load (or at the start-up scan),
  logged, deleted and reported as a miss: the caller recomputes it, it is never served.
* **Budget and policy.** The folder holds at most ``budget_bytes``; over it, the entry with the
  lowest priority under the cache's policy (PGDSF by default, eq. 1/3, with its own clock, eq. 2;
  one :class:`~ragcache_backend.cache.evictor.Evictor`, as every tier) *among entries no other
  entry, written or queued, hangs from* is deleted, as the memory tiers evict leaves first (a
  child is unreachable without its parent's KV). A file whose parent is not on disk is never
  written or indexed. Statistics (frequency, mean cost per token) are stored with the file so
  that priorities survive a restart.
* **Writes off the critical path.** :meth:`DiskStore.put` queues tensors already copied to host
  memory; one writer thread serialises, checksums and writes them. If the queue holds more than
  ``max_pending_bytes`` a put is skipped (counted), never blocking a request. A failed write (full
  disk, permissions) is logged and counted; the server goes on without that file.

* **Chunk variants** (Cache-Craft §3.3). A node that is also a chunk variant carries its record
  (recorded attention sums, origin position, fingerprint, reuse score) as JSON in a ``variant``
  metadata field, covered by the file's checksum. The index lists variants by chunk
  (:meth:`DiskStore.variants`), so the chunk modes can reuse a document at another position after a
  restart or after memory evicted it. Variant caps (N x M) bind memory only; on disk the budget
  and its policy decide.

Thread-safety: the index is guarded by a lock; the engine thread calls ``lookup``/``load``/
``touch``/``put``, the writer thread adds and evicts entries.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from ragcache_backend.cache.chunk_reuse import VariantInfo, variant_from_json, variant_to_json
from ragcache_backend.cache.direct_write import FileWriter
from ragcache_backend.cache.evictor import Evictor
from ragcache_backend.cache.knowledge_tree import TierName, path_key
from ragcache_backend.cache.kv_file import FORMAT, SUFFIX, FileHeader, KVFileFormat, parse_tokens, read_metadata
from ragcache_backend.cache.policy import NodeStats, get_policy
from ragcache_backend.errors import CorruptFileError, InvalidRequestError

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "DiskEntry", "DiskStats", "DiskStore", "entry_file", "lower_thread_priority", "path_key",
           "store_folder"]  # FORMAT, path_key: re-exported

_NAME = re.compile(r"^[0-9a-f]{32}$")
MiB = 1 << 20


def lower_thread_priority(niceness: int = 10) -> None:
    """Make the calling thread yield the CPU to the engine's (Linux: a thread's own nice value):
    a background writer's checksums and serialisation then never slow a forward pass on a machine
    with few cores. Not ``SCHED_IDLE``: tried inside vLLM's worker, back-to-back requests got
    slower (cold-pass TTFT 1.3x vLLM alone, single requests 2-3x), most likely because a writer
    preempted while holding the GIL stalls the engine's thread until a core falls idle. A no-op
    where the OS refuses."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


def store_folder(root: Path | str, fingerprint: str) -> Path:
    """The folder in which a :class:`DiskStore` for model ``fingerprint`` under ``root`` keeps its
    files (no I/O; another process, such as vLLM's scheduler, checks for files there)."""
    safe = re.sub(r"[^0-9A-Za-z._-]", "_", fingerprint)[:80]
    return Path(root).expanduser() / f"v{FORMAT}-{safe}"


def entry_file(folder: Path, pkey: str) -> Path:
    """The file of path key ``pkey`` in a store's ``folder`` (:func:`store_folder`)."""
    return folder / f"{pkey}{SUFFIX}"


@dataclass(slots=True, eq=False)
class DiskEntry:
    """One file of the disk tier (index record).

    Attributes:
        path_key: the node's path key (also the file's name).
        parent: the parent's path key ("" for a child of the root).
        key: the node's segment key.
        num_tokens: tokens of KV in the file.
        nbytes: the file's size, bytes.
        frequency, avg_cost: the node's statistics when written, updated on disk hits (PGDSF input:
            requests, seconds per token).
        last_access: the tier's access counter at the last write or hit.
        priority: eviction priority under the policy (lowest goes first), under ``"disk"``.
        children: entries whose parent this is (an entry with children is never evicted).
        variant: the node's chunk-variant record, when it is one (None otherwise).
        serial: index order (the last tie-breaker of eviction).
        tokens: the segment's token ids the file records (compared before it serves a request).
    """

    path_key: str
    parent: str
    key: str
    num_tokens: int
    nbytes: int
    frequency: int = 1
    avg_cost: float = 0.0
    last_access: int = 0
    priority: dict[str, float] = field(default_factory=dict)
    children: int = 0
    variant: VariantInfo | None = None
    serial: int = 0
    tokens: tuple[int, ...] = ()

    def stats(self) -> NodeStats:
        """What the policy sees of the entry."""
        return NodeStats(self.frequency, self.avg_cost, self.num_tokens, self.last_access)


@dataclass(slots=True)
class DiskStats:
    """Counters since the store was opened.

    Attributes:
        writes: files written. write_failures: writes that failed (full disk, I/O error).
        skipped: puts not queued (writer behind by more than ``max_pending_bytes``, a node
            larger than the budget, or a node whose parent is not on disk). corrupt: files found truncated, corrupt or foreign, and
            deleted. evictions: files deleted to stay in budget. loaded: files read back.
        write_s, read_s: seconds spent writing (writer thread) and reading + verifying files
            (wall time: a batch read by several threads counts once).
    """

    writes: int = 0
    write_failures: int = 0
    skipped: int = 0
    corrupt: int = 0
    evictions: int = 0
    loaded: int = 0
    write_s: float = 0.0
    read_s: float = 0.0


@dataclass(slots=True)
class _Read:
    """One file read: its ``(k, v)``, or why not (``gone``, ``unreadable``, ``corrupt``, and the detail)."""

    kv: tuple[torch.Tensor, torch.Tensor] | None
    failure: Literal["", "gone", "unreadable", "corrupt"]
    why: str
    seconds: float


@dataclass(slots=True)
class _Job:
    entry: DiskEntry
    k: torch.Tensor
    v: torch.Tensor
    done_reading: Callable[[], None] | None = None

    def release(self) -> None:
        """The writer no longer reads ``k`` and ``v``: tell the caller, once."""
        callback, self.done_reading = self.done_reading, None
        if callback is not None:
            callback()


class DiskStore:
    """A folder of KV files for one model (see the module docstring).

    Args:
        root: the cache folder (created if missing); files go to ``root/v<FORMAT>-<fingerprint>``.
        fingerprint: the model's identity (weights, dtype, tokenizer files), as
            :attr:`~ragcache_backend.model.loader.LoadedModel.fingerprint`.
        layout: ``(layers, kv_heads, head_dim)`` of the KV tensors; a file of another shape is foreign.
        dtype: the KV dtype; a file of another dtype is foreign.
        budget_bytes: the folder's byte budget (> 0).
        policy: replacement policy name (``pgdsf``, ``gdsf``, ``lru``, ``lfu``).
        max_pending_bytes: bytes of queued writes above which new puts are skipped.

    Raises:
        InvalidRequestError: a budget below 1 byte, or ``root`` exists and is not a folder.
        OSError: the folder cannot be created.
    """

    READ_THREADS = 4  # files :meth:`load_many` reads at once

    def __init__(self, root: Path | str, fingerprint: str, layout: tuple[int, int, int], dtype: torch.dtype,
                 budget_bytes: int, *, policy: str = "pgdsf", max_pending_bytes: int = 256 * MiB) -> None:
        if budget_bytes < 1:
            raise InvalidRequestError(f"the disk tier needs a budget of at least 1 byte, got {budget_bytes}")
        root = Path(root).expanduser()
        if root.exists() and not root.is_dir():
            raise InvalidRequestError(f"disk cache path {root} exists and is not a folder")
        self.directory = store_folder(root, fingerprint)
        self._format = KVFileFormat(fingerprint, tuple(int(x) for x in layout), dtype)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.layout = tuple(int(x) for x in layout)
        self.dtype = dtype
        self.budget_bytes = budget_bytes
        self.max_pending_bytes = max_pending_bytes
        self.stats = DiskStats()
        self._evictor: Evictor[DiskEntry] = Evictor(TierName.DISK, get_policy(policy), self._is_leaf)
        self._access = 0
        self._serial = itertools.count(1)
        self._lock = threading.Lock()
        self._entries: dict[str, DiskEntry] = {}
        self._by_chunk: dict[str, set[str]] = {}  # chunk key -> path keys of its variants' entries
        self._used = 0
        self._pending: dict[str, int] = {}  # path key -> bytes queued for writing
        self._pending_children: Counter[str] = Counter()  # parent path key -> its children queued
        self._discard: set[str] = set()  # queued writes deleted before they landed
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._file_writer = FileWriter()  # used by the writer thread only
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="ragcache-disk-writer", daemon=True)
        self._writer.start()
        self._readers: ThreadPoolExecutor | None = None  # load_many's, made on first use

    # ---- views ---------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes of the files in the index."""
        return self._used

    @property
    def clock(self) -> float:
        """The tier's logical clock (eq. 2)."""
        return self._evictor.clock

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[DiskEntry]:
        with self._lock:
            return iter(list(self._entries.values()))

    def contains(self, pkey: str) -> bool:
        """True if a file for ``pkey`` is on disk or queued (and not deleted meanwhile)."""
        with self._lock:
            return pkey in self._entries or (pkey in self._pending and pkey not in self._discard)

    def lookup(self, pkey: str) -> DiskEntry | None:
        """The entry of path key ``pkey``, or None."""
        with self._lock:
            return self._entries.get(pkey)

    def variants(self, chunk: str) -> list[DiskEntry]:
        """Entries that are variants of ``chunk`` (any fingerprint: the caller filters), oldest first."""
        with self._lock:
            found = (self._entries.get(p) for p in self._by_chunk.get(chunk, ()))
            return sorted((e for e in found if e is not None), key=lambda e: e.last_access)

    def path_keys(self, pkey: str) -> list[str] | None:
        """The segment keys from the root down to entry ``pkey`` (the keys a prefix match needs to
        read it back with its ancestors), or None if it or an ancestor is not on disk."""
        keys: list[str] = []
        with self._lock:
            while pkey:
                e = self._entries.get(pkey)
                if e is None or len(keys) > len(self._entries):
                    return None
                keys.append(e.key)
                pkey = e.parent
        return keys[::-1]

    # ---- reads ---------------------------------------------------------------------------------
    def load(self, entry: DiskEntry) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Read and verify ``entry``'s file and return its ``(k, v)`` (CPU tensors,
        ``[layers, tokens, kv_heads, head_dim]``), counting a hit (frequency + 1).

        Returns None when the file is gone (evicted meanwhile) or fails verification (truncated,
        corrupt, foreign): then it is deleted, logged and counted, and the caller recomputes.
        """
        return self._settle(entry, self._read(entry))

    def load_many(self, entries: Sequence[DiskEntry]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """:meth:`load` of each entry, in order, the files read and verified by up to
        :attr:`READ_THREADS` threads at once (a disk answers several reads in flight faster than one
        after another: ``benchmarks/disk_reads.py``). The index and counters are updated on the
        calling thread, in order, as :meth:`load` would: an entry whose parent turns out gone or
        damaged earlier in the batch is a miss (its file was deleted with the parent's). After
        :meth:`close`, the files are read one after another."""
        if len(entries) < 2 or self._closed:
            return [self.load(e) for e in entries]
        with self._lock:  # closed meanwhile (checked again here): no pool made that close() would not stop
            if self._readers is None and not self._closed:
                self._readers = ThreadPoolExecutor(self.READ_THREADS, thread_name_prefix="ragcache-disk-read")
            readers = self._readers
        if readers is None:
            return [self.load(e) for e in entries]
        t0 = time.perf_counter()
        try:
            reads = list(readers.map(self._read, entries))
        except RuntimeError:  # closed by another thread meanwhile
            return [self.load(e) for e in entries]
        self.stats.read_s += time.perf_counter() - t0  # wall time of the batch, as for one-by-one reads
        return [self._settle(entry, read, timed=False) for entry, read in zip(entries, reads)]

    def _read(self, entry: DiskEntry) -> _Read:
        """Read and verify ``entry``'s file; touches nothing shared (any thread may call it)."""
        t0 = time.perf_counter()
        path = self._file(entry.path_key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return _Read(None, "gone", "", time.perf_counter() - t0)
        except OSError as exc:
            return _Read(None, "unreadable", str(exc), time.perf_counter() - t0)
        try:
            return _Read(self._format.decode(data, entry.path_key), "", "", time.perf_counter() - t0)
        except CorruptFileError as exc:
            return _Read(None, "corrupt", str(exc), time.perf_counter() - t0)

    def _settle(self, entry: DiskEntry, read: _Read, *, timed: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The index and counters after a read of ``entry``'s file (on the calling thread). An entry
        no longer indexed (forgotten with a parent, evicted, or written again meanwhile) is a miss
        and changes nothing: what its file now holds is not what was read."""
        if timed:
            self.stats.read_s += read.seconds
        with self._lock:
            current = self._entries.get(entry.path_key) is entry
        if not current:
            return None
        path = self._file(entry.path_key)
        if read.failure == "gone":
            self._forget(entry.path_key, delete=False)
            return None
        if read.failure == "unreadable":
            log.warning("disk tier: cannot read %s (%s); recomputing", path.name, read.why)
            return None
        if read.failure == "corrupt":
            self._drop_corrupt(path, read.why)
            return None
        self.stats.loaded += 1
        self.touch(entry)
        return read.kv

    def touch(self, entry: DiskEntry) -> None:
        """Count a reference to ``entry`` (frequency + 1) and refresh its priority."""
        with self._lock:
            if self._entries.get(entry.path_key) is entry:
                entry.frequency += 1
                self._access += 1
                entry.last_access = self._access
                self._evictor.reprice(entry)

    def eviction_order(self) -> list[str]:
        """Path keys of the entries that may be evicted now, first victim first (a view)."""
        with self._lock:
            return [e.path_key for e in self._evictor.order()]

    def delete(self, pkey: str) -> None:
        """Delete entry ``pkey``'s file (no-op if absent); a queued write of it is discarded when it lands.

        Raises:
            InvalidRequestError: other entries, written or queued, hang from it (they would be orphans).
        """
        with self._lock:
            e = self._entries.get(pkey)
            if (e is not None and e.children) or self._pending_children.get(pkey):
                raise InvalidRequestError(f"disk entry {pkey} has children on disk: delete them first")
            if pkey in self._pending:
                self._discard.add(pkey)
            self._forget_locked(pkey)
        self._file(pkey).unlink(missing_ok=True)

    # ---- writes --------------------------------------------------------------------------------
    def put(self, pkey: str, parent: str, key: str, k: torch.Tensor, v: torch.Tensor, stats: NodeStats,
            variant: VariantInfo | None = None, tokens: tuple[int, ...] = (),
            done_reading: Callable[[], None] | None = None) -> bool:
        """Queue a node's KV for writing; returns False (nothing queued) when it is already on disk
        or queued, larger than the budget, its parent is neither on disk nor queued (the file would
        be an orphan), or the writer is behind by ``max_pending_bytes``.

        Args:
            pkey, parent, key: the node's path key, its parent's path key, its segment key.
            k, v: CPU tensors ``[layers, tokens, kv_heads, head_dim]`` in the store's dtype; the
                caller must not modify them afterwards (they are written from another thread).
            stats: the node's statistics (frequency, seconds per token) for the policy.
            variant: the node's chunk-variant record, if it is one (its chunk must be ``key`` and
                its length the token count).
            tokens: the segment's token ids (recorded in the file; empty: none).
            done_reading: called once (from the writer thread) when the writer no longer reads
                ``k`` and ``v`` (encoded, or the write was dropped); never called when this returns
                False. Until then the caller must not change them.

        Raises:
            InvalidRequestError: tensors of the wrong shape or dtype, or a variant of another
                chunk or length.
        """
        n = int(k.shape[1]) if k.dim() == 4 else -1
        shape = (self.layout[0], n, self.layout[1], self.layout[2])
        if tuple(k.shape) != shape or tuple(v.shape) != shape or k.dtype != self.dtype or v.dtype != self.dtype:
            raise InvalidRequestError(f"KV of shape {tuple(k.shape)} {k.dtype} does not fit the disk tier's "
                                      f"{shape} {self.dtype}")
        if tokens and len(tokens) != n:
            raise InvalidRequestError(f"{len(tokens)} token ids for {n} tokens of KV")
        if variant is not None and not variant.fits(key, n):
            raise InvalidRequestError(f"a variant of {variant.stats.chunk} ({variant.stats.length} tokens) cannot be "
                                      f"stored as segment {key} of {n} tokens")
        nbytes = k.nbytes + v.nbytes + 1024
        with self._lock:
            if self._closed or pkey in self._entries or pkey in self._pending:
                return False
            orphan = parent != "" and parent not in self._entries and parent not in self._pending
            if orphan or nbytes > self.budget_bytes or sum(self._pending.values()) + nbytes > self.max_pending_bytes:
                self.stats.skipped += 1
                return False
            self._pending[pkey] = nbytes
            self._pending_children[parent] += 1
        record = None if variant is None else replace(variant)  # the caller's copy goes on changing (f_r)
        entry = DiskEntry(pkey, parent, key, n, nbytes, max(1, stats.frequency), stats.avg_cost, variant=record,
                          tokens=tuple(tokens))
        self._queue.put(_Job(entry, k.detach().cpu(), v.detach().cpu(), done_reading))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued writes (up to ``timeout`` seconds) and stop the writer; idempotent."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout)
        with self._lock:
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=True)

    def _write_loop(self) -> None:
        lower_thread_priority()
        while True:
            job = self._queue.get()
            if job is None:
                self._file_writer.close()
                return
            try:
                self._write(job)
            except Exception:  # a bug must not kill the writer: log it, drop the job
                log.exception("disk tier: writing %s failed", job.entry.path_key)
                with self._lock:
                    self._done(job.entry)
            finally:
                job.release()

    def _write(self, job: _Job) -> None:
        t0 = time.perf_counter()
        e = job.entry
        record = variant_to_json(e.variant) if e.variant is not None else None
        header = FileHeader(e.path_key, e.parent, e.key, e.num_tokens, e.frequency, e.avg_cost, record, e.tokens)
        final = self._file(e.path_key)
        tmp = final.with_name(f".{e.path_key}.{os.getpid()}.tmp")
        try:
            data = self._format.encode(header, job.k, job.v)
            job.release()  # the bytes are ours now: the caller may reuse the tensors' memory
            self._file_writer.write(tmp, data)
            os.replace(tmp, final)
        except OSError as exc:
            self.stats.write_failures += 1
            log.warning("disk tier: could not write %s (%s); it stays in memory only", final.name, exc)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._done(e)
            return
        e.nbytes = len(data)
        self.stats.write_s += time.perf_counter() - t0
        with self._lock:
            self._done(e)
            if e.path_key not in self._discard and self._add(e):
                self.stats.writes += 1
                self._evict_over_budget()
                return
            # deleted while queued, or its parent left the disk meanwhile (it was damaged)
            self._discard.discard(e.path_key)
            self.stats.skipped += 1
            final.unlink(missing_ok=True)

    def _done(self, e: DiskEntry) -> None:
        """A queued write finished or failed (lock held)."""
        if self._pending.pop(e.path_key, None) is not None:
            self._pending_children[e.parent] -= 1
            if self._pending_children[e.parent] <= 0:
                del self._pending_children[e.parent]
                parent = self._entries.get(e.parent)
                if parent is not None:
                    self._evictor.offer(parent)

    # ---- index ---------------------------------------------------------------------------------
    def _file(self, pkey: str) -> Path:
        return entry_file(self.directory, pkey)

    def _is_leaf(self, e: DiskEntry) -> bool:
        """An entry may be evicted when it is indexed and no entry, written or queued, hangs from it."""
        return e.children == 0 and not self._pending_children.get(e.path_key) and self._entries.get(e.path_key) is e

    def _add(self, e: DiskEntry) -> bool:
        """Put ``e`` in the index (lock held); False (not indexed) when its parent is not on disk."""
        if e.parent and e.parent not in self._entries:
            return False
        old = self._entries.get(e.path_key)
        if old is not None:
            self._used -= old.nbytes
            e.children = old.children
            self._unindex(old)
            self._evictor.forget(old)
        elif e.parent in self._entries:
            self._entries[e.parent].children += 1
        self._access += 1
        e.last_access = self._access
        e.serial = next(self._serial)
        self._entries[e.path_key] = e
        self._evictor.reprice(e)
        self._used += e.nbytes
        if e.variant is not None:
            self._by_chunk.setdefault(e.key, set()).add(e.path_key)
        return True

    def _child_gone(self, parent_key: str) -> None:
        """One child of ``parent_key`` left the index (lock held): the parent may become a candidate."""
        parent = self._entries.get(parent_key)
        if parent is not None:
            parent.children -= 1
            self._evictor.offer(parent)

    def _unindex(self, e: DiskEntry) -> None:
        """Take ``e`` out of the variant index (lock held)."""
        if e.variant is not None:
            held = self._by_chunk.get(e.key)
            if held is not None:
                held.discard(e.path_key)
                if not held:
                    del self._by_chunk[e.key]

    def _forget(self, pkey: str, *, delete: bool) -> None:
        """Take entry ``pkey`` out of the index (its file deleted with ``delete``) and the entries
        below it with their files: they are unreachable without its KV."""
        with self._lock:
            gone = self._forget_locked(pkey)
        for k in gone[1:] if not delete else gone:
            self._file(k).unlink(missing_ok=True)

    def _forget_locked(self, pkey: str) -> list[str]:
        """:meth:`_forget` with the lock held; returns the path keys taken out (``pkey`` first)."""
        e = self._entries.pop(pkey, None)
        if e is None:
            return []
        self._unindex(e)
        self._evictor.forget(e)
        self._used -= e.nbytes
        self._child_gone(e.parent)
        gone = [pkey]
        if e.children:  # (only when its file turned out missing or damaged)
            below = [x.path_key for x in self._entries.values() if x.parent == pkey]
            for child in below:
                gone += self._forget_locked(child)
            log.info("disk tier: %d file(s) below %s deleted with it", len(gone) - 1, pkey)
        return gone

    def _drop_corrupt(self, path: Path, why: str) -> None:
        self.stats.corrupt += 1
        log.warning("disk tier: %s is unusable (%s): deleted; its KV will be recomputed", path.name, why)
        self._forget(path.name[: -len(SUFFIX)], delete=False)
        path.unlink(missing_ok=True)

    def _evict_over_budget(self) -> None:
        """Delete the lowest-priority childless entries until within budget (lock held)."""
        while self._used > self.budget_bytes:
            try:
                victim = self._evictor.pop()  # the clock advances (eq. 2)
            except LookupError:
                return  # every entry has children or queued children
            del self._entries[victim.path_key]
            self._unindex(victim)
            self._evictor.forget(victim)
            self._used -= victim.nbytes
            self._child_gone(victim.parent)
            self._file(victim.path_key).unlink(missing_ok=True)
            self.stats.evictions += 1

    def _scan(self) -> None:
        """Rebuild the index from the folder's file headers (bodies are verified on load):
        leftover ``.tmp`` files are deleted, files with a bad header, foreign metadata or no parent
        on disk are deleted, then the budget is enforced."""
        found: dict[str, DiskEntry] = {}
        for path in self.directory.iterdir():
            name = path.name
            if name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write killed before its rename
                continue
            if not name.endswith(SUFFIX) or not _NAME.match(name[: -len(SUFFIX)]):
                continue
            try:
                meta = read_metadata(path)
                nbytes = path.stat().st_size
            except OSError as exc:
                log.warning("disk tier: cannot read %s (%s); skipped", name, exc)
                continue
            pkey = name[: -len(SUFFIX)]
            why = "not a safetensors file" if meta is None else self._format.foreign(meta, pkey)
            if why:
                self._drop_corrupt(path, why)
                continue
            try:
                avg_cost = float(meta.get("avg_cost", "0"))
                frequency = int(meta.get("frequency", "1"))
            except ValueError:
                avg_cost, frequency = 0.0, 1
            variant = None
            if "variant" in meta:
                try:
                    variant = variant_from_json(meta["variant"])
                except ValueError as exc:
                    self._drop_corrupt(path, f"bad variant record ({exc})")
                    continue
                if not variant.fits(meta["key"], int(meta["num_tokens"])):
                    self._drop_corrupt(path, "its variant record is for another chunk")
                    continue
            found[pkey] = DiskEntry(pkey, meta["parent"], meta["key"], int(meta["num_tokens"]), nbytes,
                                    max(1, frequency), avg_cost, variant=variant,
                                    tokens=parse_tokens(meta.get("tokens", ""), int(meta["num_tokens"])))
        reachable: dict[str, DiskEntry] = {}
        visiting: set[str] = set()

        def reach(pkey: str) -> bool:
            if pkey == "" or pkey in reachable:
                return True
            e = found.get(pkey)
            if e is None or pkey in visiting:
                return False
            visiting.add(pkey)
            if reach(e.parent):
                reachable[pkey] = e
                return True
            return False

        for pkey in list(found):
            if not reach(pkey):
                log.info("disk tier: %s has no parent on disk: deleted", pkey)
                self._file(pkey).unlink(missing_ok=True)
        with self._lock:
            for e in reachable.values():  # parents were added to ``reachable`` before their children
                self._add(e)
            self._evict_over_budget()
        if self._entries:
            log.info("disk tier: %d files, %.1f MiB in %s", len(self._entries), self._used / MiB, self.directory)
