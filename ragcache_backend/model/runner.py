"""The model runner: our own forward pass over paged KV blocks.

Only the model package touches model tensors. The runner puts its parts together and turns a batch
of :class:`~ragcache_backend.model.forward.ForwardInput` into logits:

* :class:`~ragcache_backend.model.arena.KVArena` (:mod:`~ragcache_backend.model.arena`): the device
  arena of fixed-size blocks (``[layers, blocks * block_size, kv_heads, head_dim]`` for K and for
  V), addressed by slots ``block * block_size + offset``. A request's context is a list of
  :class:`~ragcache_backend.cache.blocks.KVRun` (a segment's tokens stored at the start of its own
  blocks), so a document's KV computed once can be attended to by any later request whose path
  reaches it (RAGCache §5.1). The arena is also the cache's mover (``runner.arena``).
* :class:`~ragcache_backend.model.llama.PagedLlama` (:mod:`~ragcache_backend.model.llama`): the
  decoder layers, reading and writing KV in the arena.
* :mod:`~ragcache_backend.model.forward`: the plain data in and out of a step, and the step's rows.

Several sequences run in one forward (continuous batching): the linear layers see all their new
tokens concatenated, attention runs per sequence over its own gathered context.

Chunk-cache reuse (Cache-Craft §3.2-3.4) adds three things, all plain data in and out: new tokens at
any positions inside a context (the recomputed tokens of a reused chunk), attention statistics per
context segment (eq. 3-4, recorded while a chunk is computed), and the deviation of recomputed KV
from the values it replaced (the quality guard). A chunk's KV moves to a new position with
:meth:`ModelRunner.copy_rerotated` (RoPE re-rotation by the position delta).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence

import torch

from ragcache_backend.cache.blocks import KVRun
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.arena import HostKV, KVArena
from ragcache_backend.model.chunk_rows import ChunkRows
from ragcache_backend.model.forward import MAX_STAT_SEGMENTS, ForwardInput, SegmentAttention, StepOutput, StepRows
from ragcache_backend.model.kernels import attention_plan
from ragcache_backend.model.kernels.linear import ROWS_BY_CLASS, step_rows
from ragcache_backend.model.llama import PagedLlama
from ragcache_backend.model.loader import LoadedModel

__all__ = ["MAX_STAT_SEGMENTS", "ForwardInput", "HostKV", "KVRun", "ModelRunner", "SegmentAttention", "StepOutput",
           "kv_bytes_per_token"]


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
        num_device_blocks: size of the KV arena, in blocks (on a CPU with a shared pool, the device
            tier's blocks and the host tier's).
        block_size: tokens per block.
        committed_blocks: blocks committed at construction (the device tier's); None: all.

    The arena's device part is allocated (and touched) up front: its memory is committed at construction.

    Attributes:
        arena: the device KV arena (:class:`~ragcache_backend.model.arena.KVArena`), also the
            cache's mover.
        layers: the decoder (:class:`~ragcache_backend.model.llama.PagedLlama`).
    """

    def __init__(self, loaded: LoadedModel, num_device_blocks: int, block_size: int = 16,
                 committed_blocks: int | None = None) -> None:
        self.loaded = loaded
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.layers = PagedLlama(loaded)  # fuses the weights first: their temporaries never meet a full arena
        self.num_layers = self.layers.num_layers
        self.arena = KVArena(self.num_layers, num_device_blocks, block_size, self.layers.num_kv_heads,
                             self.layers.head_dim, self.dtype, self.device, self._rerotation_freq(), committed_blocks)

    def _rerotation_freq(self) -> torch.Tensor:
        """What the arena re-rotates keys with: the one RoPE table (``[D/2]``), or one per layer
        (``[L, D/2]``) when the layers' bases differ (Gemma 3: local vs global layers)."""
        if len(self.layers.arch.ropes) == 1:
            return self.layers.inv_freq
        return self.layers.layer_inv_freq

    # ---- the arena's and the layers' names, kept on the runner ---------------------------------
    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.arena.block_size

    @property
    def num_device_blocks(self) -> int:
        """Size of the device arena, in blocks."""
        return self.arena.num_blocks

    @property
    def k_cache(self) -> torch.Tensor:
        """The arena's K, ``[layers, blocks * block_size, kv_heads, head_dim]``."""
        return self.arena.k_cache

    @property
    def v_cache(self) -> torch.Tensor:
        """The arena's V, ``[layers, blocks * block_size, kv_heads, head_dim]``."""
        return self.arena.v_cache

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers."""
        return self.arena.kv_bytes_per_token

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (``block_size`` tokens)."""
        return self.arena.block_bytes

    @property
    def vocab_size(self) -> int:
        """Width of a logits row (the model's vocabulary, tokens)."""
        return self.layers.vocab_size

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)``: the shape of one token's K (or V) across layers."""
        return self.arena.kv_layout

    def slots(self, runs: Sequence[KVRun]) -> torch.Tensor:
        """Flat arena slot of every token of ``runs``, in order (:meth:`KVArena.slots`)."""
        return self.arena.slots(runs)

    def copy_rerotated(self, src: KVRun, dst: KVRun, delta: int) -> None:
        """Copy a chunk's KV from ``src`` to ``dst`` with its keys moved by ``delta`` positions
        (:meth:`KVArena.copy_rerotated`, Cache-Craft §3.4.3)."""
        self.arena.copy_rerotated(src, dst, delta)

    @property
    def native_attention(self) -> bool:
        """Attention runs on a native kernel (float32 AVX2 or bf16 AVX512-BF16)."""
        return self.layers.native_attention

    @property
    def native_fused(self) -> bool:
        """The row-wise steps between the GEMMs run fused too."""
        return self.layers.native_fused

    @property
    def kernel_tag(self) -> str:
        """Which forward path runs: ``native-fused``, ``native-attention`` or ``torch``."""
        return self.layers.kernel_tag

    @property
    def stat_layers(self) -> frozenset[int]:
        """Layers whose attention statistics are recorded (``stat_segments``); all by default."""
        return self.layers.stat_layers

    @stat_layers.setter
    def stat_layers(self, layers: frozenset[int]) -> None:
        self.layers.stat_layers = layers

    def sample_stat_layers(self, count: int) -> None:
        """Record attention statistics on ``count`` evenly spaced layers (:meth:`PagedLlama.sample_stat_layers`).

        Raises:
            InvalidRequestError: ``count < 1``.
        """
        self.layers.sample_stat_layers(count)

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
                positions that are not ascending inside the context, statistics or guard segments
                that do not cover the context (or more than :data:`MAX_STAT_SEGMENTS`), bad row selections, or
                ``all_logits`` with row selections.
        """
        lengths = [len(item.new_tokens) for item in batch]
        if not batch or min(lengths) < 1:
            raise InvalidRequestError("forward needs at least one sequence with at least one new token")
        if all_logits and any(item.blend or item.focus for item in batch):
            raise InvalidRequestError("all_logits cannot be combined with rows that stop part-way")
        decode = [self._as_decode(item) for item in batch]
        st = StepRows(self.num_layers, self.layers.native_attention, self.device, list(lengths), torch.empty(0),
                      torch.empty(0), [], [], [], decode, [], native_positions=self.layers.native_positions)
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
                st.modes.append(attention_plan(start, n, self.dtype, self.device, decode=decode[idx]))
                st.context.append(ctx)
            if item.chunk_rows:
                blend = item.blend
                if blend is not None and blend.layer > self.num_layers - 2:  # rows must stop before the last layer
                    blend = dataclasses.replace(blend, layer=max(0, self.num_layers - 2))
                chunk = ChunkRows.create(idx, row, n, ctx, pos, explicit, item.stat_segments, item.guard, blend,
                                         item.focus, self.dtype, MAX_STAT_SEGMENTS, guard_segments=item.guard_segments)
                st.chunks.append(chunk)
                new_slots.append(chunk.write)
            else:
                new_slots.append(ctx[ctx.numel() - n:])
            positions.append(pos)
            row += n
        st.write, st.positions = torch.cat(new_slots), torch.cat(positions)
        st.plan_native()
        ids = torch.tensor([t for item in batch for t in item.new_tokens], dtype=torch.int64, device=self.device)
        h = self.layers.embed(ids)  # [N, hidden]
        # generated tokens' rows take the whole-step decode's GEMM in any step (their bits then do
        # not depend on what else the step holds); on AMX CPUs the GEMMs treat prompt rows apart too
        with step_rows(st.classify_rows()) if ROWS_BY_CLASS or any(st.decode) else contextlib.nullcontext():
            normed = self.layers.run(h, st, self.arena, last_rows=not all_logits)  # [B or N, hidden]
        offsets = st.offsets
        logits = self.layers.logits(normed)
        per_seq = [logits[offsets[i] : offsets[i + 1]] for i in range(len(batch))] if all_logits else list(logits)
        out = StepOutput(per_seq, [None] * len(batch), [None] * len(batch), [None] * len(batch), [0] * len(batch),
                         [None] * len(batch))
        for c in st.chunks:
            if c.mass is not None:
                mass = c.mass / (len(self.stat_layers) * self.layers.num_kv_heads)  # one query head per KV head
                out.attention[c.index] = SegmentAttention(tuple(tuple(r) for r in mass.tolist()))
            if c.guard:
                out.deviation[c.index] = tuple((c.deviation / c.dev_layers.clamp_min(1)).tolist())
            if c.last_mass is not None:
                out.last_mass[c.index] = tuple((c.last_mass / (self.num_layers * self.layers.num_kv_heads)).tolist())
            if c.blend is not None or c.focus is not None:
                out.depth[c.index] = tuple(c.stopped.get(r, self.num_layers) for r in range(lengths[c.index]))
            out.focus_layer[c.index] = c.focus_layer
        return out

    def _as_decode(self, item: ForwardInput) -> bool:
        """Whether ``item``'s row runs as a generated token's: a decode step, or (float32 on the native
        fused path) a prompt's one new token over a cached context with no chunk-cache extras (a full
        cache hit's last token; a prompt chunk the step's token budget cut to one token). Such a row
        takes the generated tokens' few-row GEMM and decode attention kernel, so in a step of up to
        64 sequences its bits no longer depend on what shares the step (as a prompt row it took
        oneDNN's GEMM in a step of more than 64 prompt rows; beyond 64 sequences the last layer's
        GEMMs over one row per sequence take oneDNN, for generated tokens too). A step of such rows
        and decodes then runs as one whole-step decode instead of the per-operation path, which read
        the weights twice (the 200-client cold burst of ``benchmarks/serve_load.py``, 2-core Zen 3,
        2026-11-29: a step of one or two such rows and six or seven decodes took 110-200 ms, a step
        of eight decodes 77 ms). Against the prompt kernels the row's logits move by float32
        rounding only."""
        if item.decode:
            return True
        return (len(item.new_tokens) == 1 and self.dtype == torch.float32 and self.layers.native_fused
                and sum(run.length for run in item.cached) > 0 and not item.chunk_rows)

    # ---- profiling -------------------------------------------------------------------------------
    def time_prefill(self, cached: int, new: int) -> float:
        """Seconds to prefill ``new`` tokens on top of ``cached`` tokens (offline profile, RAGCache §5.1).

        Uses the arena's first blocks as scratch: call only while no request holds KV.

        Raises:
            InvalidRequestError: the profile point needs more blocks than the arena has.
        """
        need = -(-(cached + new) // self.block_size)
        if need > self.num_device_blocks:
            raise InvalidRequestError(f"profile point ({cached}, {new}) needs {need} blocks, arena has {self.num_device_blocks}")
        blocks = tuple(range(need))
        vocab = self.layers.vocab_size
        gen = torch.Generator().manual_seed(cached * 7919 + new)
        toks = torch.randint(0, vocab, (cached + new,), generator=gen).tolist()
        if cached:
            self.forward([ForwardInput(tuple(toks[:cached]), (), (KVRun(blocks, 0, cached),))])
        item = ForwardInput(tuple(toks[cached:]), (KVRun(blocks, 0, cached),) if cached else (), (KVRun(blocks, cached, new),))
        t0 = time.perf_counter()
        self.forward([item])
        return time.perf_counter() - t0
