"""Offline prefill-time profile ``T(alpha, beta)`` for PGDSF's cost estimate (RAGCache §5.1).

``T(alpha, beta)`` is the prefill time, in seconds, of a request with ``alpha`` cached tokens and
``beta`` new (non-cached) tokens. It is measured on a small grid once, offline, and estimated in
between by bilinear interpolation (Alg. 1 lines 6-9); ``Cost_i / NewSize_i = T / beta`` then feeds
eq. 3. Profiles persist as checksummed JSON so that a stale or damaged file is never trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragcache_backend.errors import CorruptFileError, InvalidRequestError

__all__ = ["PrefillProfile", "measure_profile", "DEFAULT_ALPHAS", "DEFAULT_BETAS"]

DEFAULT_ALPHAS: tuple[int, ...] = (0, 512, 1536)
"""Default cached-token grid (tokens)."""
DEFAULT_BETAS: tuple[int, ...] = (32, 256, 1024)
"""Default new-token grid (tokens)."""

_FORMAT = "ragcache.prefill_profile"
_VERSION = 1


def _check_axis(name: str, values: Sequence[int]) -> tuple[int, ...]:
    axis = tuple(values)
    if len(axis) < 2:
        raise InvalidRequestError(f"profile {name} needs >= 2 grid points, got {len(axis)}")
    for v in axis:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidRequestError(f"profile {name} must be non-negative ints (tokens), got {v!r}")
    if any(b <= a for a, b in zip(axis, axis[1:])):
        raise InvalidRequestError(f"profile {name} must be strictly increasing, got {axis}")
    return axis


@dataclass(slots=True, frozen=True)
class PrefillProfile:
    """Prefill time on a grid: ``times[i][j] = T(alphas[i], betas[j])`` in seconds.

    Attributes:
        alphas: cached-token grid, strictly increasing, >= 2 points (tokens).
        betas: new-token grid, strictly increasing, >= 2 points (tokens).
        times: ``len(alphas) x len(betas)`` finite, non-negative prefill times (seconds).
        model_fingerprint: identifies the model the profile was measured on (None = unknown).
        dtype: compute dtype of the measurement, e.g. ``"float32"`` (None = unknown).
        threads: CPU threads used for the measurement (None = unknown).

    Raises InvalidRequestError (a ValueError) when the grid is malformed.
    """

    alphas: tuple[int, ...]
    betas: tuple[int, ...]
    times: tuple[tuple[float, ...], ...]
    model_fingerprint: str | None = None
    dtype: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        alphas = _check_axis("alphas", self.alphas)
        betas = _check_axis("betas", self.betas)
        rows = tuple(tuple(row) for row in self.times)
        if len(rows) != len(alphas) or any(len(r) != len(betas) for r in rows):
            shape = [len(r) for r in rows]
            raise InvalidRequestError(
                f"profile times must be {len(alphas)} rows x {len(betas)} columns, got rows {shape}"
            )
        for row in rows:
            for t in row:
                if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                    raise InvalidRequestError(f"profile times must be finite seconds >= 0, got {t!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise InvalidRequestError(f"profile threads must be an int >= 1 or None, got {self.threads!r}")
        object.__setattr__(self, "alphas", alphas)
        object.__setattr__(self, "betas", betas)
        object.__setattr__(self, "times", tuple(tuple(float(t) for t in r) for r in rows))

    def estimate(self, alpha: int | float, beta: int | float) -> float:
        """Estimated prefill time ``T(alpha, beta)`` in seconds (Alg. 1 lines 6-9).

        Inside the grid: bilinear interpolation in the cell ``alpha_l <= alpha <= alpha_h``,
        ``beta_l <= beta <= beta_h`` (first along alpha for ``T_l`` and ``T_h``, then along beta).
        Outside: the nearest edge cell, extrapolated linearly. Never negative (clamped at 0).
        """
        if alpha < 0 or beta < 0:
            raise InvalidRequestError(f"alpha and beta are token counts >= 0, got {alpha}, {beta}")
        i = min(max(bisect_right(self.alphas, alpha) - 1, 0), len(self.alphas) - 2)
        j = min(max(bisect_right(self.betas, beta) - 1, 0), len(self.betas) - 2)
        a_l, a_h = self.alphas[i], self.alphas[i + 1]
        b_l, b_h = self.betas[j], self.betas[j + 1]
        t = self.times
        fa = (alpha - a_l) / (a_h - a_l)
        t_l = t[i][j] + fa * (t[i + 1][j] - t[i][j])  # Alg. 1 line 7
        t_h = t[i][j + 1] + fa * (t[i + 1][j + 1] - t[i][j + 1])  # line 8
        est = t_l + (beta - b_l) / (b_h - b_l) * (t_h - t_l)  # line 9
        return max(0.0, est)

    def _payload(self) -> dict[str, Any]:
        return {
            "alphas": list(self.alphas),
            "betas": list(self.betas),
            "times": [list(r) for r in self.times],
            "model_fingerprint": self.model_fingerprint,
            "dtype": self.dtype,
            "threads": self.threads,
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON with a sha256 of the canonical payload; atomic replace."""
        path = Path(path)
        payload = self._payload()
        doc = {"format": _FORMAT, "version": _VERSION, "sha256": _digest(payload), "payload": payload}
        text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrefillProfile:
        """Read a profile written by ``save``.

        Raises FileNotFoundError if ``path`` does not exist, and CorruptFileError naming the path
        on bad JSON, wrong format/version/schema, checksum mismatch or invalid grid.
        """
        path = Path(path)
        raw = path.read_bytes()
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptFileError(f"prefill profile {path} is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise CorruptFileError(f"prefill profile {path} is not a {_FORMAT} file")
        if doc.get("version") != _VERSION:
            raise CorruptFileError(
                f"prefill profile {path} has version {doc.get('version')!r}, expected {_VERSION}"
            )
        payload = doc.get("payload")
        expected_keys = {"alphas", "betas", "times", "model_fingerprint", "dtype", "threads"}
        if not isinstance(payload, dict) or set(payload) != expected_keys:
            raise CorruptFileError(f"prefill profile {path} has a malformed payload")
        if doc.get("sha256") != _digest(payload):
            raise CorruptFileError(f"prefill profile {path} fails its sha256 checksum; re-measure it")
        for key in ("model_fingerprint", "dtype"):
            if payload[key] is not None and not isinstance(payload[key], str):
                raise CorruptFileError(f"prefill profile {path}: {key} must be a string or null")
        try:
            if not all(isinstance(r, list) for r in payload["times"]):
                raise InvalidRequestError("times must be a list of rows")
            return cls(
                alphas=tuple(payload["alphas"]),
                betas=tuple(payload["betas"]),
                times=tuple(tuple(r) for r in payload["times"]),
                model_fingerprint=payload["model_fingerprint"],
                dtype=payload["dtype"],
                threads=payload["threads"],
            )
        except (InvalidRequestError, TypeError) as exc:
            raise CorruptFileError(f"prefill profile {path} has an invalid grid: {exc}") from None


def _digest(payload: dict[str, Any]) -> str:
    try:
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return ""  # unserializable payload: never matches a stored hex digest
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def measure_profile(
    prefill_fn: Callable[[int, int], float],
    alphas: Sequence[int] = DEFAULT_ALPHAS,
    betas: Sequence[int] = DEFAULT_BETAS,
    *,
    repeats: int = 1,
    model_fingerprint: str | None = None,
    dtype: str | None = None,
    threads: int | None = None,
) -> PrefillProfile:
    """Measure ``T`` on the grid ``alphas x betas`` (tokens).

    ``prefill_fn(alpha, beta)`` runs one prefill of ``beta`` new tokens after ``alpha`` cached
    ones and returns its wall time in seconds; each grid point keeps the minimum over
    ``repeats`` calls (the least noisy estimate of the true cost). The grid is then made
    non-decreasing along both axes (a running maximum over beta, then over alpha): more tokens
    never cost less, so a point measured during a slow spell cannot make a larger prefill look
    cheaper than a smaller one.
    """
    if repeats < 1:
        raise InvalidRequestError(f"repeats must be >= 1, got {repeats}")
    alphas_t = _check_axis("alphas", alphas)
    betas_t = _check_axis("betas", betas)
    grid = [[min(float(prefill_fn(a, b)) for _ in range(repeats)) for b in betas_t] for a in alphas_t]
    for row in grid:  # non-decreasing in beta
        for j in range(1, len(row)):
            row[j] = max(row[j], row[j - 1])
    for i in range(1, len(grid)):  # non-decreasing in alpha
        grid[i] = [max(x, y) for x, y in zip(grid[i], grid[i - 1])]
    times = tuple(tuple(row) for row in grid)
    return PrefillProfile(alphas_t, betas_t, times, model_fingerprint, dtype, threads)
