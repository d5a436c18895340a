"""Attention-path kernels: RoPE and attention over gathered paged KV.

The torch implementations here are the reference that runs on every device. Any accelerated
path (CUDA/Triton) must match them in ``tests/model/test_kernels.py``.
"""

from ragcache_backend.model.kernels.attention import (
    AttentionPlan,
    attention,
    attention_over_prefix,
    attention_plan,
    decode_attention,
    position_mask,
    prefix_causal_bias,
    prefix_causal_mask,
    segment_attention_mass,
    window_mask,
)
from ragcache_backend.model.kernels.rope import apply_rope, rerotate, rope_cos_sin

__all__ = ["AttentionPlan", "apply_rope", "attention", "attention_over_prefix", "attention_plan", "decode_attention", "position_mask", "prefix_causal_bias", "prefix_causal_mask", "rerotate", "rope_cos_sin",
           "segment_attention_mass", "window_mask"]
