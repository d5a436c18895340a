"""The device KV arena: where every token's K and V live, in fixed-size blocks.

Following vLLM (RAGCache §5.1), K and V are each one tensor ``[layers, blocks * block_size,
kv_heads, head_dim]``; a token is addressed by its *slot* ``block * block_size + offset``, and a
sequence's context is a list of :class:`~ragcache_backend.cache.blocks.KVRun` (a segment's tokens
at the start of its own blocks), so a document's KV computed once can be attended to by any later
request whose path reaches it. Block ids come from the cache's allocator; the arena only stores.

A chunk's KV moves to a new position with :meth:`KVArena.copy_rerotated` (RoPE re-rotation by the
position delta, Cache-Craft §3.4.3).

The arena implements the cache's KVMover protocol (swap out to host, swap in, host copies for the
disk tier): the engine hands it to the cache as its mover.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragcache_backend.cache.blocks import KVRun
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.heap import libc
from ragcache_backend.model.kernels import native, rope_cos_sin

__all__ = ["BackgroundCommit", "HostKV", "KVArena"]

log = logging.getLogger(__name__)
_HUGE = 2 << 20  # a transparent huge page on x86-64 Linux, bytes
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_COMMIT_SLICE = 64 << 20  # bytes per madvise call of a background commit (it checks for stop between them)


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back ``t``'s memory (a CPU tensor, not yet touched) with transparent huge pages
    (``madvise(MADV_HUGEPAGE)`` over its whole 2 MiB pages): the arena's first writes then fault 2
    MiB at a time, not 4 KiB (a shared pool's host part is committed as it fills: on a 2-core VM a
    chunk-reuse request writing ~46 MB into fresh host blocks spent ~0.24 s in 4 KiB page faults), and
    reads across its scattered slots miss the TLB less. Returns whether the advice was taken; False
    off Linux, on other devices, with ``RAGCACHE_HUGE_PAGES=0`` in the environment, where THP is off
    (``never``) or the call fails: nothing else changes."""
    if sys.platform != "linux" or t.device.type != "cpu" or os.environ.get("RAGCACHE_HUGE_PAGES", "1") == "0":
        return False
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _HUGE * _HUGE
    if end <= start:
        return False
    lib = libc()
    try:
        ok = lib is not None and lib.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
    except AttributeError:
        return False
    if not ok:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): the arena stays on 4 KiB pages", ctypes.get_errno())
    return ok


