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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.kernels import apply_rope, attention, attention_over_prefix, attention_plan, native, rope_cos_sin
from ragcache_backend.model.kernels.linear import Linear, pack_linear
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
        decode: the one new token is a generated token (decode kernel), not a prompt token
            (prompt tokens always take the prefill kernels, for bf16 exactness).
    """

    new_tokens: tuple[int, ...]
    cached: tuple[KVRun, ...]
    target: tuple[KVRun, ...]
    decode: bool = False


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


@dataclass(slots=True)
class _LayerWeights:
    """One decoder layer's weights as the runner uses them: Q/K/V and gate/up fused into one GEMM
    each (the module's own parameters become views of the fused tensors), every GEMM's weight
    prepacked for oneDNN on the CPU (:mod:`ragcache_backend.model.kernels.linear`)."""

    qkv: Linear  # [(Hq + 2 Hkv) * D, hidden]
    o_proj: Linear
    gate_up: Linear  # [2 * intermediate, hidden]
    down_proj: Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    norm_shape: tuple[int, ...]
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float


def _fuse(linears: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` along their output dimension and make
    each module's parameters views of the result."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in linears])
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[row : row + rows], requires_grad=False)
        if m.bias is not None:
            m.bias = torch.nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    return weight, bias


def _fuse_layer(layer: torch.nn.Module) -> _LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
    if gate_up_bias is not None:
        raise InvalidRequestError("MLP biases are not supported by the runner")
    return _LayerWeights(
        qkv=pack_linear(qkv, qkv_bias), o_proj=pack_linear(attn.o_proj.weight, attn.o_proj.bias), gate_up=pack_linear(gate_up),
        down_proj=pack_linear(mlp.down_proj.weight, mlp.down_proj.bias), act=mlp.act_fn,
        norm_shape=(layer.input_layernorm.weight.shape[0],),
        input_norm=layer.input_layernorm.weight, input_eps=float(layer.input_layernorm.variance_epsilon),
        post_norm=layer.post_attention_layernorm.weight, post_eps=float(layer.post_attention_layernorm.variance_epsilon),
    )


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

    The arena is allocated (and touched) up front: its memory is committed at construction.
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
        layers = list(inner.layers)
        self._norm = inner.norm
        head = loaded.model.lm_head
        self._lm_head = pack_linear(head.weight, head.bias)
        self.num_layers = len(layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = inner.rotary_emb
        self._inv_freq = rotary.inv_freq.to(self.device, torch.float32)
        self._rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._scale = float(getattr(layers[0].self_attn, "scaling", self.head_dim**-0.5))
        self._weights = [_fuse_layer(layer) for layer in layers]
        shape = (self.num_layers, num_device_blocks * block_size, self.num_kv_heads, self.head_dim)
        # zeros, not empty: the arena is committed up front (a bounded budget, as vLLM's), so the
        # first write to a block never pays the page faults of lazily committed memory
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # bf16 on an AVX512-BF16 CPU: attention reads the arena directly (no per-layer gather) and
        # every row is computed alone, so cached and uncached prompts agree bit for bit
        group = self.num_heads // self.num_kv_heads
        self.native_attention = native.available(self.dtype, self.device, self.head_dim, group)
        # ... and the row-wise steps between the GEMMs run fused (RoPE + KV write, add + RMSNorm,
        # SiLU * up): a decode step of a small model is mostly the dispatch of those small ops
        self.native_fused = self.native_attention and getattr(cfg, "hidden_act", "") == "silu" and native.fused_available(
            self.dtype, self.device, hidden=cfg.hidden_size, intermediate=self._weights[0].gate_up.weight.shape[0] // 2,
            head_dim=self.head_dim, group=group)
        self._final_norm = (self._norm.weight.detach(), float(getattr(self._norm, "variance_epsilon", getattr(self._norm, "eps", 1e-6))))

    @property
    def kernel_tag(self) -> str:
        """Which forward path runs: ``native-fused``, ``native-attention`` or ``torch`` (prefill
        costs, and bf16 roundings, differ between them)."""
        return "native-fused" if self.native_fused else "native-attention" if self.native_attention else "torch"

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
        cached_slots, new_slots, positions, modes, context = [], [], [], [], []
        for item, n in zip(batch, lengths):
            cached = self.slots(item.cached)
            target = self.slots(item.target)
            if target.numel() != n:
                raise InvalidRequestError(f"target runs hold {target.numel()} slots for {n} new tokens")
            cached_slots.append(cached if cached.numel() else None)
            new_slots.append(target)
            start = cached.numel()
            positions.append(torch.arange(start, start + n, device=self.device))
            modes.append(attention_plan(start, n, self.dtype, self.device, decode=item.decode))
            if self.native_attention:
                context.append(torch.cat((cached, target)) if cached.numel() else target)
        ids = torch.tensor([t for item in batch for t in item.new_tokens], dtype=torch.int64, device=self.device)
        write = torch.cat(new_slots)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        h = self._embed(ids)  # [N, hidden]
        rows = torch.arange(offsets[-1]) if all_logits else torch.tensor(offsets[1:]) - 1
        rows = rows.to(self.device)
        step = native.attention_batch(context, lengths, [item.decode for item in batch]) if self.native_attention else None
        if self.native_fused:
            normed = self._layers_fused(h, write, step, torch.cat(positions)).index_select(0, rows)
        else:
            cos, sin = rope_cos_sin(self._inv_freq, torch.cat(positions), attention_scaling=self._rope_scaling, dtype=self.dtype)
            for layer_idx in range(self.num_layers):
                h = self._layer(layer_idx, h, cos, sin, write, cached_slots, offsets, modes, step)
            normed = self._norm(h.index_select(0, rows))
        logits = self._lm_head(normed).float()
        if all_logits:
            return [logits[offsets[i] : offsets[i + 1]] for i in range(len(batch))]
        return list(logits)

    def _layers_fused(self, h, write, step, positions) -> torch.Tensor:
        """Every decoder layer with the native bf16 kernels; ``h`` (the residual stream) is
        updated in place. Returns the final-normed hidden states ``[N, hidden]``."""
        n, hq, hkv, d = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope_cos_sin(self._inv_freq, positions, attention_scaling=self._rope_scaling, dtype=torch.float32)
        h = h.contiguous()
        x = native.add_rms_norm(h, None, self._weights[0].input_norm, self._weights[0].input_eps)
        a = torch.empty((n, hq, d), dtype=self.dtype)
        for idx, w in enumerate(self._weights):
            kc, vc = self.k_cache[idx], self.v_cache[idx]
            qkv = w.qkv(x).view(n, hq + 2 * hkv, d)
            native.rope_write(qkv, hq, hkv, cos, sin, kc, vc, write)
            native.paged_attention(qkv[:, :hq], kc, vc, step, self._scale, out=a)
            x = native.add_rms_norm(h, w.o_proj(a.view(n, hq * d)), w.post_norm, w.post_eps)
            down = w.down_proj(native.silu_mul(w.gate_up(x)))
            if idx + 1 < len(self._weights):
                x = native.add_rms_norm(h, down, self._weights[idx + 1].input_norm, self._weights[idx + 1].input_eps)
            else:
                x = native.add_rms_norm(h, down, *self._final_norm)
        return x

    def _layer(self, idx, h, cos, sin, write, cached_slots, offsets, modes, step) -> torch.Tensor:
        w = self._weights[idx]
        n = h.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        x = F.rms_norm(h, w.norm_shape, w.input_norm, w.input_eps)
        qkv = w.qkv(x).view(n, hq + 2 * hkv, self.head_dim)  # one GEMM for Q, K, V
        qk = apply_rope(qkv[:, : hq + hkv], cos, sin)  # RoPE on Q and K heads at once
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]  # [N, Hq, D], [N, Hkv, D], [N, Hkv, D]
        kc, vc = self.k_cache[idx], self.v_cache[idx]  # [slots, Hkv, D]
        kc.index_copy_(0, write, k)
        vc.index_copy_(0, write, v)
        if step is not None:  # native kernel: the whole step at once, straight over the arena
            a = native.paged_attention(q, kc, vc, step, self._scale)
        else:
            outs = []
            for i, slots in enumerate(cached_slots):
                lo, hi = offsets[i], offsets[i + 1]
                if slots is None:  # cold prefill: attend over the fresh K/V directly
                    outs.append(attention(q[lo:hi], k[lo:hi], v[lo:hi], scale=self._scale))
                else:  # the cached context from the arena, then this step's fresh K/V (no re-gather)
                    ctx_k = torch.cat((kc.index_select(0, slots), k[lo:hi]))
                    ctx_v = torch.cat((vc.index_select(0, slots), v[lo:hi]))
                    outs.append(attention_over_prefix(q[lo:hi], ctx_k, ctx_v, scale=self._scale, plan=modes[i]))
            a = torch.cat(outs) if len(outs) > 1 else outs[0]
        h = h + w.o_proj(a.reshape(n, hq * self.head_dim))
        x = F.rms_norm(h, w.norm_shape, w.post_norm, w.post_eps)
        gate, up = w.gate_up(x).chunk(2, dim=-1)  # one GEMM for gate and up
        return h + w.down_proj(w.act(gate) * up)

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
