"""The Llama decoder math over the paged KV arena: our own forward pass, layer by layer.

:class:`PagedLlama` drives the decoder layers of a transformers Llama-family model module by module,
so that KV lives where *we* put it: every layer writes its new K/V into a
:class:`~ragcache_backend.model.arena.KVArena` it is given and attends over the slots of each
sequence's context there (RAGCache §5.1).

Several sequences run in one forward (continuous batching): the linear layers see all their new
tokens concatenated (Q/K/V and gate/up fused into one GEMM each, every weight prepacked for oneDNN
on the CPU), attention runs per sequence over its own context.

Two paths, picked once per model and logged (:attr:`PagedLlama.kernel_tag`): the torch path
(reference kernels of :mod:`ragcache_backend.model.kernels`), and the native kernels (paged
attention straight over the arena; with SiLU models also the fused row-wise steps) in float32 on
any x86 CPU with AVX2 and FMA, or in bf16 on one with AVX512-BF16.

What differs between the supported families (Qwen3's and Gemma 3's QK-norm, Gemma's ``(1 + w)``
RMSNorm, four norms per layer, GeGLU, scaled embeddings, sliding-window layers with their own RoPE
base) is read from one :class:`~ragcache_backend.model.arch.ArchSpec`; the native kernels run only
what they implement (:func:`~ragcache_backend.model.arch.native_gaps`), the torch path the rest.

Chunk-cache sequences (Cache-Craft §3.2-3.4) hook into every layer through their
:class:`~ragcache_backend.model.chunk_rows.ChunkRows` (statistics, deviation, rows that stop
part-way: :meth:`~ragcache_backend.model.forward.StepRows.stop_rows`). Their rows at explicit
positions inside the context (recomputed tokens of reused chunks) take the native kernel (float32 or
bf16) with the other rows (:attr:`PagedLlama.native_positions`), else a masked torch attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.arch import ArchSpec, describe, native_gaps
from ragcache_backend.model.arena import KVArena
from ragcache_backend.model.forward import StepRows
from ragcache_backend.model.heap import keep_activation_pages
from ragcache_backend.model.kernels import (AttentionPlan, apply_rope, attention, attention_over_prefix, attention_plan, native,
                                            rope_cos_sin)
from ragcache_backend.model.kernels.linear import Linear, pack_linear
from ragcache_backend.model.kernels.memory import huge_page_empty, to_huge_pages
from ragcache_backend.model.loader import LoadedModel

__all__ = ["PagedLlama"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _LayerWeights:
    """One decoder layer's weights as the runner uses them: Q/K/V and gate/up fused into one GEMM
    each (the module's own parameters become views of the fused tensors), every GEMM's weight
    prepacked for oneDNN on the CPU (:mod:`ragcache_backend.model.kernels.linear`).

    A norm's weight is what it multiplies the normalised rows by: the module's weight, or for a
    ``(1 + w)`` family (Gemma) ``1 + w`` in float32. ``input_norm`` is the attention's input norm,
    ``post_norm`` the MLP's input norm (Llama's ``post_attention_layernorm``, Gemma's
    ``pre_feedforward_layernorm``); ``attn_out_norm`` / ``mlp_out_norm`` are Gemma 3's norms on the
    attention and MLP outputs, ``q_norm`` / ``k_norm`` the per-head ``[head_dim]`` QK-norms
    (weight, eps), None where the family has none. ``window`` is the layer's sliding window (None:
    full attention) and ``rope`` its RoPE table (an index into ``ArchSpec.ropes``)."""

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
    attn_out_norm: tuple[torch.Tensor, float] | None = None
    mlp_out_norm: tuple[torch.Tensor, float] | None = None
    q_norm: tuple[torch.Tensor, float] | None = None
    k_norm: tuple[torch.Tensor, float] | None = None
    window: int | None = None
    rope: int = 0


def _fuse(linears: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` along their output dimension and make
    each module's parameters views of the result."""
    parts = [m.weight.detach() for m in linears]
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    # on the CPU in huge pages: the rows kernel streams these weights every decode step
    weight = huge_page_empty(shape, parts[0].dtype) if parts[0].device.type == "cpu" else parts[0].new_empty(shape)
    torch.cat(parts, out=weight)
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


