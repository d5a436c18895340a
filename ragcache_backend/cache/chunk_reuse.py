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

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace


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


def added_context_factor(stats: VariantStats, new_prefix: Sequence[str], new_lengths: Sequence[int]) -> float:
    """Our extension of eq. 6 for context the variant never saw: ``L_old / (L_old + L_added)``,
    where ``L_old`` is the length of its recorded prefix and ``L_added`` that of the parts of
    ``S_new`` not in ``S_old`` (the attention sink excluded). Eq. 6 counts only context that was
    lost, so a document computed after ``[S, A]`` and reused after ``[S, X, A]`` gets ``beta = 1``
    and nothing recomputed, although its tokens would now attend to ``X``; assuming ``X`` draws as
    much attention per token as the old prefix did, the share of the new context's attention the
    variant accounts for is this factor. 1.0 when nothing was added or the variant had no prefix.

    Raises:
        ValueError: ``new_lengths`` not aligned with ``new_prefix``.
    """
    if len(new_lengths) != len(new_prefix):
        raise ValueError(f"{len(new_lengths)} lengths for {len(new_prefix)} prefix parts")
    old = set(stats.prefix)
    l_old = sum(stats.prefix_lengths)
    l_added = sum(n for key, n in zip(new_prefix, new_lengths) if key not in old and key != SINK_KEY)
    return l_old / (l_old + l_added) if l_old and l_added else 1.0


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


def adjusted_overlap(stats: VariantStats, new_prefix: Sequence[str], new_lengths: Sequence[int] | None = None) -> float:
    """``beta' = beta (1 - gamma)`` (eq. 8); with ``new_lengths`` (the parts' token counts), beta
    also scaled by :func:`added_context_factor`."""
    beta = prefix_overlap(stats, new_prefix)
    if new_lengths is not None:
        beta *= added_context_factor(stats, new_prefix, new_lengths)
    return beta * (1.0 - order_penalty(stats.prefix, new_prefix))


def context_impact(stats: VariantStats) -> float:
    """``CCI = sigmoid(a / b)`` (eq. 9-11) with ``a = sum_j inter(C_j, C_i) / (|C_i| |C_j|)`` and
    ``b = intra(C_i) / |C_i|^2`` (the layer averages are taken when the sums are recorded)."""
    a = sum(w / (stats.length * lj) for w, lj in zip(stats.inter, stats.prefix_lengths))
    b = stats.intra / stats.length**2
    return 1.0 / (1.0 + math.exp(-a / b))


