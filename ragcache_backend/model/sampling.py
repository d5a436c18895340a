"""Next-token sampling: greedy, temperature and nucleus (top-p).

Plain torch on a ``[vocab]`` logits row; the runner calls it, the scheduler never does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragcache_backend.errors import InvalidRequestError


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: upper bound on generated tokens (>= 1).
        temperature: 0.0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1.0 disables the cut.
        stop: strings that end generation; the matched stop string is not returned.
        seed: seed of the per-request generator (only used when temperature > 0).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from ``logits`` (``[vocab]``, any float dtype; computed in float32)."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_p, dim=-1)
        keep = cumulative - sorted_p < params.top_p  # always keeps the most likely token
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
