"""The model runner: our own forward pass over paged KV blocks.

Only this module touches model tensors. It drives the decoder layers of a transformers
Llama-family model module by module, so that KV lives where *we* put it: a device arena of
fixed-size blocks (``[layers, blocks * block_size, kv_heads, head_dim]`` for K and for V),
addressed by slots ``block * block_size + offset``. A request's context is a list of
:class:`KVRun` (a segment's tokens stored at the start of its own blocks), so a document's KV
computed once can be attended to by any later request whose path reaches it (RAGCache §5.1).

Several sequences run in one forward (continuous batching): the linear layers see all their new
tokens concatenated, attention runs per sequence over its own gathered context.

Chunk-cache reuse (Cache-Craft §3.2-3.4) adds three things, all plain data in and out: new tokens at
any positions inside a context (the recomputed tokens of a reused chunk), attention statistics per
context segment (eq. 3-4, recorded while a chunk is computed), and the deviation of recomputed KV
from the values it replaced (the quality guard). A chunk's KV moves to a new position with
:meth:`ModelRunner.copy_rerotated` (RoPE re-rotation by the position delta).

The runner also implements :class:`ragcache_backend.cache.tiers.KVMover` (swap out to host, swap in).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.kernels import (
    apply_rope,
    attention,
    attention_over_prefix,
    attention_plan,
    native,
    rope_cos_sin,
)
from ragcache_backend.model.chunk_rows import BlendSelection, ChunkRows, FocusSelection
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
            With ``positions``: the *whole* context in position order, the new tokens' slots included.
        target: where the new tokens' KV is written, in order; lengths sum to ``T``. Empty with
            ``positions``.
        decode: the one new token is a generated token (decode kernel), not a prompt token
            (prompt tokens always take the prefill kernels, for bf16 exactness).
        positions: ascending positions of the new tokens inside the context (``< S``), or None for
            the ``T`` positions after ``cached``. Token ``i`` is written at the slot of position
            ``positions[i]`` and attends to positions ``0 .. positions[i]`` (chunk-cache
            recomputation: the other positions hold reused KV).
        stat_segments: lengths (tokens) of consecutive context segments, summing to the context
            length, or None. When given, every new token's attention mass to each segment is
            recorded (Cache-Craft eq. 3-4), averaged over the runner's ``stat_layers`` and one query
            head per KV head (:attr:`StepOutput.attention`). At most 64 segments.
        guard: measure, for every new token, how far its new K/V moved from the values its slot
            held before the write (:attr:`StepOutput.deviation`; the quality guard's signal).
        blend: stop most reused-chunk rows after an early layer, keeping those whose K/V deviate
            most (CacheBlend-style selection; :class:`~ragcache_backend.model.chunk_rows.BlendSelection`).
        focus: stop the recomputed rows of chunks the question does not focus on, once Algorithm 1
            decides (:class:`~ragcache_backend.model.chunk_rows.FocusSelection`).
    """

    new_tokens: tuple[int, ...]
    cached: tuple[KVRun, ...]
    target: tuple[KVRun, ...]
    decode: bool = False
    positions: tuple[int, ...] | None = None
    stat_segments: tuple[int, ...] | None = None
    guard: bool = False
    blend: BlendSelection | None = None
    focus: FocusSelection | None = None


@dataclass(slots=True, frozen=True)
class SegmentAttention:
    """Attention mass of a sequence's new tokens to each context segment (Cache-Craft eq. 3-4).

    Attributes:
        mass: per new token (in ``new_tokens`` order), per segment of ``stat_segments``: the
            softmax weight it gave that segment's keys, averaged over the recorded layers and one
            query head of each KV group (the first); each row sums to 1 (float32 arithmetic).
    """

    mass: tuple[tuple[float, ...], ...]