class BackgroundCommit:
    """The arena's uncommitted part (a shared pool's host part) committed by a daemon thread at
    nice 19, slice by slice, with ``madvise(MADV_POPULATE_WRITE)``: the pages are faulted in and
    zeroed by the kernel as a first write would, without the thread touching their contents, so it
    never races with the engine writing KV into blocks it already holds. Requests then do not pay
    the first-touch page faults in their forward passes: on a 2-core VM, where memory the guest has
    not used before is backed by the hypervisor at its first touch (~0.4-1.2 GB/s against ~8 GB/s
    for reused pages), a chunk-reuse request spent ~11% of its samples zeroing fresh host blocks
    (2026-11-28: mean TTFT 0.86x with the pool committed in one run, no gain in a repeat once the VM
    had touched that memory before; docs/benchmarks.md). The price is memory: the process holds its
    whole host budget from start (vLLM's CPU server, with 3 GiB of KV configured, stayed at 1.4 GiB).

    Started by :meth:`KVArena.commit_in_background`; :meth:`stop` ends it early (engine close).
    Does nothing off Linux, for non-CPU arenas, or where the kernel refuses the advice (older than
    5.14: ``EINVAL``); :attr:`error` then says why.

    Attributes:
        total_bytes: bytes to commit (the uncommitted part of K and V over every layer).
        committed_bytes: bytes committed so far.
        error: why it stopped before the end (None: it finished, or runs).
    """

    def __init__(self, ranges: list[tuple[int, int]], keep: tuple[torch.Tensor, ...]) -> None:
        self.total_bytes = sum(n for _, n in ranges)
        self.committed_bytes = 0
        self.error: str | None = None
        self._ranges, self._keep = ranges, keep  # the tensors stay alive while the thread runs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ragcache-arena-commit", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ragcache_backend.cache.disk import lower_thread_priority  # the disk writers' helper

        lower_thread_priority(19)
        lib = libc()
        if lib is None:
            self.error = "libc not found"
            return
        for start, length in self._ranges:
            off = 0
            while off < length:
                if self._stop.is_set():
                    return
                n = min(_COMMIT_SLICE, length - off)
                if lib.madvise(ctypes.c_void_p(start + off), ctypes.c_size_t(n), _MADV_POPULATE_WRITE) != 0:
                    self.error = f"madvise(MADV_POPULATE_WRITE) failed: errno {ctypes.get_errno()}"
                    log.debug("background commit of the arena stopped: %s", self.error)
                    return
                off += n
                self.committed_bytes += n
        self._keep = ()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread; True when it has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the slice in progress and wait for the thread."""
        self._stop.set()
        self._thread.join()
        self._keep = ()


@dataclass(slots=True)
class HostKV:
    """A node's KV copied out of the device arena (the host tier).

    ``k`` and ``v`` are ``[layers, tokens, kv_heads, head_dim]`` on the CPU (pinned under CUDA).
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class KVArena:
    """The paged device KV arena of one model, and the cache's mover.

    Args:
        num_layers: decoder layers.
        num_blocks: size of the arena, in blocks.
        block_size: tokens per block.
        num_kv_heads: K/V heads per layer.
        head_dim: size of one head.
        dtype: the KV dtype (the model's).
        device: where the arena lives.
        inv_freq: float32 RoPE inverse frequencies of the model (for :meth:`copy_rerotated`):
            ``[head_dim / 2]``, or ``[num_layers, head_dim / 2]`` when layers differ (Gemma 3's local
            layers rotate with another base than its global ones).
        committed_blocks: blocks committed (zeroed, touched) at construction, from block 0; the
            rest (the host tier's part of a shared pool) is committed as it is written, or by
            :meth:`commit_in_background`. None: all.

    The device part is allocated and touched up front: its memory is committed at construction.

    Attributes:
        k_cache, v_cache: ``[num_layers, num_blocks * block_size, num_kv_heads, head_dim]`` in
            ``dtype`` on ``device``.
    """

    __slots__ = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype", "device", "inv_freq",
                 "k_cache", "v_cache", "committed_blocks")

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, inv_freq: torch.Tensor, committed_blocks: int | None = None) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.inv_freq = inv_freq
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        committed = num_blocks if committed_blocks is None else min(num_blocks, committed_blocks)
        self.committed_blocks = committed
        # the device part is zeroed (committed) up front, a bounded budget as vLLM's, so its first
        # write never pays the page faults of lazily committed memory; the host part of a shared
        # pool is committed as the host tier fills, in huge pages where Linux gives them
        self.k_cache = torch.empty(shape, dtype=dtype, device=device)
        self.v_cache = torch.empty(shape, dtype=dtype, device=device)
        for cache in (self.k_cache, self.v_cache):
            advise_huge_pages(cache)
            cache[:, : committed * block_size].zero_()

    def commit_in_background(self) -> BackgroundCommit | None:
        """Commit the blocks past ``committed_blocks`` (a shared pool's host part) in a background
        thread (:class:`BackgroundCommit`); None when there are none, off Linux or off the CPU."""
        if self.committed_blocks >= self.num_blocks or self.device.type != "cpu" or sys.platform != "linux":
            return None
        row = self.num_kv_heads * self.head_dim * self.k_cache.element_size()  # bytes per slot
        first, layer_bytes = self.committed_blocks * self.block_size * row, self.num_blocks * self.block_size * row
        page = os.sysconf("SC_PAGE_SIZE")
        ranges = []
        for cache in (self.k_cache, self.v_cache):
            for layer in range(self.num_layers):
                lo = cache.data_ptr() + layer * layer_bytes + first
                hi = cache.data_ptr() + (layer + 1) * layer_bytes
                lo = -(-lo // page) * page  # madvise takes whole pages (the one at the edge is committed)
                if hi > lo:
                    ranges.append((lo, hi - lo))
        return BackgroundCommit(ranges, (self.k_cache, self.v_cache)) if ranges else None

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k_cache.element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (``block_size`` tokens)."""
        return self.kv_bytes_per_token * self.block_size

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)``: the shape of one token's K (or V) across layers."""
        return self.num_layers, self.num_kv_heads, self.head_dim

    # ---- slots -------------------------------------------------------------------------------
    def slots(self, runs: Sequence[KVRun]) -> torch.Tensor:
        """Flat arena slot of every token of ``runs``, in order: ``[sum(length)]`` int64.

        Raises:
            InvalidRequestError: a run overflows its blocks.
        """
        parts = []
        bs = self.block_size
        for run in runs:
            if run.length == 0:
                continue
            idx = torch.arange(run.start, run.start + run.length)
            if (run.start + run.length + bs - 1) // bs > len(run.blocks):
                raise InvalidRequestError(f"KV run of {run.length} tokens at {run.start} overflows {len(run.blocks)} blocks")
            blocks = torch.tensor(run.blocks, dtype=torch.int64)
            parts.append(blocks[idx // bs] * bs + idx % bs)
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts).to(self.device)

    # ---- chunk caches (Cache-Craft §3) ---------------------------------------------------------
    @torch.inference_mode()
    def copy_rerotated(self, src: KVRun, dst: KVRun, delta: int) -> None:
        """Copy a chunk's KV (every layer) from ``src`` to ``dst`` with its keys moved by ``delta``
        positions (RoPE re-rotation: ``R(p + d) k = R(d) R(p) k``, Cache-Craft §3.4.3).

        Computed in float32 and rounded once to the arena's dtype.

        Args:
            src: where the chunk's KV is (a cached variant's blocks).
            dst: where it goes (the request's blocks), the same length.
            delta: new position minus old position of the chunk's first token, in tokens.

        Raises:
            InvalidRequestError: lengths differ or a run overflows its blocks.
        """
        if src.length != dst.length:
            raise InvalidRequestError(f"copy_rerotated: source has {src.length} tokens, destination {dst.length}")
        if src.length == 0:
            return
        s_slots, d_slots = self.slots([src]), self.slots([dst])
        if delta and native.rerotate_copy_available(self.k_cache) and not set(src.blocks) & set(dst.blocks):
            # each key row read and written once (the same bits as the ops below)
            cos, sin = (t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t for t in self._delta_tables(int(delta)))
            native.rerotate_copy(self.k_cache, self.v_cache, s_slots, d_slots, cos.contiguous(), sin.contiguous())
            return
        k = self.k_cache.index_select(1, s_slots)  # [L, T, Hkv, D]
        if delta:
            cos, sin = self._delta_tables(int(delta))  # [D] or [L, 1, 1, D]
            kf = k.float()
            half = kf.shape[-1] // 2
            rot = torch.cat((-kf[..., half:], kf[..., :half]), dim=-1)
            k = (kf * cos + rot * sin).to(self.dtype)
        self.k_cache.index_copy_(1, d_slots, k)
        self.v_cache.index_copy_(1, d_slots, self.v_cache.index_select(1, s_slots))

    def _delta_tables(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin of a rotation by ``delta`` positions: ``[D]`` for one table, or
        ``[L, 1, 1, D]`` (one row per layer) when the layers' RoPE bases differ."""
        position = torch.full((1,), delta, device=self.device)
        if self.inv_freq.dim() == 1:
            cos, sin = rope_cos_sin(self.inv_freq, position, dtype=torch.float32)
            return cos[0], sin[0]
        tables = [rope_cos_sin(inv, position, dtype=torch.float32) for inv in self.inv_freq]  # L x ([1, D], [1, D])
        cos = torch.cat([c for c, _ in tables])[:, None, None, :]
        sin = torch.cat([s for _, s in tables])[:, None, None, :]
        return cos, sin

    # ---- KVMover (the cache's tiers) -----------------------------------------------------------
    def host_nbytes(self, num_tokens: int) -> int:
        """Bytes a host copy of ``num_tokens`` tokens of KV takes."""
        return self.kv_bytes_per_token * num_tokens

    def swap_out(self, blocks: Sequence[int], num_tokens: int) -> HostKV:
        """Copy a node's KV (the first ``num_tokens`` tokens of ``blocks``) to host memory."""
        slots = self.slots([KVRun(tuple(blocks), 0, num_tokens)])
        k = self.k_cache.index_select(1, slots)
        v = self.v_cache.index_select(1, slots)
        if self.device.type == "cuda":  # one copy, straight into pinned memory (swap_in reads it asynchronously)
            k = torch.empty(k.shape, dtype=k.dtype, pin_memory=True).copy_(k)
            v = torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v)
        return HostKV(k=k, v=v)

    def swap_in(self, host_kv: HostKV, blocks: Sequence[int]) -> None:
        """Copy a host copy back into the given device blocks (the host copy stays: swap out only once)."""
        slots = self.slots([KVRun(tuple(blocks), 0, host_kv.k.shape[1])])
        self.k_cache.index_copy_(1, slots, host_kv.k.to(self.device, non_blocking=True))
        self.v_cache.index_copy_(1, slots, host_kv.v.to(self.device, non_blocking=True))

    def kv_tokens(self, host_kv: HostKV) -> int:
        """Tokens of KV a host copy holds (a tier refuses a copy that does not fit its node)."""
        return int(host_kv.k.shape[1])

    def host_tensors(self, host_kv: HostKV) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU tensors ``(k, v)`` of a host copy, ``[layers, tokens, kv_heads, head_dim]``
        (shared, not copied: the disk tier writes them)."""
        return host_kv.k, host_kv.v

    def host_from_tensors(self, k: torch.Tensor, v: torch.Tensor) -> HostKV:
        """A host copy made of CPU tensors read back from the disk tier.

        Raises:
            InvalidRequestError: shape or dtype not this model's KV.
        """
        want = (self.num_layers, k.shape[1] if k.dim() == 4 else -1, self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want or k.dtype != self.dtype or v.dtype != self.dtype:
            raise InvalidRequestError(f"KV of shape {tuple(k.shape)} {k.dtype} is not this model's {want} {self.dtype}")
        if self.device.type == "cuda":
            k, v = k.pin_memory(), v.pin_memory()
        return HostKV(k=k, v=v)

    def free_host(self, host_kv: HostKV) -> None:
        """Drop a host copy (memory is returned when the last reference goes)."""
        host_kv.k = host_kv.v = torch.empty(0)
