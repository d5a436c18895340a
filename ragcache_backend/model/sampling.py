"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, a
grammar mask, and the log-probabilities users ask for.

Plain torch on a ``[vocab]`` logits row; the runner calls it, the scheduler never does. The
order of the steps is vLLM's: logit bias, then the penalties (repetition over prompt and output,
presence and frequency over the output), the grammar mask, then temperature, top-k, top-p and
min-p, then the draw. Log-probabilities are the model's own (log-softmax of the raw logits,
vLLM's default ``raw_logprobs``). A request that asks for none of this (greedy, no penalty, no
bias, no grammar, no logprobs) costs one argmax, as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.grammar import Grammar

__all__ = ["MAX_LOGPROBS", "SEED_MAX", "SEED_MIN", "SampledToken", "SamplingParams", "TopLogprob", "choose_token", "sample_token"]

#: The most alternatives ``logprobs`` may ask for per token (OpenAI's limit).
MAX_LOGPROBS = 20

#: The seeds a generator takes (``torch.Generator.manual_seed``: any 64-bit value, signed or not).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: upper bound on generated tokens (>= 1).
        temperature: 0.0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1.0 disables the cut.
        stop: strings that end generation; the matched stop string is not returned.
        seed: seed of the per-request generator (only used when temperature > 0), in
            [:data:`SEED_MIN`, :data:`SEED_MAX`].
        top_k: keep the k most likely tokens (>= 1); 0 or -1 disables the cut (vLLM's convention).
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's, in [0, 1].
        repetition_penalty: > 0; a token already in the prompt or the output has its logit divided
            by it when positive and multiplied when negative (CTRL, Keskar et al. 2019); 1.0 is off.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token the output holds.
        frequency_penalty: in [-2, 2]; subtracted once per occurrence in the output.
        logit_bias: token id -> bias in [-100, 100], added to the logit (a mapping, stored as
            sorted pairs); ids are checked against the vocabulary when the request is submitted.
        logprobs: None for none; k in [0, 20]: each sampled token's log-probability and the k most
            likely alternatives.
        grammar: constrained decoding (:class:`~ragcache_backend.model.grammar.Grammar`); the
            request ends when the grammar is complete.

    Raises:
        InvalidRequestError: a value outside its range.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequestError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {self.seed}")
        if not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise InvalidRequestError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be >= 1, or 0 / -1 to disable it, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequestError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias: dict[int, float] = {}
        for token, value in pairs:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequestError(f"logit_bias keys are token ids (ints >= 0), got {token!r}")
            if not -100.0 <= float(value) <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")
            bias[token] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))

    @property
    def penalised(self) -> bool:
        """Any penalty or bias changes the logits."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))

    @property
    def greedy_argmax(self) -> bool:
        """Nothing but an argmax is needed (the fast path)."""
        return (self.temperature == 0.0 and not self.penalised and self.logprobs is None and self.grammar is None)


@dataclass(slots=True, frozen=True)
class TopLogprob:
    """One alternative token: its id and natural-log probability under the model."""

    token: int
    logprob: float


@dataclass(slots=True, frozen=True)
class SampledToken:
    """The token chosen for one step.

    Attributes:
        token: its id.
        logprob: its natural-log probability under the model (None unless ``logprobs`` was asked).
        top: the ``logprobs`` most likely tokens, most likely first (empty unless asked).
    """

    token: int
    logprob: float | None = None
    top: tuple[TopLogprob, ...] = ()


def _penalise(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
              generated: Sequence[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long, device=logits.device)
        values = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=logits.dtype, device=logits.device)
        logits.index_add_(0, ids, values)
    if params.repetition_penalty != 1.0 and (prompt_ids or generated):
        seen = torch.tensor(sorted(set(prompt_ids) | set(generated)), dtype=torch.long, device=logits.device)
        row = logits[seen]
        logits[seen] = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long, device=logits.device),
                                minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, *,
                 prompt_ids: Sequence[int] = (), generated: Sequence[int] = (),
                 allowed: torch.Tensor | None = None) -> SampledToken:
    """Pick the next token.

    Args:
        logits: ``[vocab]``, any float dtype (computed in float32).
        params: the request's sampling parameters.
        generator: the request's RNG (seeded requests), or None. A seeded draw is made on the
            generator's device (a CPU generator: the engine's), so a seed gives the same token on
            CPU and CUDA for the same probabilities.
        prompt_ids: the prompt's token ids (read only with a repetition penalty).
        generated: the tokens generated so far (penalties).
        allowed: bool ``[vocab]`` from a grammar, or None for no constraint. A mask that allows
            nothing is ignored: the grammar's matcher then refuses the token and the request fails
            with its error.
    """
    if params.greedy_argmax and allowed is None:
        return SampledToken(int(torch.argmax(logits).item()))
    raw = logits.float()
    work = _penalise(raw.clone(), params, prompt_ids, generated) if params.penalised else raw
    if allowed is not None and bool(allowed.any()):
        work = work.masked_fill(~allowed.to(work.device), float("-inf"))  # the matcher's mask is on the CPU
    if params.temperature == 0.0:
        token = int(torch.argmax(work).item())
    else:
        token = _draw(work / params.temperature, params, generator)
    if params.logprobs is None:
        return SampledToken(token)
    logp = torch.log_softmax(raw, dim=-1)
    top: tuple[TopLogprob, ...] = ()
    if params.logprobs:
        values, ids = torch.topk(logp, params.logprobs)
        top = tuple(TopLogprob(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True))
    return SampledToken(token, float(logp[token]), top)


def _draw(scaled: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """A draw from ``softmax(scaled)`` after the top-k, top-p and min-p cuts, on the generator's device
    (``torch.multinomial`` refuses a generator of another device)."""
    if generator is not None and scaled.device != generator.device:
        scaled = scaled.to(generator.device)
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        sorted_p = sorted_p / sorted_p.sum()
        cumulative = torch.cumsum(sorted_p, dim=-1)
        keep = cumulative - sorted_p < params.top_p  # always keeps the most likely token
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator).item())


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token id for ``logits`` (``[vocab]``) without history: :func:`choose_token`'s token."""
    return choose_token(logits, params, generator).token
