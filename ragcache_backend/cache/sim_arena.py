"""A simulated KV arena: tiny CPU tensors behind the cache's KVMover protocol, and no model.

It lets anything drive the cache core with token ids alone (the example
``examples/cache_core.py``, the tier contract suite, a connector's dry run): each token's "KV"
is its token id (K) and minus its token id (V), ``[layers, tokens, heads, dim]`` float32, so a
caller can "prefill" blocks with :meth:`SimArena.write`, let the cache move them between device,
host and disk, and check with :meth:`SimArena.read` that exactly the right tokens came back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragcache_backend.cache.disk import DiskStore

__all__ = ["HostCopy", "SimArena", "disk_store"]

LAYERS, HEADS, DIM = 2, 1, 2


@dataclass(slots=True)
class HostCopy:
    """A host copy: ``k``, ``v`` are ``[layers, tokens, heads, dim]`` float32."""

    k: torch.Tensor
    v: torch.Tensor


class SimArena:
    """``num_blocks`` blocks of ``block_size`` tokens (the device tier's arena) and the host copies
    made from it; copies counted in ``swap_outs`` / ``swap_ins``, live host copies in ``live``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (LAYERS, num_blocks * block_size, HEADS, DIM)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.swap_outs = self.swap_ins = self.live = 0

    def _slots(self, blocks: Sequence[int], n: int) -> torch.Tensor:
        idx = torch.arange(n)
        return torch.tensor(list(blocks), dtype=torch.int64)[idx // self.block_size] * self.block_size + idx % self.block_size

    # ---- a stand-in for the forward pass ------------------------------------------------------
    def write(self, blocks: Sequence[int], tokens: Sequence[int]) -> None:
        """Store ``tokens``' "KV" in ``blocks`` (what a prefill does)."""
        slots = self._slots(blocks, len(tokens))
        t = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1, 1).expand(LAYERS, -1, HEADS, DIM)
        self.k.index_copy_(1, slots, t)
        self.v.index_copy_(1, slots, -t)

    def read(self, blocks: Sequence[int], n: int) -> list[int]:
        """The tokens whose KV the first ``n`` slots of ``blocks`` hold (checks K and V agree)."""
        slots = self._slots(blocks, n)
        k, v = self.k[:, slots], self.v[:, slots]
        assert torch.equal(k, -v) and bool((k == k[:1, :, :1, :1]).all()), "KV does not belong to one token"
        return [int(x) for x in k[0, :, 0, 0]]

    # ---- the KVMover protocol -----------------------------------------------------------------
    def swap_out(self, blocks: Sequence[int], num_tokens: int) -> HostCopy:
        slots = self._slots(blocks, num_tokens)
        self.swap_outs += 1
        self.live += 1
        return HostCopy(self.k.index_select(1, slots), self.v.index_select(1, slots))

    def swap_in(self, host_kv: HostCopy, blocks: Sequence[int]) -> None:
        slots = self._slots(blocks, host_kv.k.shape[1])
        self.k.index_copy_(1, slots, host_kv.k)
        self.v.index_copy_(1, slots, host_kv.v)
        self.swap_ins += 1

    def host_nbytes(self, num_tokens: int) -> int:
        return 2 * LAYERS * HEADS * DIM * 4 * num_tokens

    def kv_tokens(self, host_kv: HostCopy) -> int:
        return int(host_kv.k.shape[1])

    def free_host(self, host_kv: HostCopy) -> None:
        self.live -= 1

    def host_tensors(self, host_kv: HostCopy) -> tuple[torch.Tensor, torch.Tensor]:
        return host_kv.k, host_kv.v

    def host_from_tensors(self, k: torch.Tensor, v: torch.Tensor) -> HostCopy:
        assert tuple(k.shape[::2]) == (LAYERS, HEADS) and k.dtype == torch.float32
        self.live += 1
        return HostCopy(k, v)

    @staticmethod
    def tokens_of(host_kv: HostCopy) -> list[int]:
        return [int(x) for x in host_kv.k[0, :, 0, 0]]


def disk_store(root, budget_bytes: int, fingerprint: str = "sim-arena") -> DiskStore:
    """A :class:`~ragcache_backend.cache.disk.DiskStore` for :class:`SimArena` copies."""
    return DiskStore(root, fingerprint, (LAYERS, HEADS, DIM), torch.float32, budget_bytes)
