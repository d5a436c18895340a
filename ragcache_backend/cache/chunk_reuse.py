"""Reuse planning for chunk caches (Cache-Craft §3.1-3.3): pure functions over plain data.

A *variant* of chunk ``C_i`` is its KV computed after an ordered list of prefix chunks ``S_old``.
While it was computed we record, averaged over layers, how much its tokens attended to each prefix
chunk (inter-attention) and to themselves (intra-attention). For a new request whose chunks before
``C_i`` are ``S_new``, these functions score how far the cached KV is from what recomputation would
give, and how many of its tokens to recompute:

* ``beta``  (eq. 6): the share of the variant's inter-attention that went to chunks still present;
* ``gamma`` (eq. 7): normalised Kendall tau distance between the common chunks' old and new orders;
* ``beta' = beta (1 - gamma)`` (eq. 8);
* ``CCI = sigmoid(a_bar / b_bar)`` (eq. 9-11), with ``a`` the length-normalised inter-attention and
  ``b`` the length-normalised intra-attention;
* ``CFO = alpha CCI (1 - beta')`` (eq. 12), the share of the chunk's tokens to recompute;
* the tokens to recompute: the top ``ceil(CFO |C_i|)`` by inter-attention from prior chunks (eq. 14);
* the variant store's frequency ``f_r += 1 / CFO`` on access and eviction of the lowest (§3.3).

Nothing here touches tensors: the runner records the attention sums, the scheduler plans with these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class VariantStats:
    """What was recorded when one variant of a chunk was computed (attention sums averaged over layers).

    Attributes:
        chunk: the chunk's content id.
        length: ``|C_i|``, tokens (>= 1).
        prefix: ids of the chunks before it when computed (``S_old``), in order; unique.
        prefix_lengths: ``|C_j|`` of each prefix chunk, tokens, same order.
        inter: ``inter(C_j, C_i)`` for each prefix chunk: the sum of attention weights from the
            chunk's tokens to ``C_j``'s tokens, same order (>= 0).
        intra: ``intra(C_i)``: the sum of attention weights among the chunk's own tokens (> 0).
        token_inter: per token of the chunk, its attention to all prior chunks (``[|C_i|]``), for eq. 14.

    Raises:
        ValueError: inconsistent lengths, a repeated prefix id, negative sums or a zero intra sum.
    """

    chunk: str
    length: int
    prefix: tuple[str, ...]
    prefix_lengths: tuple[int, ...]
    inter: tuple[float, ...]
    intra: float
    token_inter: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.length < 1 or len(self.token_inter) != self.length:
            raise ValueError(f"variant of {self.chunk}: length {self.length} with {len(self.token_inter)} token scores")
        if not (len(self.prefix) == len(self.prefix_lengths) == len(self.inter)) or len(set(self.prefix)) != len(self.prefix):
            raise ValueError(f"variant of {self.chunk}: prefix ids, lengths and inter sums must align and be unique")
        if min(self.prefix_lengths, default=1) < 1 or min(self.inter, default=0.0) < 0 or self.intra <= 0:
            raise ValueError(f"variant of {self.chunk}: prefix lengths >= 1, inter sums >= 0 and intra > 0 required")


def prefix_overlap(stats: VariantStats, new_prefix: Sequence[str]) -> float:
    """``beta`` (eq. 6): inter-attention to chunks of ``S_old`` that are also in ``S_new``, over all
    of it. 1.0 when the variant had no prefix or paid it no attention (nothing to lose)."""
    total = sum(stats.inter)
    if total == 0:
        return 1.0
    present = set(new_prefix)
    return sum(w for cid, w in zip(stats.prefix, stats.inter) if cid in present) / total


def order_penalty(old_prefix: Sequence[str], new_prefix: Sequence[str]) -> float:
    """``gamma`` (eq. 7): discordant pairs among the ``m`` chunks common to both orders, over
    ``m (m - 1) / 2``; 0.0 when ``m < 2``."""
    new_rank = {cid: i for i, cid in enumerate(new_prefix)}
    common = [new_rank[cid] for cid in old_prefix if cid in new_rank]  # new ranks in old order
    m = len(common)
    if m < 2:
        return 0.0
    discordant = sum(1 for i in range(m) for j in range(i + 1, m) if common[i] > common[j])
    return discordant / (m * (m - 1) / 2)


def adjusted_overlap(stats: VariantStats, new_prefix: Sequence[str]) -> float:
    """``beta' = beta (1 - gamma)`` (eq. 8)."""
    return prefix_overlap(stats, new_prefix) * (1.0 - order_penalty(stats.prefix, new_prefix))


