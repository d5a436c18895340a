"""The model runner: our own forward pass over paged KV blocks.

Only this module touches model tensors. It drives the decoder layers of a transformers
Llama-family model module by module, so that KV lives where *we* put it: a device arena of
fixed-size blocks (``[layers, blocks * block_size, kv_heads, head_dim]`` for K and for V),
addressed by slots ``block * block_size + offset``. A request's context is a list of
:class:`KVRun` (a segment's tokens stored at the start of its own blocks), so a document's KV
computed once can be attended to by any later request whose path reaches it (RAGCache §5.1).

Several sequences run in one forward (continuous batching): the linear layers see all their new
tokens concatenated, attention runs per sequence over its own gathered context.

The runner also implements :class:`ragcache_backend.cache.tiers.KVMover` (swap out to host, swap in).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.kernels import apply_rope, attention, prefix_causal_bias, rope_cos_sin
from ragcache_backend.model.loader import LoadedModel


@dataclass(slots=True, frozen=True)
class KVRun:
    """A run of consecutive tokens stored in device blocks.

    Attributes:
        blocks: block ids; token ``i`` of the run lives at slot
            ``blocks[(start + i) // block_size] * block_size + (start + i) % block_size``.
        start: index of the run's first token within its blocks, in tokens.
        length: number of tokens, >= 0.
    """

    blocks: tuple[int, ...]
    start: int
    length: int


@dataclass(slots=True, frozen=True)
class ForwardInput:
    """One sequence's share of a forward step (plain data from the engine/scheduler).

    Attributes:
        new_tokens: token ids to compute, ``T >= 1``.
        cached: context already in the arena, in order (prefix documents, earlier decode steps).
        target: where the new tokens' KV is written, in order; lengths sum to ``T``.
    """

    new_tokens: tuple[int, ...]
    cached: tuple[KVRun, ...]
    target: tuple[KVRun, ...]


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


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """Bytes of K and V for one token across all layers of ``loaded`` in its dtype."""
    cfg = loaded.model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=loaded.dtype).element_size()


class ModelRunner:
    """Runs prefill and decode for Llama-family models over a paged device KV arena.

    Args:
        loaded: model + tokenizer from :func:`ragcache_backend.model.loader.load_model`.
        num_device_blocks: size of the device arena, in blocks.
        block_size: tokens per block.

    The arena is allocated with ``torch.empty`` up front, so on the CPU memory is committed only
    as blocks get written.
    """

    def __init__(self, loaded: LoadedModel, num_device_blocks: int, block_size: int = 16) -> None:
        cfg = loaded.model.config
        self.loaded = loaded
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.device = loaded.device
        self.dtype = loaded.dtype
        inner = loaded.model.model
        self._embed = inner.embed_tokens
        self._layers = list(inner.layers)
        self._norm = inner.norm
        self._lm_head = loaded.model.lm_head
        self.num_layers = len(self._layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = inner.rotary_emb
        self._inv_freq = rotary.inv_freq.to(self.device, torch.float32)
        self._rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._scale = float(getattr(self._layers[0].self_attn, "scaling", self.head_dim**-0.5))
        shape = (self.num_layers, num_device_blocks * block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k_cache.element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (``block_size`` tokens)."""
        return self.kv_bytes_per_token * self.block_size

    # ---- slots -------------------------------------------------------------------------------
    def slots(self, runs: Sequence[KVRun]) -> torch.Tensor:
        """Flat arena slot of every token of ``runs``, in order: ``[sum(length)]`` int64."""
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

    # ---- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: Sequence[ForwardInput], *, all_logits: bool = False) -> list[torch.Tensor]:
        """Compute the new tokens of every sequence, writing their KV into the arena.

        Returns:
            per sequence, float32 logits: ``[vocab]`` for the last new token, or ``[T, vocab]`` for
            every new token when ``all_logits`` (tests only: costly for long prompts).

        Raises:
            InvalidRequestError: an empty sequence or target runs that do not match ``new_tokens``.
        """
        lengths = [len(item.new_tokens) for item in batch]
        if not batch or min(lengths) < 1:
            raise InvalidRequestError("forward needs at least one sequence with at least one new token")
        ctx_slots, new_slots, positions, biases = [], [], [], []
        for item, n in zip(batch, lengths):
            cached = self.slots(item.cached)
            target = self.slots(item.target)
            if target.numel() != n:
                raise InvalidRequestError(f"target runs hold {target.numel()} slots for {n} new tokens")
            ctx_slots.append(torch.cat([cached, target]) if cached.numel() else None)
            new_slots.append(target)
            start = cached.numel()
            positions.append(torch.arange(start, start + n, device=self.device))
            # causal mask offset by the cached prefix, built once for all layers (decode needs none)
            biases.append(prefix_causal_bias(n, start + n, self.dtype, self.device) if start and n > 1 else None)
        ids = torch.tensor([t for item in batch for t in item.new_tokens], dtype=torch.int64, device=self.device)
        cos, sin = rope_cos_sin(self._inv_freq, torch.cat(positions), attention_scaling=self._rope_scaling, dtype=self.dtype)
        write = torch.cat(new_slots)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        h = self._embed(ids)  # [N, hidden]
        for layer_idx, layer in enumerate(self._layers):
            h = self._layer(layer_idx, layer, h, cos, sin, write, ctx_slots, offsets, biases)
        if all_logits:
            hidden = [h[offsets[i] : offsets[i + 1]] for i in range(len(batch))]
        else:
            hidden = [h[offsets[i + 1] - 1 : offsets[i + 1]] for i in range(len(batch))]
        logits = self._lm_head(self._norm(torch.cat(hidden))).float()
        out, pos = [], 0
        for chunk in hidden:
            out.append(logits[pos : pos + chunk.shape[0]] if all_logits else logits[pos])
            pos += chunk.shape[0]
        return out

    def _layer(self, idx, layer, h, cos, sin, write, ctx_slots, offsets, biases) -> torch.Tensor:
        attn = layer.self_attn
        n = h.shape[0]
        x = layer.input_layernorm(h)
        q = apply_rope(attn.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)  # [N, Hq, D]
        k = apply_rope(attn.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)  # [N, Hkv, D]
        v = attn.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        kc, vc = self.k_cache[idx], self.v_cache[idx]  # [slots, Hkv, D]
        kc.index_copy_(0, write, k)
        vc.index_copy_(0, write, v)
        outs = []
        for i, slots in enumerate(ctx_slots):
            lo, hi = offsets[i], offsets[i + 1]
            if slots is None:  # cold prefill: attend over the fresh K/V directly
                outs.append(attention(q[lo:hi], k[lo:hi], v[lo:hi], scale=self._scale))
            else:
                outs.append(attention(q[lo:hi], kc.index_select(0, slots), vc.index_select(0, slots), scale=self._scale,
                                      mask=biases[i]))
        a = torch.cat(outs) if len(outs) > 1 else outs[0]
        h = h + attn.o_proj(a.reshape(n, self.num_heads * self.head_dim))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    # ---- KVMover (tiers) -----------------------------------------------------------------------
    def host_nbytes(self, num_tokens: int) -> int:
        """Bytes a host copy of ``num_tokens`` tokens of KV takes."""
        return self.kv_bytes_per_token * num_tokens

    def swap_out(self, blocks: Sequence[int], num_tokens: int) -> HostKV:
        """Copy a node's KV (the first ``num_tokens`` tokens of ``blocks``) to host memory."""
        slots = self.slots([KVRun(tuple(blocks), 0, num_tokens)])
        k = self.k_cache.index_select(1, slots)
        v = self.v_cache.index_select(1, slots)
        if self.device.type == "cuda":
            k, v = k.to("cpu").pin_memory(), v.to("cpu").pin_memory()
        return HostKV(k=k, v=v)

    def swap_in(self, host_kv: HostKV, blocks: Sequence[int]) -> None:
        """Copy a host copy back into the given device blocks (the host copy stays: swap out only once)."""
        slots = self.slots([KVRun(tuple(blocks), 0, host_kv.k.shape[1])])
        self.k_cache.index_copy_(1, slots, host_kv.k.to(self.device, non_blocking=True))
        self.v_cache.index_copy_(1, slots, host_kv.v.to(self.device, non_blocking=True))

    def free_host(self, host_kv: HostKV) -> None:
        """Drop a host copy (memory is returned when the last reference goes)."""
        host_kv.k = host_kv.v = torch.empty(0)

    # ---- profiling -------------------------------------------------------------------------------
    def time_prefill(self, cached: int, new: int) -> float:
        """Seconds to prefill ``new`` tokens on top of ``cached`` tokens (offline profile, RAGCache §5.1).

        Uses the arena's first blocks as scratch: call only while no request holds KV.
        """
        need = -(-(cached + new) // self.block_size)
        if need > self.num_device_blocks:
            raise InvalidRequestError(f"profile point ({cached}, {new}) needs {need} blocks, arena has {self.num_device_blocks}")
        blocks = tuple(range(need))
        vocab = self._embed.num_embeddings
        gen = torch.Generator().manual_seed(cached * 7919 + new)
        toks = torch.randint(0, vocab, (cached + new,), generator=gen).tolist()
        if cached:
            self.forward([ForwardInput(tuple(toks[:cached]), (), (KVRun(blocks, 0, cached),))])
        item = ForwardInput(tuple(toks[cached:]), (KVRun(blocks, 0, cached),) if cached else (), (KVRun(blocks, cached, new),))
        t0 = time.perf_counter()
        self.forward([item])
        return time.perf_counter() - t0