@dataclass(slots=True, frozen=True)
class StepOutput:
    """What one forward step returns, per sequence in batch order.

    Attributes:
        logits: float32 ``[vocab]`` for the last new token (``[T, vocab]`` with ``all_logits``).
        attention: :class:`SegmentAttention` where the input asked for ``stat_segments``, else None.
        deviation: where the input asked for ``guard``: per new token, the relative change of its
            K and V from the values its slot held before the write, ``||new - old|| / ||old||``
            averaged over the layers it was computed in (0 for a slot that held zeros); else None.
        depth: per sequence with ``blend`` or ``focus``, the layers each new token was computed in
            (``num_layers`` unless it stopped part-way); None otherwise.
        focus_layer: per sequence, ``L*``: the layers after which Algorithm 1 decided (0: it did not).
    """

    logits: list[torch.Tensor]
    attention: list[SegmentAttention | None]
    deviation: list[tuple[float, ...] | None]
    depth: list[tuple[int, ...] | None] = field(default_factory=list)
    focus_layer: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Step:
    """One forward step's row bookkeeping, updated when rows stop part-way (runner-internal)."""

    lengths: list[int]  # rows per sequence now
    write: torch.Tensor  # [N] slots
    positions: torch.Tensor  # [N]
    cached_slots: list  # ordinary sequences' cached context (None: cold, or explicit positions)
    modes: list  # ordinary sequences' attention plans (None: explicit positions)
    context: list  # ordinary sequences' whole context (native kernel)
    decode: list[bool]
    chunks: list  # ChunkRows
    native_batch: object | None = None  # the native kernel's batch over the ordinary sequences
    native_rows: torch.Tensor | None = None  # their rows in the step (None: every row is theirs)
    rope: dict = field(default_factory=dict)  # dtype -> (cos, sin) for ``positions``

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out


