"""Rotary position embedding (RoPE) for Llama-family models.

Reference: Su et al., RoFormer (2021); the Hugging Face Llama layout ("rotate_half" of two
concatenated halves). Cache-Craft §3 needs to *re-rotate* cached keys when a chunk moves from
position p to p + d: because RoPE rotations compose, ``R(p + d) k = R(d) R(p) k``, so a cached
post-RoPE key is moved by applying RoPE with the position delta alone (SPEC §2 "kernels").
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    *,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for the given positions.

    Args:
        inv_freq: ``[D/2]`` float32 inverse frequencies (the model's ``rotary_emb.inv_freq``, which
            already includes any rope scaling such as Llama 3's).
        positions: ``[T]`` int64 absolute token positions (may be negative for re-rotation).
        attention_scaling: the model's ``rotary_emb.attention_scaling`` (1.0 for plain RoPE).
        dtype: dtype of the returned tables (computed in float32, then cast).

    Returns:
        ``(cos, sin)``, each ``[T, D]`` in ``dtype``.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys: ``x * cos + rotate_half(x) * sin``.

    Args:
        x: ``[T, H, D]`` queries or keys (any float dtype).
        cos, sin: ``[T, D]`` tables from :func:`rope_cos_sin` in ``x``'s dtype.

    Returns:
        ``[T, H, D]`` rotated tensor, same dtype as ``x``.

    Raises:
        ValueError: if the token or head dimensions of ``x`` and the tables disagree.
    """
    if x.dim() != 3 or cos.shape != (x.shape[0], x.shape[2]):
        raise ValueError(f"apply_rope: x {tuple(x.shape)} does not match cos {tuple(cos.shape)}")
    cos_b, sin_b = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
    return x * cos_b + _rotate_half(x) * sin_b


def rerotate(
    k: torch.Tensor, delta: int, inv_freq: torch.Tensor, *, attention_scaling: float = 1.0
) -> torch.Tensor:
    """Move post-RoPE keys by ``delta`` positions: ``k*cos(d*theta) + rotate_half(k)*sin(d*theta)``.

    Used by the chunk-cache mode (Cache-Craft §3) to reuse a chunk's keys at a new position.
    ``attention_scaling`` other than 1.0 is applied once at first rotation, so re-rotation uses the
    unscaled rotation (scaling 1.0) unless the caller says otherwise.

    Args:
        k: ``[T, H, D]`` keys that already carry RoPE for their old positions.
        delta: new position minus old position, in tokens (may be negative).
        inv_freq: ``[D/2]`` inverse frequencies.

    Returns:
        ``[T, H, D]`` keys as if RoPE had been applied at ``old + delta``.
    """
    positions = torch.full((k.shape[0],), int(delta), dtype=torch.int64, device=k.device)
    cos, sin = rope_cos_sin(inv_freq.to(k.device), positions, attention_scaling=attention_scaling, dtype=k.dtype)
    return apply_rope(k, cos, sin)