def _rehome(module: torch.nn.Module) -> None:
    """Move a module's weight into huge-page memory on the CPU (:mod:`~ragcache_backend.model.kernels.memory`)."""
    module.weight = torch.nn.Parameter(to_huge_pages(module.weight.detach()), requires_grad=False)


def _norm_weights(norm: torch.nn.Module, offset: bool) -> tuple[torch.Tensor, float]:
    """``(multiplier, eps)`` of an RMSNorm module: its weight, or ``1 + weight`` in float32 for a
    ``(1 + w)`` family (transformers' ``Gemma3RMSNorm`` computes ``1.0 + self.weight.float()``)."""
    weight = norm.weight.detach()
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    return (1.0 + weight.float() if offset else weight), eps


def _fuse_layer(layer: torch.nn.Module, spec: ArchSpec, idx: int) -> _LayerWeights:
    """Decoder layer ``idx``'s :class:`_LayerWeights` (its Q/K/V and gate/up modules become views).

    Raises:
        InvalidRequestError: the MLP has biases.
    """
    attn, mlp = layer.self_attn, layer.mlp
    offset, family = spec.family.norm_offset, spec.family
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
    _rehome(attn.o_proj)
    _rehome(mlp.down_proj)
    if gate_up_bias is not None:
        raise InvalidRequestError("MLP biases are not supported by the runner")
    input_norm, input_eps = _norm_weights(layer.input_layernorm, offset)
    # the MLP's input norm: Gemma 3 names it pre_feedforward (its post_attention norms the attention output)
    post_norm, post_eps = _norm_weights(layer.pre_feedforward_layernorm if family.sandwich_norms
                                        else layer.post_attention_layernorm, offset)
    return _LayerWeights(
        qkv=pack_linear(qkv, qkv_bias), o_proj=pack_linear(attn.o_proj.weight, attn.o_proj.bias), gate_up=pack_linear(gate_up),
        down_proj=pack_linear(mlp.down_proj.weight, mlp.down_proj.bias), act=mlp.act_fn,
        norm_shape=(layer.input_layernorm.weight.shape[0],),
        input_norm=input_norm, input_eps=input_eps, post_norm=post_norm, post_eps=post_eps,
        attn_out_norm=_norm_weights(layer.post_attention_layernorm, offset) if family.sandwich_norms else None,
        mlp_out_norm=_norm_weights(layer.post_feedforward_layernorm, offset) if family.sandwich_norms else None,
        q_norm=_norm_weights(attn.q_norm, offset) if family.qk_norm else None,
        k_norm=_norm_weights(attn.k_norm, offset) if family.qk_norm else None,
        window=spec.windows[idx], rope=spec.layer_rope[idx],
    )


