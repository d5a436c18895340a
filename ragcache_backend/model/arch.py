"""What our forward pass must do differently for each supported architecture, as plain data.

:class:`PagedLlama <ragcache_backend.model.llama.PagedLlama>` drives the decoder layers of every
supported model with one code path; the differences between the families live here, in one
:class:`ArchSpec` built from the transformers model (its config, and the RoPE tables its rotary
module computed), instead of ``if model_type == ...`` through the code:

=================  =====  =======  ====  ============  ======  =================================
family             QK     norm     act   norms/layer   embed   attention
=================  =====  =======  ====  ============  ======  =================================
llama, mistral,    no     w * x    SiLU  2             1       full (mistral: one window, capped)
qwen2
qwen3              yes    w * x    SiLU  2             1       full, or windows on some layers
gemma3_text        yes    (1+w)*x  GeLU  4 (sandwich)  sqrt(h) local windows + global layers
=================  =====  =======  ====  ============  ======  =================================

Sources: transformers 5.24 ``modeling_llama.py``, ``modeling_qwen3.py`` (per-head ``q_norm`` /
``k_norm`` before RoPE) and ``modeling_gemma3.py`` (``Gemma3RMSNorm``: float32, ``1 + weight``;
``Gemma3TextScaledWordEmbedding``; ``query_pre_attn_scalar``; ``layer_types`` with
``sliding_window``; one RoPE table per layer type, ``rope_local_base_freq`` for local layers);
``masking_utils.sliding_window_overlay`` (a query at position ``p`` sees keys ``p - W + 1 .. p``).
Gemma 3 technical report (2025), §2: 5 local layers per global one, window 1,024 (512 at 270M).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragcache_backend.errors import ModelLoadError

__all__ = ["FAMILIES", "ArchSpec", "Family", "NativeGaps", "RopeTable", "context_window", "describe", "layer_windows", "native_gaps"]


@dataclass(slots=True, frozen=True)
class Family:
    """The fixed traits of an architecture family (the same for every checkpoint of it).

    Attributes:
        qk_norm: per-head RMSNorm of queries and keys before RoPE (``self_attn.q_norm``/``k_norm``).
        norm_offset: RMSNorm multiplies by ``1 + weight`` and computes in float32 (Gemma), instead
            of ``weight * normed`` in the model dtype (Llama).
        sandwich_norms: a norm on the attention output and on the MLP output before each residual
            add (Gemma 3's ``post_attention_layernorm`` and ``post_feedforward_layernorm``; its
            ``pre_feedforward_layernorm`` is the pre-MLP norm that Llama calls
            ``post_attention_layernorm``).
        scaled_embedding: token embeddings are multiplied by ``sqrt(hidden)`` (in the model dtype).
    """

    qk_norm: bool = False
    norm_offset: bool = False
    sandwich_norms: bool = False
    scaled_embedding: bool = False


_LLAMA = Family()
#: Every architecture (transformers ``model_type``) our forward pass runs, with its traits.
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": Family(qk_norm=True),
    "gemma3_text": Family(qk_norm=True, norm_offset=True, sandwich_norms=True, scaled_embedding=True),
}


@dataclass(slots=True, frozen=True)
class RopeTable:
    """The RoPE of one kind of layer.

    Attributes:
        inv_freq: float32 ``[head_dim / 2]`` inverse frequencies, from the model's rotary module
            (any rope scaling of the checkpoint already applied, as transformers computes it).
        attention_scaling: factor on cos and sin (1.0 for plain RoPE; YaRN-style scalings).
    """

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0


@dataclass(slots=True, frozen=True)
class ArchSpec:
    """What the forward pass of one loaded model does, per model and per layer.

    Attributes:
        model_type: the transformers ``model_type`` (a key of :data:`FAMILIES`).
        family: the family's fixed traits.
        act: the MLP's activation name (``silu``, ``gelu_pytorch_tanh``): the gate of the fused
            gate/up GEMM goes through it (``mlp.act_fn``).
        embed_scale: factor on the token embeddings (``sqrt(hidden)`` for Gemma), None for none.
        attn_scale: softmax scale (``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
        windows: per layer, its sliding window ``W`` in tokens (a query at ``p`` attends to keys
            ``p - W + 1 .. p``), or None for full attention. A window that can never bite (at
            least the context window) is None.
        ropes: the distinct RoPE tables; ``ropes[0]`` is the global layers' one.
        layer_rope: per layer, its index into ``ropes``.
        final_softcap: ``final_logit_softcapping`` (logits = ``c * tanh(logits / c)``), or None.
        context_window: the longest context, in tokens (:func:`context_window`).
    """

    model_type: str
    family: Family
    act: str
    embed_scale: float | None
    attn_scale: float
    windows: tuple[int | None, ...]
    ropes: tuple[RopeTable, ...]
    layer_rope: tuple[int, ...]
    final_softcap: float | None
    context_window: int

    @property
    def layer_inv_freq(self) -> torch.Tensor:
        """float32 ``[layers, head_dim / 2]``: each layer's RoPE inverse frequencies."""
        return torch.stack([self.ropes[i].inv_freq for i in self.layer_rope])


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it (None: full attention).

    ``layer_types`` (recent configs: Gemma 3, Qwen2/3 with ``use_sliding_window``) marks the
    ``sliding_attention`` layers, which use ``sliding_window``; without it (Mistral) a set
    ``sliding_window`` applies to every layer.
    """
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    window = window if isinstance(window, int) and window > 0 else None
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types[:n])
    return (window,) * n


def context_window(config) -> int:
    """The longest context we serve, in tokens: ``max_position_embeddings``, capped by the window
    when *every* layer has one (Mistral): then no query ever reaches past a window, so those
    layers attend over their full context (and keep the native kernels). With a global layer
    (Gemma 3) the windows are applied as masks and the context is not capped."""
    limit = int(getattr(config, "max_position_embeddings", 2048))
    windows = layer_windows(config)
    if windows and all(w is not None for w in windows):
        limit = min(limit, min(windows))
    return limit


def _rope_tables(model: torch.nn.Module, config, num_layers: int) -> tuple[tuple[RopeTable, ...], tuple[int, ...]]:
    """The rotary module's tables: one (``rotary_emb.inv_freq``), or one per layer type
    (transformers 5 Gemma 3: ``rotary_emb.{layer_type}_inv_freq``; older: ``rotary_emb_local``)."""
    inner = model.model
    rotary = inner.rotary_emb
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)[:num_layers]

    def table(module, prefix: str = "") -> RopeTable:
        inv = getattr(module, f"{prefix}inv_freq")
        return RopeTable(inv.detach().to(torch.float32), float(getattr(module, f"{prefix}attention_scaling", 1.0)))

    if hasattr(rotary, "inv_freq"):
        local = getattr(inner, "rotary_emb_local", None)
        if local is None:
            return (table(rotary),), (0,) * num_layers
        return (table(rotary), table(local)), tuple(int(t == "sliding_attention") for t in types)
    kinds = sorted(set(types), key=lambda t: t != "full_attention")  # the global table first
    try:
        ropes = tuple(table(rotary, f"{t}_") for t in kinds)
    except AttributeError:
        raise ModelLoadError(f"{config.model_type}: the rotary embedding has no table for layer types {kinds}") from None
    return ropes, tuple(kinds.index(t) for t in types)


def describe(model: torch.nn.Module) -> ArchSpec:
    """The :class:`ArchSpec` of a transformers ``*ForCausalLM`` of a supported family.

    Raises:
        ModelLoadError: the architecture is not in :data:`FAMILIES`, or the checkpoint uses what
            our forward pass does not implement (attention-logit soft-capping, bidirectional
            attention), or its modules lack what its family needs (``q_norm``, Gemma's norms).
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise ModelLoadError(f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    unsupported = [name for name in ("attn_logit_softcapping", "use_bidirectional_attention") if getattr(config, name, None)]
    if unsupported:
        raise ModelLoadError(f"{model_type}: {', '.join(unsupported)} is set; our forward pass does not implement it")
    layers = list(model.model.layers)
    attn, first = layers[0].self_attn, layers[0]
    needs = (["q_norm", "k_norm"] if family.qk_norm else [])
    missing = [n for n in needs if not hasattr(attn, n)]
    if family.sandwich_norms:
        missing += [n for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm") if not hasattr(first, n)]
    if missing:
        raise ModelLoadError(f"{model_type}: the decoder layers lack {missing}, which this family needs")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    limit = context_window(config)
    windows = tuple(w if w is not None and w < limit else None for w in layer_windows(config))
    ropes, layer_rope = _rope_tables(model, config, len(layers))
    embed_scale = None
    if family.scaled_embedding:  # the module's own buffer: transformers rounds it to the model dtype
        buffer = getattr(model.model.embed_tokens, "embed_scale", None)
        embed_scale = float(buffer) if buffer is not None else float(config.hidden_size**0.5)
    softcap = getattr(config, "final_logit_softcapping", None)
    return ArchSpec(
        model_type=model_type, family=family,
        act=str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")),
        embed_scale=embed_scale, attn_scale=float(getattr(attn, "scaling", head_dim**-0.5)),
        windows=windows, ropes=ropes, layer_rope=layer_rope,
        final_softcap=float(softcap) if softcap else None, context_window=limit,
    )


@dataclass(slots=True, frozen=True)
class NativeGaps:
    """What a model needs that the native kernels (:mod:`~ragcache_backend.model.kernels.native`)
    do not implement; an empty tuple means that kernel can run it.

    Attributes:
        attention: gaps of the paged attention kernel (it attends over a sequence's full context).
        fused: gaps of the fused row-wise steps (RoPE + KV write with one table, add + RMSNorm of
            the Llama form, SiLU * up), the attention kernel's included.
    """

    attention: tuple[str, ...]
    fused: tuple[str, ...]


def native_gaps(spec: ArchSpec) -> NativeGaps:
    """:class:`NativeGaps` of ``spec`` (the torch path runs whatever the native kernels lack)."""
    attention = ("sliding-window layers",) if any(w is not None for w in spec.windows) else ()
    fused = list(attention)
    if len(spec.ropes) > 1:
        fused.append("per-layer RoPE bases")
    if spec.family.qk_norm:
        fused.append("QK-norm")
    if spec.family.norm_offset:
        fused.append("(1 + weight) RMSNorm")
    if spec.family.sandwich_norms:
        fused.append("post-attention/post-MLP norms")
    if spec.act != "silu":
        fused.append(f"{spec.act} MLP")
    return NativeGaps(attention, tuple(fused))
