"""Attention of new queries over gathered (paged) KV.

RAGCache §5.1 prefills the non-cached suffix of a request on top of the cached prefix KV: the new
queries sit at the *end* of the context, so the causal mask is offset by the cached length (PyTorch's
``is_causal`` aligns the mask top-left when query and key lengths differ, which would be wrong).
An arbitrary boolean mask is accepted too (selective recomputation, Cache-Craft §3.2).

Sliding-window layers (Mistral, Gemma 3's local layers) add a lower limit: a query at position
``p`` sees keys ``p - W + 1 .. p`` (transformers' ``sliding_window_overlay``: ``kv > q - W``).
Every key stays in the arena; the window is a mask, and keys before every new query's window are
not gathered at all (:attr:`AttentionPlan.skip`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def prefix_causal_mask(num_new: int, num_ctx: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean mask ``[num_new, num_ctx]``: new query ``i`` (at context position ``num_ctx - num_new + i``)
    may attend to keys ``0 .. num_ctx - num_new + i``.

    Raises:
        ValueError: if ``num_new > num_ctx`` or either is below 1.
    """
    if num_new < 1 or num_ctx < num_new:
        raise ValueError(f"prefix_causal_mask: need 1 <= num_new <= num_ctx, got {num_new}, {num_ctx}")
    offset = num_ctx - num_new
    rows = torch.arange(num_new, device=device)[:, None] + offset
    cols = torch.arange(num_ctx, device=device)[None, :]
    return cols <= rows


def position_mask(positions: torch.Tensor, num_ctx: int) -> torch.Tensor:
    """Boolean mask ``[T, num_ctx]`` for queries at any positions of a context: query ``i`` may
    attend to keys ``0 .. positions[i]`` (chunk-cache recomputation, Cache-Craft §3.4.3, where the
    recomputed tokens sit inside reused chunks rather than at the end).

    Raises:
        ValueError: a position outside ``[0, num_ctx)``.
    """
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= num_ctx):
        raise ValueError(f"position_mask: positions must lie in [0, {num_ctx})")
    cols = torch.arange(num_ctx, device=positions.device)[None, :]
    return cols <= positions.to(torch.int64)[:, None]