class PagedLlama:
    """The embedding, decoder layers, final norm and LM head of a Llama-family model, computed over
    a paged KV arena.

    Args:
        loaded: model + tokenizer from :func:`ragcache_backend.model.loader.load_model`; its Q/K/V
            and gate/up parameters become views of fused tensors.

    Raises:
        InvalidRequestError: the model's MLP has biases.
        ModelLoadError: an architecture or feature we do not run (:func:`~ragcache_backend.model.arch.describe`).

    Attributes:
        arch: what this model's forward pass does (:class:`~ragcache_backend.model.arch.ArchSpec`).
        num_layers, num_heads, num_kv_heads, head_dim: the model's attention geometry.
        inv_freq: float32 ``[head_dim / 2]`` RoPE inverse frequencies on the model's device (the
            global layers'; :attr:`layer_inv_freq` has every layer's).
        native_attention: attention runs on the native kernel (float32 AVX2 or bf16 AVX512-BF16).
        native_fused: the row-wise steps between the GEMMs run fused too.
        native_positions: rows at explicit positions (chunk-cache recomputation) run on the native
            attention kernel too; settable, see the property.
        stat_layers: layers whose attention statistics are recorded (``stat_segments``).
    """

    def __init__(self, loaded: LoadedModel) -> None:
        cfg = loaded.model.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        if self.device.type == "cpu":  # activations stay on the heap between steps (model/heap.py)
            keep_activation_pages()
        self.arch = describe(loaded.model)
        inner = loaded.model.model
        self._embed = inner.embed_tokens
        layers = list(inner.layers)
        self._norm = inner.norm
        head = loaded.model.lm_head
        tied = head.weight is self._embed.weight
        head.weight = torch.nn.Parameter(to_huge_pages(head.weight.detach()), requires_grad=False)
        if tied:  # the embedding is the LM head's matrix: one copy, still shared
            self._embed.weight = head.weight
        self._lm_head = pack_linear(head.weight, head.bias, per_step=False, picked_rows=True)  # one row per sequence
        self.num_layers = len(layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._ropes = tuple((r.inv_freq.to(self.device), r.attention_scaling) for r in self.arch.ropes)
        self.inv_freq, self._rope_scaling = self._ropes[0]
        self._scale = self.arch.attn_scale
        self._embed_scale = (None if self.arch.embed_scale is None  # transformers multiplies in the model dtype
                             else torch.tensor(self.arch.embed_scale, dtype=torch.float32).to(self.device, self.dtype))
        self._weights = [_fuse_layer(layer, self.arch, i) for i, layer in enumerate(layers)]
        # float32 on an AVX2 CPU, bf16 on an AVX512-BF16 one: attention reads the arena directly (no
        # per-layer gather) for the whole step, and every prompt row is computed alone
        group = self.num_heads // self.num_kv_heads
        why_not = native.unavailable_reason(self.dtype, self.device, self.head_dim, group)
        self.native_attention = why_not is None
        # ... and the row-wise steps between the GEMMs run fused (RoPE + KV write, add + RMSNorm,
        # SiLU * up): a decode step of a small model is mostly the dispatch of those small ops
        self.native_fused = self.native_attention and getattr(cfg, "hidden_act", "") == "silu" and native.fused_available(
            self.dtype, self.device, hidden=cfg.hidden_size, intermediate=self._weights[0].gate_up.weight.shape[0] // 2,
            head_dim=self.head_dim, group=group)
        self._final_norm = _norm_weights(self._norm, self.arch.family.norm_offset)
        gaps = self._gate_native()
        if self.native_attention:
            log.info("forward path: %s (%s kernels on %s)%s", self.kernel_tag, str(self.dtype).removeprefix("torch."),
                     native.instruction_set(self.dtype), f"; row-wise steps on torch ({gaps})" if gaps else "")
        else:
            log.info("forward path: torch (%s)", gaps or why_not)
        #: layers whose attention statistics are recorded (``stat_segments``); all by default
        self.stat_layers: frozenset[int] = frozenset(range(self.num_layers))
        #: decode-only steps run every layer in one native call (None: not available)
        self._decode_plan = self._build_decode_plan()
        self._native_positions = self.native_attention and native.takes_positions(self.dtype)
        #: float32 native fused path: the last layer's attention, o_proj and MLP run only for the rows
        #: whose logits are taken (see :meth:`run`); settable for A/B runs and tests
        self.last_layer_pruning = self.native_fused and self.dtype == torch.float32

    @property
    def native_positions(self) -> bool:
        """Whether rows at explicit positions inside their context (the recomputed tokens of reused
        chunks) run on the native attention kernel with the step's other rows (float32 or bf16);
        False: a masked torch attention computes them (``ChunkRows.after_write``)."""
        return self._native_positions

    @native_positions.setter
    def native_positions(self, on: bool) -> None:
        """Send explicit-position rows to the torch path (for A/B runs and tests) or back to the kernel.

        Raises:
            ValueError: turned on where the native kernel cannot take them (no native attention, or
                a dtype whose kernel takes no positions).
        """
        if on and not (self.native_attention and native.takes_positions(self.dtype)):
            raise ValueError(f"explicit positions on the native kernel need native attention that takes them ({self.dtype})")
        self._native_positions = bool(on)

    @property
    def whole_step_decode(self) -> bool:
        """Whether decode-only steps run every layer in one native call (float32: ``rc32_decode_step``,
        the per-operation kernels' bits; bf16: ``rc_decode_step``, its own few-row GEMM); False: the
        per-operation kernels (or the torch path) run them."""
        return self._decode_plan is not None

    @whole_step_decode.setter
    def whole_step_decode(self, on: bool) -> None:
        """Turn whole-step decode off (for A/B runs and tests: in float32 the per-operation kernels
        give the same bits) or back on.

        Raises:
            ValueError: turned on where it cannot run (not the native fused path, float32 or bf16).
        """
        plan = self._build_decode_plan() if on else None
        if on and plan is None:
            raise ValueError("whole-step decode needs the native fused path (float32 or bf16 native kernels)")
        self._decode_plan = plan

    def _gate_native(self) -> str:
        """Turn off the native kernels where this architecture needs what they do not implement
        (:func:`~ragcache_backend.model.arch.native_gaps`): the torch path runs it instead.
        Returns what is missing, for the path's log line ("" when nothing is)."""
        gaps = native_gaps(self.arch)
        why = ""
        if self.native_attention and gaps.attention:
            why = f"{self.arch.model_type}: the native attention lacks {', '.join(gaps.attention)}"
            self.native_attention = False
        elif self.native_fused and gaps.fused:
            why = f"{self.arch.model_type}: the fused steps lack {', '.join(gaps.fused)}"
            self.native_fused = False
        elif self.native_attention and not self.native_fused:
            why = "hidden or MLP size not a multiple of what the fused kernels tile"
        self.native_fused = self.native_fused and self.native_attention
        return why

    @property
    def gemms_on_amx(self) -> bool:
        """Whether every layer GEMM runs on our AMX GEMM (bf16 on CPUs with AMX; each row's bits its
        own): a step's prompt rows and generated tokens' rows alike, and the whole-step decode's
        GEMMs (:attr:`~ragcache_backend.model.kernels.linear.Linear.amx`)."""
        return all(lin.amx is not None for w in self._weights for lin in (w.qkv, w.o_proj, w.gate_up, w.down_proj))

    @property
    def layer_inv_freq(self) -> torch.Tensor:
        """float32 ``[layers, head_dim / 2]`` RoPE inverse frequencies of every layer, on the
        model's device (Gemma 3's local layers have their own base): what re-rotation uses."""
        return self.arch.layer_inv_freq.to(self.device)

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
    def lm_head(self) -> Linear:
        """The LM head: ``[R, hidden]`` final-normed rows -> ``[R, vocab]`` in the model dtype (its
        kernel choice is :class:`~ragcache_backend.model.kernels.linear.Linear`'s fields, which an A/B
        run may set)."""
        return self._lm_head

    @property
    def kernel_tag(self) -> str:
        """Which forward path runs: ``native-fused``, ``native-attention`` or ``torch`` (prefill
        costs, and bf16 roundings, differ between them)."""
        return "native-fused" if self.native_fused else "native-attention" if self.native_attention else "torch"

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding."""
        return self._embed.num_embeddings

    # ---- the step: embed -> layers -> logits -------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: int64 ``[N]`` on the model's device -> ``[N, hidden]`` in the model's
        dtype, times the architecture's embedding scale (Gemma: ``sqrt(hidden)`` rounded to the
        model dtype, as ``Gemma3TextScaledWordEmbedding``)."""
        h = F.embedding(ids, self._embed.weight)
        return h if self._embed_scale is None else h * self._embed_scale

    def run(self, h: torch.Tensor, st: StepRows, arena: KVArena, *, last_rows: bool = False) -> torch.Tensor:
        """Every decoder layer over the step's rows, writing their K/V into ``arena`` and dropping
        the rows that stop part-way (``st`` shrinks with them).

        Args:
            h: ``[N, hidden]`` embeddings of the step's rows (updated in place on the native fused path).
            last_rows: return only each sequence's last row (the one its logits come from). On the
                float32 native fused path (:attr:`last_layer_pruning`), a step of prompt rows
                without chunk-cache rows then runs the last layer's attention, ``o_proj`` and MLP
                for those rows only: every row's K/V is still written, and nothing after the last
                layer's K/V write reads the other rows (~1/num_layers of a prefill's work saved).
                A prompt row's attention is the same bits alone as in its whole prompt (the
                kernel's row independence); its three GEMMs run over ``B`` rows (the few-row
                kernel up to 64 sequences), in a cold prompt as in a cached one, so the two stay
                alike; against running every row the logits move by float32 rounding only.

        Returns:
            ``[N', hidden]`` hidden states of the rows still computed, or ``[B, hidden]`` (one per
            sequence) with ``last_rows``: final-normed on the native fused path
            (:attr:`native_fused`), else not (:meth:`logits` norms them).
        """
        if self.native_fused:
            if self._decode_plan is not None and self._whole_step_decodes(st):
                return self._decode_step_native(h, st, arena)  # one row per sequence already
            prune = last_rows and self.last_layer_pruning and not st.chunks and len(st.lengths) < h.shape[0]
            h = self._layers_fused(h, st, arena, prune_last=prune)
            if prune:
                return h
        else:
            for layer_idx in range(self.num_layers):
                h = self._layer(layer_idx, h, st, arena)
                h = st.stop_rows(layer_idx, h)[0]
        if not last_rows or all(n == 1 for n in st.lengths):
            return h
        return h.index_select(0, st.last_rows())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[R, vocab]`` of ``[R, hidden]`` rows of :meth:`run` (the final norm,
        unless :meth:`run` applied it, then the LM head)."""
        if not self.native_fused:
            h = self._norm(h)
        logits = self._lm_head(h).float()
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap  # final_logit_softcapping

    # ---- layers --------------------------------------------------------------------------------
    def _rope_tables(self, st: StepRows, dtype: torch.dtype, kind: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables ``(cos, sin)`` ``[N, D]`` of table ``kind`` (``ArchSpec.ropes``) for the
        step's rows, built once (and again after rows stop)."""
        key = dtype if kind == 0 else (dtype, kind)
        if key not in st.rope:
            inv_freq, scaling = self._ropes[kind]
            st.rope[key] = rope_cos_sin(inv_freq, st.positions, attention_scaling=scaling, dtype=dtype)
        return st.rope[key]

    def _chunks_after_write(self, st: StepRows, old: list, q, kc, vc, a, layer: int) -> None:
        stat_layer = layer in self.stat_layers
        window = self._weights[layer].window
        for c, before in zip(st.chunks, old):
            c.after_write(before, q, kc, vc, a, layer, self._scale, attention, stat_layer, window=window)

    def _rms(self, x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        """RMSNorm of ``x`` ``[..., d]`` over its last dimension by ``norm`` = (multiplier ``[d]``,
        eps): Llama's ``w * x̂`` in the model dtype, or for a ``(1 + w)`` family (Gemma) ``x̂ (1 + w)``
        computed in float32 and rounded once (``Gemma3RMSNorm``)."""
        weight, eps = norm
        if self.arch.family.norm_offset:
            return (F.rms_norm(x.float(), weight.shape, None, eps) * weight).to(x.dtype)
        return F.rms_norm(x, weight.shape, weight, eps)

    def _window_plan(self, st: StepRows, i: int, window: int) -> AttentionPlan:
        """Sequence ``i``'s attention plan in a layer with a sliding window (built once per step)."""
        key = (i, window)
        if key not in st.windowed:
            base = st.modes[i]
            st.windowed[key] = attention_plan(base.num_cached, base.num_new, self.dtype, self.device,
                                              decode=base.decode, window=window)
        return st.windowed[key]

    def _attend_window(self, i: int, q, k, v, kc, vc, st: StepRows, window: int) -> torch.Tensor:
        """Sequence ``i``'s rows ``q`` ``[T, Hq, D]`` (fresh ``k``, ``v`` ``[T, Hkv, D]``) in a
        sliding-window layer: only the cached keys inside some query's window are gathered."""
        plan = self._window_plan(st, i, window)
        slots = st.cached_slots[i]
        if slots is not None and plan.num_cached:
            slots = slots[plan.skip:]
            k, v = torch.cat((kc.index_select(0, slots), k)), torch.cat((vc.index_select(0, slots), v))
        return attention_over_prefix(q, k, v, scale=self._scale, plan=plan)

    def _build_decode_plan(self) -> native.DecodePlan | None:
        """The layers as one native decode step reads them (None: not the native fused path)."""
        if not self.native_fused:
            return None
        ws = self._weights
        nexts = [(ws[i + 1].input_norm, ws[i + 1].input_eps) for i in range(len(ws) - 1)] + [self._final_norm]
        return native.decode_plan([
            native.DecodeLayer(w.qkv.weight, w.qkv.bias, w.o_proj.weight, w.o_proj.bias, w.gate_up.weight, w.down_proj.weight,
                               w.down_proj.bias, w.post_norm, w.post_eps, nxt[0], nxt[1],
                               w.qkv.amx, w.o_proj.amx, w.gate_up.amx, w.down_proj.amx)
            for w, nxt in zip(ws, nexts)])

    @staticmethod
    def _whole_step_decodes(st: StepRows) -> bool:
        """The step is generated tokens only, few enough for the weight-streaming kernels, with no
        chunk-cache rows: one native call can run all of it."""
        return (not st.chunks and st.native_batch is not None and st.native_rows is None and all(st.decode)
                and 0 < len(st.decode) <= native.LINEAR_ROWS_MAX)

    def _decode_step_native(self, h: torch.Tensor, st: StepRows, arena: KVArena) -> torch.Tensor:
        """Every decoder layer of a decode-only step in one native call
        (:func:`~ragcache_backend.model.kernels.native.decode_step`: without the per-operation path's
        dispatch). Returns the final-normed hidden states ``[M, hidden]``."""
        cos, sin = self._rope_tables(st, torch.float32)
        h = h.contiguous()
        x = native.add_rms_norm(h, None, self._weights[0].input_norm, self._weights[0].input_eps)
        native.decode_step(self._decode_plan, h, x, self.num_heads, self.num_kv_heads, cos, sin, arena.k_cache,
                           arena.v_cache, st.write, st.native_batch, self._scale)
        return x

    def _layers_fused(self, h: torch.Tensor, st: StepRows, arena: KVArena, *, prune_last: bool = False) -> torch.Tensor:
        """Every decoder layer with the native kernels (float32 or bf16); ``h`` (the residual stream) is
        updated in place. Returns the final-normed hidden states ``[N, hidden]``, or with
        ``prune_last`` (no chunk-cache rows) ``[B, hidden]``: the last layer past its K/V write runs
        for each sequence's last row only (see :meth:`run`)."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self._rope_tables(st, torch.float32)
        h = h.contiguous()
        x = native.add_rms_norm(h, None, self._weights[0].input_norm, self._weights[0].input_eps)
        a = torch.empty((h.shape[0], hq, d), dtype=self.dtype)
        last = len(self._weights) - 1
        for idx, w in enumerate(self._weights):
            n = h.shape[0]
            if a.shape[0] != n:  # rows stopped after the last layer
                a = torch.empty((n, hq, d), dtype=self.dtype)
            kc, vc = arena.k_cache[idx], arena.v_cache[idx]
            qkv = w.qkv(x).view(n, hq + 2 * hkv, d)
            old = [c.before_write(kc, vc, idx) for c in st.chunks]
            native.rope_write(qkv, hq, hkv, cos, sin, kc, vc, st.write)
            if prune_last and idx == last:
                return self._last_rows_fused(qkv, h, st, kc, vc, w)
            self._attend_native(qkv[:, :hq], kc, vc, st, a)
            if st.chunks:
                self._chunks_after_write(st, old, qkv[:, :hq], kc, vc, a, idx)
            x = native.add_rms_norm(h, w.o_proj(a.view(n, hq * d)), w.post_norm, w.post_eps)
            down = w.down_proj(w.gate_up.silu_gated(x))
            if idx + 1 < len(self._weights):
                x = native.add_rms_norm(h, down, self._weights[idx + 1].input_norm, self._weights[idx + 1].input_eps)
                if st.chunks:
                    before = h.shape[0]
                    h, x = st.stop_rows(idx, h, x)
                    if h.shape[0] != before:
                        h, x = h.contiguous(), x.contiguous()
                        cos, sin = self._rope_tables(st, torch.float32)
            else:
                x = native.add_rms_norm(h, down, *self._final_norm)
        return x

    def _last_rows_fused(self, qkv: torch.Tensor, h: torch.Tensor, st: StepRows, kc: torch.Tensor, vc: torch.Tensor,
                         w: _LayerWeights) -> torch.Tensor:
        """The last layer after its K/V write, for each sequence's last row only: ``qkv`` ``[N, Hq +
        2 Hkv, D]`` (RoPE applied), ``h`` ``[N, hidden]`` the residual stream. Returns the
        final-normed hidden states ``[B, hidden]``."""
        hq, d = self.num_heads, self.head_dim
        rows = st.last_rows()
        q = qkv.index_select(0, rows)[:, :hq]  # [B, Hq, D]
        batch = native.attention_batch(st.context, [1] * len(rows), st.decode)
        a = native.paged_attention(q, kc, vc, batch, self._scale)
        h = h.index_select(0, rows)
        x = native.add_rms_norm(h, w.o_proj(a.view(len(rows), hq * d)), w.post_norm, w.post_eps)
        down = w.down_proj(w.gate_up.silu_gated(x))
        return native.add_rms_norm(h, down, *self._final_norm)

    def _attend_native(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, st: StepRows, a: torch.Tensor) -> None:
        """The native kernel over the sequences of ``st.native_batch`` (the ordinary ones, and those
        at explicit positions with :attr:`native_positions`), into their rows of ``a``."""
        if st.native_batch is None:
            return
        if st.native_rows is None:
            native.paged_attention(q, kc, vc, st.native_batch, self._scale, out=a)
        else:
            a[st.native_rows] = native.paged_attention(q.index_select(0, st.native_rows), kc, vc, st.native_batch, self._scale)

    def _layer(self, idx: int, h: torch.Tensor, st: StepRows, arena: KVArena) -> torch.Tensor:
        w = self._weights[idx]
        n = h.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        cos, sin = self._rope_tables(st, self.dtype, w.rope)
        x = self._rms(h, (w.input_norm, w.input_eps))
        qkv = w.qkv(x).view(n, hq + 2 * hkv, self.head_dim)  # one GEMM for Q, K, V
        qk = qkv[:, : hq + hkv]
        if w.q_norm is not None:  # Qwen3, Gemma 3: per-head RMSNorm of Q and K, before RoPE
            qk = torch.cat((self._rms(qk[:, :hq], w.q_norm), self._rms(qk[:, hq:], w.k_norm)), dim=1)
        qk = apply_rope(qk, cos, sin)  # RoPE on Q and K heads at once
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]  # [N, Hq, D], [N, Hkv, D], [N, Hkv, D]
        kc, vc = arena.k_cache[idx], arena.v_cache[idx]  # [slots, Hkv, D]
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
                if st.modes[i] is None or st.native_batch is not None:  # explicit positions, or done natively
                    continue
                if w.window is not None:  # a sliding-window layer: keys p - W + 1 .. p
                    a[lo:hi] = self._attend_window(i, q[lo:hi], k[lo:hi], v[lo:hi], kc, vc, st, w.window)
                elif slots is None:  # cold prefill: attend over the fresh K/V directly
                    a[lo:hi] = attention(q[lo:hi], k[lo:hi], v[lo:hi], scale=self._scale)
                else:  # the cached context from the arena, then this step's fresh K/V (no re-gather)
                    ctx_k = torch.cat((kc.index_select(0, slots), k[lo:hi]))
                    ctx_v = torch.cat((vc.index_select(0, slots), v[lo:hi]))
                    a[lo:hi] = attention_over_prefix(q[lo:hi], ctx_k, ctx_v, scale=self._scale, plan=st.modes[i])
        if st.chunks:
            self._chunks_after_write(st, old, q, kc, vc, a, idx)
        out = w.o_proj(a.reshape(n, hq * self.head_dim))
        h = h + (out if w.attn_out_norm is None else self._rms(out, w.attn_out_norm))
        x = self._rms(h, (w.post_norm, w.post_eps))
        gate, up = w.gate_up(x).chunk(2, dim=-1)  # one GEMM for gate and up (SiLU, or Gemma's GeGLU gate)
        down = w.down_proj(w.act(gate) * up)
        return h + (down if w.mlp_out_norm is None else self._rms(down, w.mlp_out_norm))