MAX_STAT_SEGMENTS = 64
"""Most attention-statistics segments one sequence may ask for."""


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
        #: layers whose attention statistics are recorded (``stat_segments``); all by default
        self.stat_layers: frozenset[int] = frozenset(range(self.num_layers))

    def sample_stat_layers(self, count: int) -> None:
        """Record attention statistics on ``count`` evenly spaced layers (the first and last
        included) instead of all: the statistics' reference computation costs about as much as the
        attention itself on the torch path, and layer averages (Cache-Craft eq. 10) move little.

        Raises:
            InvalidRequestError: ``count < 1``.
        """
        if count < 1:
            raise InvalidRequestError(f"at least one statistics layer is needed, got {count}")
        n, k = self.num_layers, min(count, self.num_layers)
        self.stat_layers = frozenset(round(i * (n - 1) / max(1, k - 1)) for i in range(k))

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
            InvalidRequestError: see :meth:`forward_step`.
        """
        return self.forward_step(batch, all_logits=all_logits).logits

    @torch.inference_mode()
    def forward_step(self, batch: Sequence[ForwardInput], *, all_logits: bool = False) -> StepOutput:
        """:meth:`forward` with the chunk-cache extras (attention statistics, KV deviation, rows
        that stop part-way).

        Raises:
            InvalidRequestError: an empty sequence, target runs that do not match ``new_tokens``,
                positions that are not ascending inside the context, statistics segments that do not
                cover the context (or more than :data:`MAX_STAT_SEGMENTS`), bad row selections, or
                ``all_logits`` with row selections.
        """
        lengths = [len(item.new_tokens) for item in batch]
        if not batch or min(lengths) < 1:
            raise InvalidRequestError("forward needs at least one sequence with at least one new token")
        if all_logits and any(item.blend or item.focus for item in batch):
            raise InvalidRequestError("all_logits cannot be combined with rows that stop part-way")
        st = _Step(list(lengths), torch.empty(0), torch.empty(0), [], [], [], [item.decode for item in batch], [])
        new_slots, positions, row = [], [], 0
        for idx, (item, n) in enumerate(zip(batch, lengths)):
            cached = self.slots(item.cached)
            explicit = item.positions is not None
            if explicit:
                if item.target or item.decode:
                    raise InvalidRequestError("a sequence with explicit positions has no target runs and is not a decode step")
                pos = torch.tensor(item.positions, dtype=torch.int64)
                if pos.numel() != n or int(pos.min()) < 0 or int(pos.max()) >= cached.numel() or bool((pos.diff() <= 0).any()):
                    raise InvalidRequestError(f"{n} new tokens need ascending positions inside a context of {cached.numel()} tokens")
                ctx, pos = cached, pos.to(self.device)
                st.cached_slots.append(None)
                st.modes.append(None)
                st.context.append(None)
            else:
                target = self.slots(item.target)
                if target.numel() != n:
                    raise InvalidRequestError(f"target runs hold {target.numel()} slots for {n} new tokens")
                start = cached.numel()
                pos = torch.arange(start, start + n, device=self.device)
                ctx = torch.cat((cached, target)) if cached.numel() else target
                st.cached_slots.append(cached if cached.numel() else None)
                st.modes.append(attention_plan(start, n, self.dtype, self.device, decode=item.decode))
                st.context.append(ctx)
            if explicit or item.stat_segments is not None or item.guard or item.blend or item.focus:
                blend = item.blend
                if blend is not None and blend.layer > self.num_layers - 2:  # rows must stop before the last layer
                    blend = dataclasses.replace(blend, layer=max(0, self.num_layers - 2))
                chunk = ChunkRows.create(idx, row, n, ctx, pos, explicit, item.stat_segments, item.guard, blend,
                                         item.focus, self.dtype, MAX_STAT_SEGMENTS)
                st.chunks.append(chunk)
                new_slots.append(chunk.write)
            else:
                new_slots.append(ctx[ctx.numel() - n:])
            positions.append(pos)
            row += n
        st.write, st.positions = torch.cat(new_slots), torch.cat(positions)
        self._native_plan(st)
        ids = torch.tensor([t for item in batch for t in item.new_tokens], dtype=torch.int64, device=self.device)
        h = self._embed(ids)  # [N, hidden]
        if self.native_fused:
            normed = self._layers_fused(h, st)
        else:
            for layer_idx in range(self.num_layers):
                h = self._layer(layer_idx, h, st)
                h = self._stop_rows(st, layer_idx, h)[0]
            normed = h
        offsets = st.offsets
        rows = torch.arange(offsets[-1]) if all_logits else torch.tensor(offsets[1:]) - 1
        normed = normed.index_select(0, rows.to(self.device))
        if not self.native_fused:
            normed = self._norm(normed)
        logits = self._lm_head(normed).float()
        per_seq = [logits[offsets[i] : offsets[i + 1]] for i in range(len(batch))] if all_logits else list(logits)
        out = StepOutput(per_seq, [None] * len(batch), [None] * len(batch), [None] * len(batch), [0] * len(batch))
        for c in st.chunks:
            if c.mass is not None:
                mass = c.mass / (len(self.stat_layers) * self.num_kv_heads)  # one query head per KV head
                out.attention[c.index] = SegmentAttention(tuple(tuple(r) for r in mass.tolist()))
            if c.guard:
                out.deviation[c.index] = tuple((c.deviation / c.dev_layers.clamp_min(1)).tolist())
            if c.blend is not None or c.focus is not None:
                out.depth[c.index] = tuple(c.stopped.get(r, self.num_layers) for r in range(lengths[c.index]))
            out.focus_layer[c.index] = c.focus_layer
        return out

    def _native_plan(self, st: _Step) -> None:
        """The native kernel's batch over the ordinary sequences (explicit positions take the torch path)."""
        st.native_batch = st.native_rows = None
        if not self.native_attention:
            return
        explicit = {c.index for c in st.chunks if c.explicit}
        plain = [i for i in range(len(st.lengths)) if i not in explicit]
        if not plain:
            return
        offsets = st.offsets
        st.native_batch = native.attention_batch([st.context[i] for i in plain], [st.lengths[i] for i in plain],
                                                 [st.decode[i] for i in plain])
        if len(plain) < len(st.lengths):
            st.native_rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in plain])

    def _stop_rows(self, st: _Step, layer: int, *rows_tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """After ``layer``: drop the rows that stop (blend, focus) from the step and from each of
        ``rows_tensors`` (``[N, ...]``: the residual stream, the next layer's input)."""
        stops = {c.index: c.rows_to_stop(layer) for c in st.chunks if c.blend is not None or c.focus is not None}
        if not any(stops.values()) or layer + 1 >= self.num_layers:
            return rows_tensors
        offsets = st.offsets
        keep_global, new_lengths = [], list(st.lengths)
        for i, n in enumerate(st.lengths):
            drop = set(stops.get(i, ()))
            local = [r for r in range(n) if r not in drop]
            keep_global.extend(offsets[i] + r for r in local)
            new_lengths[i] = len(local)
        keep = torch.tensor(keep_global, device=self.device)
        st.lengths = new_lengths
        st.write = st.write.index_select(0, keep)
        st.positions = st.positions.index_select(0, keep)
        st.rope.clear()
        new_offsets = st.offsets
        for c in st.chunks:
            drop = set(stops.get(c.index, ()))
            local = torch.tensor([r for r in range(c.hi - c.lo) if r not in drop], dtype=torch.int64, device=self.device)
            c.keep(local, new_offsets[c.index], layer + 1)
        self._native_plan(st)
        return tuple(t.index_select(0, keep) for t in rows_tensors)

    def _rope_tables(self, st: _Step, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for the step's rows, built once (and again after rows stop)."""
        if dtype not in st.rope:
            st.rope[dtype] = rope_cos_sin(self._inv_freq, st.positions, attention_scaling=self._rope_scaling, dtype=dtype)
        return st.rope[dtype]

    def _chunks_after_write(self, st: _Step, old: list, q, kc, vc, a, layer: int) -> None:
        stat_layer = layer in self.stat_layers
        for c, before in zip(st.chunks, old):
            c.after_write(before, q, kc, vc, a, layer, self._scale, attention, stat_layer)

    def _layers_fused(self, h: torch.Tensor, st: _Step) -> torch.Tensor:
        """Every decoder layer with the native bf16 kernels; ``h`` (the residual stream) is
        updated in place. Returns the final-normed hidden states ``[N, hidden]``."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self._rope_tables(st, torch.float32)
        h = h.contiguous()
        x = native.add_rms_norm(h, None, self._weights[0].input_norm, self._weights[0].input_eps)
        a = torch.empty((h.shape[0], hq, d), dtype=self.dtype)
        for idx, w in enumerate(self._weights):
            n = h.shape[0]
            if a.shape[0] != n:  # rows stopped after the last layer
                a = torch.empty((n, hq, d), dtype=self.dtype)
            kc, vc = self.k_cache[idx], self.v_cache[idx]
            qkv = w.qkv(x).view(n, hq + 2 * hkv, d)
            old = [c.before_write(kc, vc, idx) for c in st.chunks]
            native.rope_write(qkv, hq, hkv, cos, sin, kc, vc, st.write)
            self._attend_native(qkv[:, :hq], kc, vc, st, a)
            if st.chunks:
                self._chunks_after_write(st, old, qkv[:, :hq], kc, vc, a, idx)
            x = native.add_rms_norm(h, w.o_proj(a.view(n, hq * d)), w.post_norm, w.post_eps)
            down = w.down_proj(native.silu_mul(w.gate_up(x)))
            if idx + 1 < len(self._weights):
                x = native.add_rms_norm(h, down, self._weights[idx + 1].input_norm, self._weights[idx + 1].input_eps)
                if st.chunks:
                    before = h.shape[0]
                    h, x = self._stop_rows(st, idx, h, x)
                    if h.shape[0] != before:
                        h, x = h.contiguous(), x.contiguous()
                        cos, sin = self._rope_tables(st, torch.float32)
            else:
                x = native.add_rms_norm(h, down, *self._final_norm)
        return x

    def _attend_native(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, st: _Step, a: torch.Tensor) -> None:
        """The native kernel over the step's ordinary sequences."""
        if st.native_batch is None:
            return
        if st.native_rows is None:
            native.paged_attention(q, kc, vc, st.native_batch, self._scale, out=a)
        else:
            a[st.native_rows] = native.paged_attention(q.index_select(0, st.native_rows), kc, vc, st.native_batch, self._scale)

    def _layer(self, idx: int, h: torch.Tensor, st: _Step) -> torch.Tensor:
        w = self._weights[idx]
        n = h.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        cos, sin = self._rope_tables(st, self.dtype)
        x = F.rms_norm(h, w.norm_shape, w.input_norm, w.input_eps)
        qkv = w.qkv(x).view(n, hq + 2 * hkv, self.head_dim)  # one GEMM for Q, K, V
        qk = apply_rope(qkv[:, : hq + hkv], cos, sin)  # RoPE on Q and K heads at once
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]  # [N, Hq, D], [N, Hkv, D], [N, Hkv, D]
        kc, vc = self.k_cache[idx], self.v_cache[idx]  # [slots, Hkv, D]
        old = [c.before_write(kc, vc, idx) for c in st.chunks]
        kc.index_copy_(0, st.write, k)
        vc.index_copy_(0, st.write, v)
        if st.native_batch is not None and st.native_rows is None:  # native kernel: the whole step at once
            a = native.paged_attention(q, kc, vc, st.native_batch, self._scale)
        else:
            a = torch.empty((n, hq, self.head_dim), dtype=q.dtype, device=q.device)
            self._attend_native(q, kc, vc, st, a)
            offsets = st.offsets
            for i, slots in enumerate(st.cached_slots):
                lo, hi = offsets[i], offsets[i + 1]
                if st.modes[i] is None or st.native_batch is not None:  # explicit positions (below), or done natively
                    continue
                if slots is None:  # cold prefill: attend over the fresh K/V directly
                    a[lo:hi] = attention(q[lo:hi], k[lo:hi], v[lo:hi], scale=self._scale)
                else:  # the cached context from the arena, then this step's fresh K/V (no re-gather)
                    ctx_k = torch.cat((kc.index_select(0, slots), k[lo:hi]))
                    ctx_v = torch.cat((vc.index_select(0, slots), v[lo:hi]))
                    a[lo:hi] = attention_over_prefix(q[lo:hi], ctx_k, ctx_v, scale=self._scale, plan=st.modes[i])
        if st.chunks:
            self._chunks_after_write(st, old, q, kc, vc, a, idx)
        h = h + w.o_proj(a.reshape(n, hq * self.head_dim))
        x = F.rms_norm(h, w.norm_shape, w.post_norm, w.post_eps)
        gate, up = w.gate_up(x).chunk(2, dim=-1)  # one GEMM for gate and up
        return h + w.down_proj(w.act(gate) * up)

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
        k = self.k_cache.index_select(1, s_slots)  # [L, T, Hkv, D]
        if delta:
            cos, sin = rope_cos_sin(self._inv_freq, torch.full((1,), int(delta), device=self.device), dtype=torch.float32)
            kf = k.float()
            half = kf.shape[-1] // 2
            rot = torch.cat((-kf[..., half:], kf[..., :half]), dim=-1)
            k = (kf * cos[0] + rot * sin[0]).to(self.dtype)
        self.k_cache.index_copy_(1, d_slots, k)
        self.v_cache.index_copy_(1, d_slots, self.v_cache.index_select(1, s_slots))

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

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)``: the shape of one token's K (or V) across layers."""
        return self.num_layers, self.num_kv_heads, self.head_dim

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