def fix_overhead(stats: VariantStats, new_prefix: Sequence[str], alpha: float,
                 new_lengths: Sequence[int] | None = None) -> float:
    """``CFO = alpha CCI (1 - beta')`` (eq. 12), clamped to [0, 1]: the share of the chunk's tokens
    to recompute when this variant serves a request whose chunks before it are ``new_prefix``
    (``new_lengths``: their token counts, to count added context; see :func:`adjusted_overlap`).

    Raises:
        ValueError: ``alpha`` negative.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    beta = adjusted_overlap(stats, new_prefix, new_lengths)
    return min(1.0, max(0.0, alpha * context_impact(stats) * (1.0 - beta)))


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


def choose_variant(variants: Sequence[VariantStats], new_prefix: Sequence[str], alpha: float,
                   new_lengths: Sequence[int] | None = None) -> VariantChoice:
    """The variant with the lowest CFO for this prefix (§3.1; ties go to the first listed), with its
    tokens to recompute.

    Raises:
        ValueError: no variants, or variants of different chunks.
    """
    if not variants or len({v.chunk for v in variants}) != 1:
        raise ValueError("choose_variant needs at least one variant, all of the same chunk")
    scored = [(fix_overhead(v, new_prefix, alpha, new_lengths), i) for i, v in enumerate(variants)]
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


# ---- which tokens of a reused chunk to recompute ----------------------------------------------------

@dataclass(slots=True, frozen=True)
class RecomputeRule:
    """How many and which tokens of a reused chunk are recomputed.

    Attributes:
        kind: ``cfo``: Cache-Craft, ``ceil(CFO |C|)`` tokens by inter-attention (eq. 12-14);
            ``all``: every token (the output then equals full recomputation);
            ``none``: no token, only the RoPE re-rotation (full reuse);
            ``leading``: the first ``leading`` tokens of every reused chunk (EPIC-style);
            ``share``: a fixed ``share`` of tokens by inter-attention;
            ``blend``: CacheBlend-style: every token is recomputed through an early layer, where the
            ``share`` whose K/V deviate most are kept for the remaining layers (selected in the
            runner: the plan here lists every token).
        alpha: CFO's scale (``cfo``).
        share: the fixed share (``share``), [0, 1].
        leading: tokens (``leading``).
        guard: the quality guard's threshold, or None for no guard: a reused chunk whose recomputed
            tokens' K/V moved (relative L2, averaged over its recomputed tokens and the layers)
            times the attention mass the prompt's last token gives the chunk (averaged over the
            layers) exceeds this is recomputed in full before the first token is sampled.
        focus_window: Algorithm 1's ``w`` (focused-chunk early termination, §3.2.2), or None: off.
        added_context: count context the variant never saw in beta (:func:`added_context_factor`,
            our extension of eq. 6); False is the paper's formula.
    """

    kind: str = "cfo"
    alpha: float = 1.0
    share: float = 0.15
    leading: int = 32
    guard: float | None = None
    focus_window: int | None = None
    added_context: bool = True

    @property
    def key(self) -> str:
        """A short id of everything that shapes the KV this rule produces (12 hex characters): part
        of the key of every approximate node built under it, so that KV approximated under one rule
        never serves a request that asked for another."""
        guard = "" if self.guard is None else f"x-attention:{self.guard!r}"  # the guard's signal since 2026-11-27
        text = (f"{self.kind};{self.alpha!r};{self.share!r};{self.leading};{guard};{self.focus_window};"
                f"{int(self.added_context)}")
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def __post_init__(self) -> None:
        if self.kind not in ("cfo", "all", "none", "leading", "share", "blend"):
            raise ValueError(f"unknown recompute rule {self.kind!r}")
        if (self.alpha < 0 or not 0 <= self.share <= 1 or self.leading < 0 or (self.guard is not None and self.guard <= 0)
                or (self.focus_window is not None and self.focus_window < 1)):
            raise ValueError(f"bad recompute rule {self}")


def choose_with_rule(variants: Sequence[VariantStats], new_prefix: Sequence[str], rule: RecomputeRule,
                     new_lengths: Sequence[int] | None = None) -> VariantChoice:
    """The variant with the lowest CFO (§3.1) and the tokens ``rule`` recomputes for it; ``cfo`` in
    the result is the share of the chunk's tokens recomputed.

    Raises:
        ValueError: as :func:`choose_variant`.
    """
    choice = choose_variant(variants, new_prefix, rule.alpha, new_lengths if rule.added_context else None)
    stats, n = choice.stats, choice.stats.length
    if rule.kind == "cfo":
        return choice
    if rule.kind in ("all", "blend"):
        picks = tuple(range(n))
    elif rule.kind == "none":
        picks = ()
    elif rule.kind == "leading":
        picks = tuple(range(min(n, rule.leading)))
    else:
        picks = tokens_to_recompute(stats, recompute_count(rule.share, n))
    return VariantChoice(stats, len(picks) / n, picks)


# ---- variants as the cache keeps them -------------------------------------------------------------

SINK_KEY = "<sink>"
"""The context part id of the attention sink (never counted as context)."""

SINK_TOKENS = 4
"""Tokens at the very start of every prompt left out of inter-attention. They are the same template
tokens at the same positions in every prompt (the model's attention sink), so attention to them is
the same whatever context a chunk is reused in; counted as context it would dominate ``a`` and
``beta`` and say nothing about reuse."""


@dataclass(slots=True)
class VariantInfo:
    """What the cache keeps beside a chunk variant's KV (Cache-Craft §3.3's metadata store).

    Attributes:
        stats: the attention sums recorded when it was computed.
        start: position of the chunk's first token in the prompt it was computed in, in tokens
            (its keys carry RoPE for positions ``start ..``; reuse at ``p`` re-rotates by ``p - start``).
        fingerprint: the model and dtype it was computed under; a variant is never served to another.
        reuse_score: ``f_r`` (§3.3), raised by ``1 / CFO`` on every reuse.
    """

    stats: VariantStats
    start: int
    fingerprint: str
    reuse_score: float = 0.0

    def fits(self, chunk: str, num_tokens: int) -> bool:
        """True if this record describes segment ``chunk`` of ``num_tokens`` tokens."""
        return self.stats.chunk == chunk and self.stats.length == num_tokens


#: Version of :func:`variant_to_json`'s layout; another version is refused on read.
VARIANT_JSON_VERSION = 1


def variant_to_json(info: VariantInfo) -> str:
    """``info`` as a JSON object (the disk tier's per-file metadata for a variant): the statistics,
    origin position, fingerprint and reuse score. Floats keep their exact value (``repr``), so a
    variant read back plans exactly as the one written."""
    st = info.stats
    return json.dumps({
        "version": VARIANT_JSON_VERSION, "chunk": st.chunk, "length": st.length, "prefix": list(st.prefix),
        "prefix_lengths": list(st.prefix_lengths), "inter": list(st.inter), "intra": st.intra,
        "token_inter": list(st.token_inter), "start": info.start, "fingerprint": info.fingerprint,
        "reuse_score": info.reuse_score,
    }, separators=(",", ":"), allow_nan=False)


def variant_from_json(text: str) -> VariantInfo:
    """The inverse of :func:`variant_to_json` (plain JSON, never unpickled).

    Raises:
        ValueError: not JSON, another layout version, a missing or mistyped field, or statistics
            that :class:`VariantStats` refuses (inconsistent lengths, negative sums, ...).
    """
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("version") != VARIANT_JSON_VERSION:
            raise ValueError(f"variant metadata of version {d.get('version') if isinstance(d, dict) else None!r}")

        def strs(xs) -> tuple[str, ...]:
            if not isinstance(xs, list) or not all(isinstance(x, str) for x in xs):
                raise ValueError("expected a list of strings")
            return tuple(xs)

        def nums(xs, kind) -> tuple:
            if not isinstance(xs, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs):
                raise ValueError("expected a list of numbers")
            return tuple(kind(x) for x in xs)

        if not isinstance(d["chunk"], str) or not isinstance(d["fingerprint"], str):
            raise ValueError("chunk and fingerprint must be strings")
        stats = VariantStats(chunk=d["chunk"], length=int(d["length"]), prefix=strs(d["prefix"]),
                             prefix_lengths=nums(d["prefix_lengths"], int), inter=nums(d["inter"], float),
                             intra=float(d["intra"]), token_inter=nums(d["token_inter"], float))
        start, score = int(d["start"]), float(d["reuse_score"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad variant metadata: {exc!r}") from exc
    if start < 0 or not math.isfinite(score) or score < 0:
        raise ValueError(f"bad variant metadata: start {start}, reuse score {score}")
    return VariantInfo(stats, start, d["fingerprint"], score)


def context_keys(keys: Sequence[str]) -> tuple[str, ...]:
    """Segment keys made unique within one prompt: a key's second occurrence becomes ``key#2``
    and so on (the same document twice in a prompt is two different contexts)."""
    seen: dict[str, int] = {}
    out = []
    for key in keys:
        seen[key] = seen.get(key, 0) + 1
        out.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
    return tuple(out)


def stats_from_mass(chunk: str, mass: Sequence[Sequence[float]], own: int, keys: Sequence[str],
                    lengths: Sequence[int], skip: int = 1) -> VariantStats:
    """A variant's statistics from the attention mass its tokens gave each context segment.

    Args:
        chunk: the chunk's id.
        mass: per token of the chunk, per context segment: attention mass (averaged over heads and
            layers), from the runner.
        own: index of the chunk's own segment; segments ``skip .. own - 1`` are its prefix.
        keys: ids of all context segments (``len >= own + 1``); ``keys[skip:own]`` become the prefix.
        lengths: token counts of all context segments.
        skip: leading segments left out of inter-attention (the attention sink).

    Returns:
        ``VariantStats`` with ``inter[j]`` = total mass to prefix segment ``j`` (eq. 3), ``intra``
        = mass to itself (eq. 4), ``token_inter[t]`` = token ``t``'s mass to the prefix (eq. 14).

    Raises:
        ValueError: inconsistent shapes, or (via ``VariantStats``) a chunk that gave itself no attention.
    """
    if not mass or own < skip or own >= len(keys) or len(keys) != len(lengths) or any(len(r) != len(keys) for r in mass):
        raise ValueError(f"stats_from_mass: {len(mass)} rows over {len(keys)} segments, own {own}, skip {skip}")
    prefix = range(skip, own)
    inter = tuple(sum(r[j] for r in mass) for j in prefix)
    return VariantStats(
        chunk=chunk, length=len(mass), prefix=tuple(keys[j] for j in prefix),
        prefix_lengths=tuple(lengths[j] for j in prefix), inter=inter,
        intra=max(sum(r[own] for r in mass), 1e-12),
        token_inter=tuple(sum(r[j] for j in prefix) for r in mass),
    )


# ---- focused chunks (Algorithm 1) and preloading depth (eq. 16) -----------------------------------

def focused_set(cumulative: Sequence[float]) -> frozenset[int]:
    """One layer of Algorithm 1 (lines 4-9): split chunks by their cumulative question attention
    at the largest jump of the entropy of the normalised gaps; returns the indices of the high
    group. With fewer than 3 chunks, or no gap at all, every chunk is focused."""
    k = len(cumulative)
    if k < 3:
        return frozenset(range(k))
    order = sorted(range(k), key=lambda i: (-cumulative[i], i))
    values = [cumulative[i] for i in order]
    diff = [values[i] - values[i + 1] for i in range(k - 1)]
    total = sum(diff)
    if total <= 0:
        return frozenset(range(k))
    p = [d / total for d in diff]
    h, acc = [], 0.0
    for pi in p:
        acc -= pi * math.log(pi) if pi > 0 else 0.0
        h.append(acc)
    jumps = [h[i + 1] - h[i] for i in range(k - 2)]
    cut = max(range(k - 2), key=lambda i: (jumps[i], -i)) + 1  # i* (1-based count of chunks kept)
    return frozenset(order[:cut])


@dataclass(slots=True)
class FocusTracker:
    """Algorithm 1 across layers: feed each layer's question-to-chunk attention; once the focused
    set is the same for ``window`` consecutive layers it is final (``focused``, ``layer``).

    Attributes:
        window: ``w``, layers the set must stay unchanged (>= 1).
        cumulative: ``cinter_i`` so far.
        history: the focused set after each layer fed.
        focused: the final set, once decided; None before.
        layer: ``L*``, the number of layers fed when it was decided.
    """

    window: int
    cumulative: list[float] = field(default_factory=list)
    history: list[frozenset[int]] = field(default_factory=list)
    focused: frozenset[int] | None = None
    layer: int = 0

    def feed(self, inter: Sequence[float]) -> frozenset[int] | None:
        """Add one layer's ``inter_l(C_i, U)``; returns the final set when it is decided now."""
        if self.focused is not None:
            return None
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not self.cumulative:
            self.cumulative = [0.0] * len(inter)
        if len(inter) != len(self.cumulative):
            raise ValueError(f"{len(inter)} chunk scores, expected {len(self.cumulative)}")
        self.cumulative = [c + x for c, x in zip(self.cumulative, inter)]
        self.history.append(focused_set(self.cumulative))
        if len(self.history) >= self.window and len(set(self.history[-self.window:])) == 1:
            self.focused, self.layer = self.history[-1], len(self.history)
            return self.focused
        return None


def preload_depth(num_layers: int, t_prefill: float, t_load: float) -> int:
    """Layers of chunk KV to load ahead (eq. 16, Alg. 2 line 1):
    ``max(1, (L - 1)(1 - T_prefill / T_load) + 1)``, rounded up, at most ``L``.

    Raises:
        ValueError: ``num_layers < 1`` or a time that is not positive.
    """
    if num_layers < 1 or t_prefill <= 0 or t_load <= 0:
        raise ValueError(f"preload_depth: need L >= 1 and positive times, got {num_layers}, {t_prefill}, {t_load}")
    return min(num_layers, max(1, math.ceil((num_layers - 1) * (1 - t_prefill / t_load) + 1 - 1e-9)))


# ---- a recompute budget from a KL target (issue 24) -----------------------------------------------

@dataclass(slots=True, frozen=True)
class KLCalibration:
    """How far Cache-Craft's CFO rule at each scale ``alpha`` moved a model's next-token distribution
    from full prefill, measured on real requests (``benchmarks/chunk_eval.py --calibration-out``):
    teacher-forced over the full prefill's greedy answer, the mean per-token KL(p_full || p_reuse)
    in nats. It turns a KL target into a rule: the smallest ``alpha`` (least recomputation) whose
    measured KL is within the target.

    Attributes:
        model: the model it was measured on (``LoadedModel.name``).
        dtype: the KV dtype it was measured in (``"float32"``, ``"bfloat16"``).
        alphas: the CFO scales measured, ascending.
        kl: mean KL at each of ``alphas``, nats per token (>= 0, finite).
        no_recompute_kl: mean KL with reuse and no recomputation (RoPE fixed only), nats per token.
        target: the KL target the measurement was run for, nats per token.
        requests: requests measured.

    Raises:
        ValueError: ``alphas`` empty, not ascending or negative; ``kl`` not aligned with them;
            a negative or non-finite KL or target.
    """

    model: str
    dtype: str
    alphas: tuple[float, ...]
    kl: tuple[float, ...]
    no_recompute_kl: float
    target: float
    requests: int

    def __post_init__(self) -> None:
        if not self.alphas or len(self.kl) != len(self.alphas) or list(self.alphas) != sorted(set(self.alphas)) \
                or self.alphas[0] < 0:
            raise ValueError(f"calibration: alphas {self.alphas} must be distinct, ascending and >= 0, one KL each")
        for x in (*self.kl, self.no_recompute_kl, self.target):
            if not math.isfinite(x) or x < 0:
                raise ValueError(f"calibration: KL values and the target must be finite and >= 0, got {x}")

    def rule(self, base: RecomputeRule, target: float | None = None) -> RecomputeRule:
        """``base`` with the smallest measured ``alpha`` whose KL is at most ``target`` (default: the
        calibration's own); a target of 0, or one no measured alpha meets, recomputes every token
        (``kind="all"``: the output equals full prefill).

        Raises:
            ValueError: a negative or non-finite target.
        """
        target = self.target if target is None else target
        if not isinstance(target, (int, float)) or not math.isfinite(target) or target < 0:
            raise ValueError(f"the KL target must be a finite number >= 0 (nats per token), got {target!r}")
        if target > 0:
            for alpha, kl in zip(self.alphas, self.kl):
                if kl <= target:
                    return replace(base, kind="cfo", alpha=alpha)
        return replace(base, kind="all")

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=1, allow_nan=False)

    def to_json(self) -> dict:
        return {"version": 1, "model": self.model, "dtype": self.dtype, "alphas": list(self.alphas), "kl": list(self.kl),
                "no_recompute_kl": self.no_recompute_kl, "target": self.target, "requests": self.requests}

    @staticmethod
    def from_json_text(text: str) -> KLCalibration:
        """The inverse of :meth:`to_json_text` (plain JSON).

        Raises:
            ValueError: not JSON, another version, a missing or mistyped field, or values
                :class:`KLCalibration` refuses.
        """
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.get("version") != 1:
                raise ValueError("not a version-1 KL calibration")
            return KLCalibration(str(d["model"]), str(d["dtype"]), tuple(float(a) for a in d["alphas"]),
                                 tuple(float(k) for k in d["kl"]), float(d["no_recompute_kl"]), float(d["target"]),
                                 int(d["requests"]))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"bad KL calibration: {exc!r}") from exc
