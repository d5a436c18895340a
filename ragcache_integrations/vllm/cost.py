"""PGDSF's cost of a vLLM block, from the steps vLLM runs (RAGCache §5.1, eq. 3).

RAGCache prices a node by the prefill time its KV saves (eq. 3, ``Cost / NewSize``) and takes that
time from a profile of the model's prefill (Alg. 1 lines 6-9; ragcache's own engine measures
``T(alpha, beta)`` on a grid at start, :mod:`ragcache_backend.cache.profile`). Under vLLM the
connector runs no prefill of its own, so it profiles the steps vLLM runs anyway: the worker times
each step's forward pass, the scheduler side knows what the step computed, and a least-squares fit
over the recent steps of

    T(step) = c0 + a * new_tokens + b * attended

(``new_tokens``: tokens the step computed; ``attended``: the sum over its requests of
``beta * (alpha + (beta + 1) / 2)``, query-key pairs of attention for ``beta`` new tokens after
``alpha`` computed ones) gives the prefill time per token of a block of ``bs`` tokens whose first
token has ``p`` tokens before it: ``a + b * (p + (bs + 1) / 2)``.

Costs are returned *relative to a block at position 0* (that block costs 1.0), the unit the
connector has always priced in: until enough steps are measured, or while every fit is degenerate
(steps too alike to separate the terms, ``a <= 0`` or ``b < 0``), the prior ``1 + p / 2048``
stands in (after a valid fit, a degenerate one keeps the last valid fit). A relative
cost keeps blocks priced before and after the fit comparable within a tier's PGDSF order.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["BlockCostModel", "StepSample", "attended_pairs"]

log = logging.getLogger(__name__)

PRIOR_SLOPE = 1.0 / 2048
"""Relative cost added per token of context before a block, until a fit exists."""


def attended_pairs(num_computed: int, num_new: int) -> float:
    """Query-key pairs of causal attention for ``num_new`` tokens after ``num_computed`` (tokens)."""
    return num_new * (num_computed + (num_new + 1) / 2)


@dataclass(slots=True, frozen=True)
class StepSample:
    """One step's forward pass, timed by the worker.

    Attributes:
        seconds: wall time of the forward pass (after our loads, before our saves), seconds.
        new_tokens: tokens the step computed (all its requests).
        attended: :func:`attended_pairs` summed over its requests.
    """

    seconds: float
    new_tokens: int
    attended: float


class BlockCostModel:
    """Fits ``T(step)`` over the last ``window`` samples (see the module docstring).

    Args:
        block_size: tokens per vLLM block.
        window: samples kept (the most recent).
        min_samples: samples before the first fit.
        refit_every: new samples between fits.
    """

    def __init__(self, block_size: int, *, window: int = 1024, min_samples: int = 32, refit_every: int = 32) -> None:
        self.block_size = block_size
        self.min_samples = min_samples
        self.refit_every = refit_every
        self._samples: deque[StepSample] = deque(maxlen=window)
        self._since_fit = 0
        self.coefficients: tuple[float, float, float] | None = None
        """``(c0 seconds, a seconds per token, b seconds per attended pair)`` of the last valid fit."""

    def observe(self, samples: list[StepSample]) -> None:
        """Add timed steps (steps that computed nothing are ignored); refit when due."""
        for s in samples:
            if s.new_tokens > 0 and s.seconds > 0:
                self._samples.append(s)
                self._since_fit += 1
        if len(self._samples) >= self.min_samples and (self.coefficients is None or self._since_fit >= self.refit_every):
            self._fit()

    def relative_cost(self, position: int) -> float:
        """Prefill cost per token of a block whose first token has ``position`` tokens before it,
        relative to a block at position 0 (which costs 1.0)."""
        half = (self.block_size + 1) / 2
        if self.coefficients is None:
            return 1.0 + position * PRIOR_SLOPE
        _, a, b = self.coefficients
        return (a + b * (position + half)) / (a + b * half)

    def _fit(self) -> None:
        self._since_fit = 0
        x = np.array([(1.0, s.new_tokens, s.attended) for s in self._samples])
        y = np.array([s.seconds for s in self._samples])
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns of very different magnitude
        solution, _, rank, _ = np.linalg.lstsq(x / scale, y, rcond=None)
        c0, a, b = (float(v) for v in solution / scale)
        if rank == 3 and a > 0 and b >= 0 and np.isfinite([c0, a, b]).all():  # steps alike tell nothing
            if self.coefficients is None:
                log.info("ragcache connector: block cost fitted over %d steps: T = %.2f ms + %.1f us/token + "
                         "%.3f ns/attended pair (a block at position 2048 costs %.2fx one at 0)", len(self._samples),
                         c0 * 1e3, a * 1e6, b * 1e9, (a + b * (2048 + (self.block_size + 1) / 2)) / (a + b * (self.block_size + 1) / 2))
            self.coefficients = (c0, a, b)
