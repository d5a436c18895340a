"""vLLM's paged KV layouts the connector copies, and how a block maps to the tiers' ``(k, v)`` format.

vLLM hands a KV connector one tensor per attention layer whose first dimension is the block id
(``register_kv_caches``). vLLM 0.32's backends use two shapes (the same two its own offloading
connector recognises, ``offloading/canonical_mapping.py``):

- **packed** ``[num_blocks, kv_heads, block_size, 2 * head_size]``: the CPU backend and, on GPUs,
  FlashAttention, FlashInfer, Triton and FlexAttention. On a GPU each (head, token) row holds K
  then V (``kv_cache.transpose(1, 2).split(head_size, -1)`` in ``flash_attn.py``); on the CPU each head's
  block holds its ``block_size`` K rows then its V rows (``cpu_attn.py`` views the block as
  ``[kv_heads, 2 * block_size, head_size]``), packed inside in an ISA-dependent order, which is why
  the CPU's ISA is part of the connector's fingerprint.
- **split** ``[num_blocks, 2, block_size, kv_heads, head_size]``: K and V in separate page halves
  (ROCm's AITER FlashAttention and unified attention, the HPC backend).

A tensor may be a permuted view of its storage (vLLM's stride orders, HND or NHD): blocks are
always selected along dimension 0, which copies correctly whatever the strides.

The tiers (disk, Redis) store a block as ``k, v`` of shape ``[layers, block_size, kv_heads,
head_size]``. :meth:`BlockLayout.to_kv` and :meth:`BlockLayout.from_kv` are exact inverses, so a
block's bytes round-trip unchanged in every layout; on GPUs ``k`` and ``v`` are the true keys and
values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ragcache_backend.errors import RAGCacheError

__all__ = ["BlockLayout", "KVLayoutError"]

LayoutKind = Literal["packed_cpu", "packed", "split"]


class KVLayoutError(RAGCacheError):
    """vLLM's KV tensors have a shape the connector does not copy."""


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """One layer's block in vLLM's KV tensors.

    Attributes:
        kind: ``packed_cpu`` (CPU backend), ``packed`` (GPU FlashAttention, FlashInfer, Triton,
            Flex) or ``split`` (ROCm AITER, HPC); see the module docstring.
        block_shape: one block of one layer, as the tensor's dimensions after the first.
        block_size: tokens per block.
        kv_heads: KV heads in this worker's tensors.
        head_size: elements per head (the packed layouts' last dimension is twice it).
    """

    kind: LayoutKind
    block_shape: tuple[int, ...]
    block_size: int
    kv_heads: int
    head_size: int

    @classmethod
    def detect(cls, tensor: torch.Tensor, block_size: int, *, kv_heads: int | None = None,
               head_size: int | None = None, platform: str | None = None) -> BlockLayout:
        """The layout of one of vLLM's per-layer KV tensors.

        Args:
            tensor: ``[num_blocks, ...]`` as vLLM registered it.
            block_size: vLLM's tokens per block.
            kv_heads, head_size: the model's (this worker's shard), when known: a tensor whose
                dimensions differ (a padded head, another model) is refused rather than copied.
            platform: ``cpu`` or another device type; decides how a packed block holds K and V
                (default: the tensor's device).

        Raises:
            KVLayoutError: neither shape, or dimensions that contradict ``kv_heads``/``head_size``.
        """
        shape = tuple(int(d) for d in tensor.shape)
        platform = platform or tensor.device.type
        if len(shape) == 4 and shape[2] == block_size and shape[3] % 2 == 0:
            kind: LayoutKind = "packed_cpu" if platform == "cpu" else "packed"
            heads, hs = shape[1], shape[3] // 2
        elif len(shape) == 5 and shape[1] == 2 and shape[2] == block_size:
            kind, heads, hs = "split", shape[3], shape[4]
        else:
            raise KVLayoutError(
                f"KV tensor of shape {shape}: the ragcache connector copies [num_blocks, kv_heads, "
                f"block_size={block_size}, 2*head_size] (CPU, FlashAttention, FlashInfer, Triton, FlexAttention) "
                f"or [num_blocks, 2, block_size={block_size}, kv_heads, head_size] (ROCm AITER, HPC)")
        if (kv_heads is not None and heads != kv_heads) or (head_size is not None and hs != head_size):
            raise KVLayoutError(f"KV tensor of shape {shape} does not hold {kv_heads} KV heads of size {head_size} "
                                f"(a padded or foreign layout is not copied)")
        return cls(kind, shape[1:], block_size, heads, hs)

    def disk_layout(self, num_layers: int) -> tuple[int, int, int]:
        """The tiers' ``(layers, kv_heads, head_size)``."""
        return (num_layers, self.kv_heads, self.head_size)

    def to_kv(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[layers, *block_shape]`` -> ``(k, v)``, each ``[layers, block_size, kv_heads, head_size]``,
        as views (the tiers' writers make them contiguous in their own threads)."""
        layers = block.shape[0]
        if self.kind == "packed_cpu":
            halves = block.reshape(layers, self.kv_heads, 2, self.block_size, self.head_size)  # a view
            return halves[:, :, 0].permute(0, 2, 1, 3), halves[:, :, 1].permute(0, 2, 1, 3)
        if self.kind == "packed":
            return (block[..., :self.head_size].permute(0, 2, 1, 3), block[..., self.head_size:].permute(0, 2, 1, 3))
        return block[:, 0], block[:, 1]

    def from_kv(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_kv`: a contiguous ``[layers, *block_shape]``."""
        layers = k.shape[0]
        if self.kind == "packed_cpu":
            both = torch.stack([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)], dim=2)  # [layers, heads, 2, bs, hs]
            return both.reshape(layers, *self.block_shape)
        if self.kind == "packed":
            return torch.cat([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)], dim=-1)  # cat: a new contiguous tensor
        return torch.stack([k, v], dim=1)