def context_impact(stats: VariantStats) -> float:
    """``CCI = sigmoid(a / b)`` (eq. 9-11) with ``a = sum_j inter(C_j, C_i) / (|C_i| |C_j|)`` and
    ``b = intra(C_i) / |C_i|^2`` (the layer averages are taken when the sums are recorded)."""
    a = sum(w / (stats.length * lj) for w, lj in zip(stats.inter, stats.prefix_lengths))
    b = stats.intra / stats.length**2
    return 1.0 / (1.0 + math.exp(-a / b))


def fix_overhead(stats: VariantStats, new_prefix: Sequence[str], alpha: float) -> float:
    """``CFO = alpha CCI (1 - beta')`` (eq. 12), clamped to [0, 1]: the share of the chunk's tokens
    to recompute when this variant serves a request whose chunks before it are ``new_prefix``.

    Raises:
        ValueError: ``alpha`` negative.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    return min(1.0, max(0.0, alpha * context_impact(stats) * (1.0 - adjusted_overlap(stats, new_prefix))))


def recompute_count(cfo: float, length: int) -> int:
    """``N = ceil(CFO |C_i|)`` tokens (eq. 14), within ``[0, length]``."""
    return min(length, max(0, math.ceil(cfo * length - 1e-9)))


def tokens_to_recompute(stats: VariantStats, count: int) -> tuple[int, ...]:
    """The ``count`` token offsets of the chunk with the highest inter-attention from prior chunks
    (eq. 14), ascending; ties go to the earlier token."""
    order = sorted(range(stats.length), key=lambda t: (-stats.token_inter[t], t))
    return tuple(sorted(order[: max(0, min(count, stats.length))]))


@dataclass(slots=True, frozen=True)
class VariantChoice:
    """The variant picked for one chunk of a request and how much of it to recompute.

    Attributes:
        stats: the chosen variant.
        cfo: its cache fix overhead for this request (share of tokens, [0, 1]).
        recompute: token offsets within the chunk to recompute, ascending.
    """

    stats: VariantStats
    cfo: float
    recompute: tuple[int, ...]


def choose_variant(variants: Sequence[VariantStats], new_prefix: Sequence[str], alpha: float) -> VariantChoice:
    """The variant with the lowest CFO for this prefix (§3.1; ties go to the first listed), with its
    tokens to recompute.

    Raises:
        ValueError: no variants, or variants of different chunks.
    """
    if not variants or len({v.chunk for v in variants}) != 1:
        raise ValueError("choose_variant needs at least one variant, all of the same chunk")
    scored = [(fix_overhead(v, new_prefix, alpha), i) for i, v in enumerate(variants)]
    cfo, idx = min(scored)
    best = variants[idx]
    return VariantChoice(best, cfo, tokens_to_recompute(best, recompute_count(cfo, best.length)))


def frequency_after_access(frequency: float, cfo: float) -> float:
    """The variant store's reuse score after one access (§3.3): ``f_r + 1 / CFO``; a variant that
    needed no fixing (``CFO = 0``) gains the most, counted as ``1 / CFO`` at a floor of 1e-3."""
    return frequency + 1.0 / max(cfo, 1e-3)


def eviction_victim(frequencies: Sequence[float]) -> int:
    """Index of the variant to evict: the lowest ``f_r`` (§3.3); ties go to the first listed.

    Raises:
        ValueError: empty.
    """
    if not frequencies:
        raise ValueError("eviction_victim needs at least one variant")
    return min(range(len(frequencies)), key=lambda i: (frequencies[i], i))
