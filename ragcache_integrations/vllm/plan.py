"""What vLLM's scheduler process tells its worker to do with our tiers, one step at a time.

The connector runs in two processes (vLLM's EngineCore runs the scheduler side, each worker the
worker side; on a CPU they are separate processes, so a plan is pickled between them). The
scheduler side decides with plain data (which block goes where); the worker side moves tensors.

A *block* is one vLLM KV block (``block_size`` tokens). Its identity is a path key chained over the
token ids of every block before it (:func:`block_path_keys`, as vLLM's own block hashes and the
knowledge tree's path keys), with the request's ``cache_salt`` and LoRA folded into the first
block; the block's own token ids travel with it and are compared before its KV serves a request
(a key is never trusted alone).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ragcache_backend.cache.knowledge_tree import path_key

__all__ = ["BlockLoad", "BlockSave", "StepPlan", "block_path_keys", "block_segment_key", "host_slots"]


def block_segment_key(tokens: Sequence[int], salt: str) -> str:
    """The segment key of one block: a hash of its token ids (and of ``salt``, non-empty only for the
    first block of a salted request)."""
    digest = hashlib.sha256(b"ragcache-vllm-block-v1\x00")
    digest.update(salt.encode())
    digest.update(b"\x00")
    digest.update(b",".join(str(int(t)).encode() for t in tokens))
    return digest.hexdigest()[:32]


def block_path_keys(tokens: Sequence[int], block_size: int, salt: str = "", start: Sequence[str] = ()) -> list[str]:
    """Path keys of the full blocks of ``tokens`` (``len(tokens) // block_size`` of them).

    Args:
        tokens: the request's token ids (prompt, then output).
        block_size: tokens per block (vLLM's ``cache_config.block_size``).
        salt: the request's isolation salt (``cache_salt`` and LoRA name), "" for none.
        start: keys already computed for the first blocks (extended, not recomputed).
    """
    keys = list(start)
    parent = keys[-1] if keys else ""
    for i in range(len(keys), len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        parent = path_key(parent, block_segment_key(block, salt if i == 0 else ""))
        keys.append(parent)
    return keys


def host_slots(host_budget_bytes: int, block_bytes: int) -> int:
    """Blocks the host tier holds: the slots of the worker's host arena (both sides compute it)."""
    return max(0, host_budget_bytes) // max(1, block_bytes)


@dataclass(slots=True, frozen=True)
class BlockLoad:
    """Copy one block's KV from a tier into vLLM's paged KV before the forward pass.

    Attributes:
        path_key: the block's path key.
        tokens: its token ids (``block_size`` of them; compared with what the tier holds).
        block_id: the vLLM KV block to write.
        tier: where the scheduler found it: ``"host"``, ``"disk"`` or ``"remote"``.
        req_id: the request it is loaded for (load failures are reported per block id).
        slot: its slot in the worker's host arena (``tier == "host"``), else None.
    """

    path_key: str
    tokens: tuple[int, ...]
    block_id: int
    tier: str
    req_id: str
    slot: int | None = None


@dataclass(slots=True, frozen=True)
class BlockSave:
    """Copy one fully computed block's KV out of vLLM's paged KV after the forward pass.

    Attributes:
        path_key, parent, segment: its path key, its parent's ("" for a first block), its segment key.
        tokens: its token ids.
        block_id: the vLLM KV block to read.
        to_host: keep a copy in the host tier (PGDSF admitted it), in ``slot``.
        to_disk: queue a copy for the disk tier (not on disk yet).
        to_remote: queue a copy for the remote tier (not there yet).
        slot: the host arena slot the block is copied to (``to_host``), else None.
        avg_cost: PGDSF cost of the block per token, relative to a block at position 0
            (:mod:`ragcache_integrations.vllm.cost`).
        req_id: the request that computed it (a request whose load failed this step saves nothing:
            its step ran over KV that was never written).
    """

    path_key: str
    parent: str
    segment: str
    tokens: tuple[int, ...]
    block_id: int
    to_host: bool
    to_disk: bool
    avg_cost: float
    req_id: str = ""
    to_remote: bool = False
    slot: int | None = None


@dataclass(slots=True)
class StepPlan:
    """One step's work for the worker side (the connector metadata's payload).

    Attributes:
        loads: blocks to load before the forward pass, in order (a parent before its children).
        saves: blocks to copy out after the forward pass, in order.
        host_drops: path keys the host tier evicts (the scheduler's PGDSF chose them; their slots
            may be written again by this plan's saves).
        new_tokens, attended: what the step computes (tokens; attention pairs), for the worker's
            timing sample (:mod:`ragcache_integrations.vllm.cost`).
    """

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)
    host_drops: list[str] = field(default_factory=list)
    new_tokens: int = 0
    attended: float = 0.0

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.host_drops)