def window_mask(num_new: int, num_ctx: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`prefix_causal_mask` limited to a sliding window: boolean ``[num_new, num_ctx]``, new
    query ``i`` (at context position ``p = num_ctx - num_new + i``) may attend to keys
    ``p - window + 1 .. p``.

    Raises:
        ValueError: as :func:`prefix_causal_mask`, or ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window_mask: window must be >= 1, got {window}")
    causal = prefix_causal_mask(num_new, num_ctx, device=device)
    rows = torch.arange(num_new, device=device)[:, None] + (num_ctx - num_new)
    return causal & (torch.arange(num_ctx, device=device)[None, :] > rows - window)


def segment_attention_mass(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor,
                           num_segments: int, *, scale: float, block_rows: int = 512,
                           window: int | None = None) -> torch.Tensor:
    """Softmax mass each query gives each context segment (Cache-Craft eq. 3-4), float32 reference.

    Computed ``block_rows`` queries at a time (the scores of a block are ``[Hq, block_rows, S]``
    float32, so memory stays bounded for long prompts); each KV head's query group shares one
    matmul (no repeated keys); the causal limit is an additive bias per block.

    Args:
        q: ``[T, Hq, D]`` queries (RoPE applied); k: ``[S, Hkv, D]`` the whole context's keys.
        positions: ``[T]`` int64 position of each query in the context (it attends to ``0..pos``).
        segments: ``[S]`` int64 segment index of each key, each in ``[0, num_segments)``.
        num_segments: number of segments.
        scale: softmax scale.
        block_rows: queries per block (>= 1).
        window: a sliding-window layer's window (the query at ``pos`` sees keys ``pos - window + 1
            .. pos``), or None.

    Returns:
        ``[T, Hq, num_segments]`` float32; each ``[t, h]`` row sums to 1.

    Raises:
        ValueError: shapes that disagree, a segment index out of range or ``block_rows < 1``.
    """
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    if (positions.shape != (t,) or segments.shape != (s,) or hq % hkv or block_rows < 1
            or (s and int(segments.max()) >= num_segments)):
        raise ValueError(f"segment_attention_mass: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
                         f"{tuple(positions.shape)}, segments {tuple(segments.shape)} / {num_segments}, "
                         f"block_rows {block_rows}")
    group = hq // hkv
    kt = k.float().permute(1, 2, 0).contiguous()  # [Hkv, D, S]
    qg = q.float().view(t, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
    onehot = F.one_hot(segments.to(torch.int64), num_segments).float()  # [S, nseg]
    keys = torch.arange(s, device=k.device)
    out = torch.empty((t, hq, num_segments), dtype=torch.float32, device=q.device)
    for lo in range(0, t, block_rows):
        hi = min(t, lo + block_rows)
        b = hi - lo
        qb = qg[:, :, lo:hi].reshape(hkv, group * b, d)
        scores = torch.bmm(qb, kt).view(hkv, group, b, s)
        bias = torch.zeros((b, s), dtype=torch.float32, device=k.device)
        bias.masked_fill_(keys[None, :] > positions[lo:hi, None], float("-inf"))
        if window is not None:
            bias.masked_fill_(keys[None, :] <= positions[lo:hi, None] - window, float("-inf"))
        probs = torch.softmax(scores.mul_(scale).add_(bias), dim=-1)
        mass = torch.mm(probs.view(-1, s), onehot).view(hkv, group, b, num_segments)
        out[lo:hi] = mass.permute(2, 0, 1, 3).reshape(b, hq, num_segments)
    return out


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # An additive float mask takes PyTorch's fused CPU kernel; a boolean one is about 2x slower.
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def prefix_causal_bias(num_new: int, num_ctx: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`prefix_causal_mask` as an additive ``[num_new, num_ctx]`` mask of ``dtype`` (0 where a
    query may attend, ``-inf`` elsewhere), to build once per forward and pass to every layer's
    :func:`attention` (building it per layer cost about 5% of a 1,000-token prefill here).

    Raises:
        ValueError: as :func:`prefix_causal_mask`.
    """
    return _additive(prefix_causal_mask(num_new, num_ctx, device=device), dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of ``T`` new queries over ``S`` context keys.

    The default mask is causal with the new queries at the end of the context
    (see :func:`prefix_causal_mask`); with ``T == S`` that is ordinary causal attention and with
    ``T == 1`` (decode) no mask is needed.

    Args:
        q: ``[T, Hq, D]`` queries (RoPE applied).
        k: ``[S, Hkv, D]`` keys, ``v``: ``[S, Hkv, D]`` values; ``Hq`` must be a multiple of ``Hkv``.
        scale: softmax scale (usually ``D ** -0.5``).
        mask: optional ``[T, S]`` mask: boolean (True = may attend; every row needs one True) or
            additive float in ``q``'s dtype (0 or ``-inf``, e.g. from :func:`prefix_causal_bias`).

    Returns:
        ``[T, Hq, D]`` attention output in ``q``'s dtype.

    Raises:
        ValueError: on shape mismatch.
    """
    t, hq, d = q.shape
    s, hkv, dk = k.shape
    if dk != d or v.shape != k.shape or hq % hkv != 0 or t > s:
        raise ValueError(f"attention: bad shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    gqa = hq != hkv
    if mask is not None:
        bias = mask if mask.is_floating_point() else _additive(mask, q.dtype)
        if bias.shape != (t, s):
            raise ValueError(f"attention: mask shape {tuple(bias.shape)} != {(t, s)}")
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale, enable_gqa=gqa)
    elif t == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    elif t == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    else:
        m = _additive(prefix_causal_mask(t, s, device=q.device), q.dtype)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)  # [T, Hq, D]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode query over ``S`` keys in float32 with two batched GEMMs (GQA by grouping query
    heads): ``q`` ``[1, Hq, D]``, ``k``/``v`` ``[S, Hkv, D]`` -> ``[1, Hq, D]`` in ``q``'s dtype.

    PyTorch's CPU flash kernel spends ~0.45 ms on a 1 x 1,000 step for 9 heads (it splits work by
    query blocks); this takes ~0.13 ms. It rounds differently from the flash kernel, so it is used
    for generated tokens only, never for a prompt token (see :class:`AttentionPlan`).
    """
    _, hq, d = q.shape
    s, hkv, _ = k.shape
    g = hq // hkv
    qh = q.view(hkv, g, d).float()  # heads of one KV group are adjacent, as in repeat_interleave
    scores = torch.bmm(qh, k.permute(1, 2, 0).float()).mul_(scale)  # [Hkv, g, S]
    out = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1).float())  # [Hkv, g, D]
    return out.reshape(1, hq, d).to(q.dtype)  # [1, Hq, D]


@dataclass(slots=True, frozen=True)
class AttentionPlan:
    """How ``T`` new queries attend over ``P`` cached keys followed by their own ``T`` keys.

    Attributes:
        num_cached: ``P``, context tokens before the new ones.
        num_new: ``T``.
        padded_causal: run PyTorch's causal kernel over the whole context with ``P`` zero query
            rows in front (their output dropped). Causal work is ``(P + T)^2 / 2`` and wastes
            ``P^2 / 2``; the masked kernel does ``T (P + T)`` and wastes ``T^2 / 2``, so the
            padded form wins when ``P <= T`` (e.g. a cache miss over a cached system prompt),
            and it is the same kernel, with the same key blocking, as a cold prefill.
        bias: the additive ``[T, P + T]`` mask of the masked form (None otherwise).
        decode: a generated token: :func:`decode_attention` instead of the flash kernel.
        skip: in a sliding-window layer, the leading cached keys outside every new query's window:
            the caller passes only the ``num_cached`` keys after them (0 otherwise).
        window: the sliding window the plan applies (None: full attention, or a window that no
            query's context exceeds).

    bf16 exactness: every prompt token goes through PyTorch's flash kernel, whose rows do not
    depend on the other query rows nor on causal-vs-masked form (keys are split in the same
    blocks from position 0), so a prompt's logits and KV are bit-identical whether its prefix
    came from the cache or not; only generated tokens use the faster decode form, in both cases.
    """

    num_cached: int
    num_new: int
    padded_causal: bool
    bias: torch.Tensor | None
    decode: bool = False
    skip: int = 0
    window: int | None = None


def attention_plan(num_cached: int, num_new: int, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                   decode: bool = False, window: int | None = None) -> AttentionPlan:
    """Choose the attention form for one sequence of a forward step; build once, use in every layer
    (of one kind: a sliding-window layer has its own plan).

    Args:
        decode: the one new token runs on the decode form (``num_new`` must be 1): a generated
            token, or a prompt's one new token the runner treats as one (float32, native fused path).
        window: the layer's sliding window in tokens, or None. While the whole context fits in it
            the plan is the full-attention one (same kernels, same roundings).

    Raises:
        ValueError: ``num_new < 1``, ``num_cached < 0``, ``decode`` with ``num_new != 1``, or
            ``window < 1``.
    """
    if num_new < 1 or num_cached < 0 or (decode and num_new != 1):
        raise ValueError(f"attention_plan: need num_new >= 1 and num_cached >= 0 (1 new to decode), got {num_cached}, {num_new}")
    if window is not None:
        if window < 1:
            raise ValueError(f"attention_plan: window must be >= 1, got {window}")
        if num_cached + num_new > window:
            return _window_plan(num_cached, num_new, window, dtype, device, decode)
    if decode and num_cached:
        return AttentionPlan(num_cached, num_new, False, None, decode=True)
    if num_new == 1 or num_cached == 0:  # decode needs no mask; a cold prefill is plain causal
        return AttentionPlan(num_cached, num_new, False, None)
    if num_cached <= num_new:
        return AttentionPlan(num_cached, num_new, True, None)
    return AttentionPlan(num_cached, num_new, False, prefix_causal_bias(num_new, num_cached + num_new, dtype, device))


def _window_plan(num_cached: int, num_new: int, window: int, dtype: torch.dtype, device: torch.device | str,
                 decode: bool) -> AttentionPlan:
    """The plan of a sliding-window layer whose context exceeds its window: the first new query
    (at position ``num_cached``) sees no key before ``num_cached - window + 1``, so those are
    skipped; the rest is a band mask, or no mask when one query remains (decode, a last token)."""
    skip = max(0, num_cached - window + 1)
    kept = num_cached - skip
    if kept + num_new <= window:  # one new token: every kept key is inside its window
        return dataclasses.replace(attention_plan(kept, num_new, dtype, device, decode=decode), skip=skip, window=window)
    bias = _additive(window_mask(num_new, kept + num_new, window, device=device), dtype)
    return AttentionPlan(kept, num_new, False, bias, skip=skip, window=window)


def attention_over_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                          plan: AttentionPlan) -> torch.Tensor:
    """:func:`attention` of ``T`` new queries over ``P`` cached + ``T`` new keys, in the form
    ``plan`` chose (the result is the same up to rounding).

    Args:
        q: ``[T, Hq, D]``; k, v: ``[P + T, Hkv, D]`` (``P = plan.num_cached``: in a sliding-window
            plan, the cached keys after the ``plan.skip`` first ones).

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.

    Raises:
        ValueError: shapes that do not match ``plan``.
    """
    t, s = q.shape[0], k.shape[0]
    if t != plan.num_new or s != plan.num_cached + plan.num_new:
        raise ValueError(f"attention_over_prefix: q {tuple(q.shape)}, k {tuple(k.shape)} do not match {plan}")
    if plan.decode:
        return decode_attention(q, k, v, scale)
    if plan.padded_causal:
        padded = torch.cat((q.new_zeros((plan.num_cached, *q.shape[1:])), q))
        return attention(padded, k, v, scale=scale)[plan.num_cached:]
    return attention(q, k, v, scale=scale, mask=plan.bias)
