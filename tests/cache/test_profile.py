from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragcache_backend.errors import CorruptFileError, InvalidRequestError
from ragcache_backend.cache.profile import (
    DEFAULT_ALPHAS,
    DEFAULT_BETAS,
    PrefillProfile,
    measure_profile,
)

# T(alpha, beta) on alphas (0, 100, 300) x betas (10, 50)
PROFILE = PrefillProfile(
    alphas=(0, 100, 300),
    betas=(10, 50),
    times=((1.0, 3.0), (2.0, 6.0), (4.0, 10.0)),
    model_fingerprint="m",
    dtype="float32",
    threads=2,
)


def test_grid_points_are_exact() -> None:
    for i, a in enumerate(PROFILE.alphas):
        for j, b in enumerate(PROFILE.betas):
            assert PROFILE.estimate(a, b) == pytest.approx(PROFILE.times[i][j])


def test_bilinear_inside_a_cell_by_hand() -> None:
    # cell alpha in [0, 100], beta in [10, 50]; alpha=25 -> fa=0.25, beta=20 -> fb=0.25
    # T_l = 1 + 0.25*(2-1) = 1.25 ; T_h = 3 + 0.25*(6-3) = 3.75 ; T = 1.25 + 0.25*2.5 = 1.875
    assert PROFILE.estimate(25, 20) == pytest.approx(1.875)
    # second cell alpha in [100, 300]: alpha=200 -> fa=0.5, beta=30 -> fb=0.5
    # T_l = 2 + 0.5*2 = 3 ; T_h = 6 + 0.5*4 = 8 ; T = 3 + 0.5*5 = 5.5
    assert PROFILE.estimate(200, 30) == pytest.approx(5.5)


def test_on_edges_of_cells() -> None:
    assert PROFILE.estimate(100, 30) == pytest.approx(4.0)  # alpha on a grid line: 2 + 0.5*4
    assert PROFILE.estimate(50, 50) == pytest.approx(4.5)  # beta on the top edge: 3 + 0.5*3


def test_extrapolates_linearly_outside_the_grid() -> None:
    # beta=90 beyond 50: last cell, fb = (90-10)/40 = 2 ; at alpha=0: 1 + 2*(3-1) = 5
    assert PROFILE.estimate(0, 90) == pytest.approx(5.0)
    # alpha=500 beyond 300: cell [100,300], fa = 2 ; at beta=10: 2 + 2*(4-2) = 6
    assert PROFILE.estimate(500, 10) == pytest.approx(6.0)
    # both outside: fa=2, fb=2 ; T_l = 6, T_h = 6 + 2*(10-6) = 14 ; T = 6 + 2*(14-6) = 22
    assert PROFILE.estimate(500, 90) == pytest.approx(22.0)


def test_extrapolation_never_negative() -> None:
    p = PrefillProfile(alphas=(0, 10), betas=(100, 200), times=((1.0, 5.0), (1.0, 5.0)))
    # below the grid in beta: 1 + (0-100)/100*4 = -3 -> clamped to 0
    assert p.estimate(0, 0) == 0.0


def test_negative_arguments_rejected() -> None:
    with pytest.raises(InvalidRequestError):
        PROFILE.estimate(-1, 10)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(alphas=(0,), betas=(1, 2), times=((1.0, 1.0),)),  # one point
        dict(alphas=(0, 0), betas=(1, 2), times=((1.0, 1.0), (1.0, 1.0))),  # not increasing
        dict(alphas=(5, 0), betas=(1, 2), times=((1.0, 1.0), (1.0, 1.0))),
        dict(alphas=(0, 5), betas=(1, 2), times=((1.0, 1.0),)),  # shape
        dict(alphas=(0, 5), betas=(1, 2), times=((1.0, 1.0), (1.0,))),
        dict(alphas=(0, 5), betas=(1, 2), times=((1.0, float("nan")), (1.0, 1.0))),
        dict(alphas=(0, 5), betas=(1, 2), times=((1.0, -0.1), (1.0, 1.0))),
        dict(alphas=(0, 5), betas=(1, 2), times=((1.0, float("inf")), (1.0, 1.0))),
    ],
)
def test_validation(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError):
        PrefillProfile(**kwargs)
    assert issubclass(InvalidRequestError, ValueError)


def test_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "profile.json"
    PROFILE.save(path)
    assert PrefillProfile.load(path) == PROFILE
    assert not [p for p in path.parent.iterdir() if p.name != "profile.json"]  # no temp left


def test_load_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        PrefillProfile.load(tmp_path / "nope.json")


def _tamper(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["payload"]["times"][0].__setitem__(0, 1.5),  # checksum mismatch
        lambda d: d.__setitem__("sha256", "0" * 64),
        lambda d: d.__setitem__("format", "something else"),
        lambda d: d.__setitem__("version", 2),
        lambda d: d["payload"].pop("betas"),
        lambda d: d.__setitem__("payload", [1, 2, 3]),
    ],
)
def test_tampered_file_is_corrupt(tmp_path: Path, edit) -> None:
    path = tmp_path / "p.json"
    PROFILE.save(path)
    _tamper(path, edit)
    with pytest.raises(CorruptFileError, match="p.json"):
        PrefillProfile.load(path)


def test_truncated_or_garbage_file_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    PROFILE.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptFileError, match="p.json"):
        PrefillProfile.load(path)
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CorruptFileError):
        PrefillProfile.load(path)


def test_wrong_schema_with_valid_checksum_is_corrupt(tmp_path: Path) -> None:
    # a self-consistent file (checksum matches) whose grid is invalid
    from ragcache_backend.cache.profile import _digest

    payload = {"alphas": [0], "betas": [1, 2], "times": [[1.0, 2.0]],
               "model_fingerprint": None, "dtype": None, "threads": None}
    doc = {"format": "ragcache.prefill_profile", "version": 1,
           "sha256": _digest(payload), "payload": payload}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptFileError, match="invalid grid"):
        PrefillProfile.load(path)
    payload["alphas"] = "01"
    doc["sha256"] = _digest(payload)
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptFileError):
        PrefillProfile.load(path)


def test_measure_profile_takes_min_over_repeats() -> None:
    calls: list[tuple[int, int]] = []
    noise = iter([0.5, 0.0, 0.25] * 100)

    def prefill(alpha: int, beta: int) -> float:
        calls.append((alpha, beta))
        return 0.001 * beta + 0.0001 * alpha + next(noise)

    p = measure_profile(prefill, repeats=3, model_fingerprint="fp", dtype="float32", threads=2)
    assert p.alphas == DEFAULT_ALPHAS and p.betas == DEFAULT_BETAS
    assert len(calls) == 3 * len(DEFAULT_ALPHAS) * len(DEFAULT_BETAS)
    for i, a in enumerate(DEFAULT_ALPHAS):
        for j, b in enumerate(DEFAULT_BETAS):
            assert p.times[i][j] == pytest.approx(0.001 * b + 0.0001 * a)
    assert (p.model_fingerprint, p.dtype, p.threads) == ("fp", "float32", 2)
    with pytest.raises(InvalidRequestError):
        measure_profile(prefill, repeats=0)


def test_measure_profile_is_made_monotone() -> None:
    # a slow spell at (alpha=0, beta=256) and at (alpha=512, beta=32): hand-computed running maxima
    measured = {(0, 32): 0.07, (0, 256): 6.0, (0, 1024): 1.6,
                (512, 32): 3.0, (512, 256): 0.37, (512, 1024): 1.8,
                (1536, 32): 0.15, (1536, 256): 0.53, (1536, 1024): 2.2}
    p = measure_profile(lambda a, b: measured[(a, b)], alphas=(0, 512, 1536), betas=(32, 256, 1024))
    assert p.times == ((0.07, 6.0, 6.0), (3.0, 6.0, 6.0), (3.0, 6.0, 6.0))
    clean = {k: 0.001 * k[1] + 0.0001 * k[0] for k in measured}  # already monotone: unchanged
    q = measure_profile(lambda a, b: clean[(a, b)], alphas=(0, 512, 1536), betas=(32, 256, 1024))
    assert q.times == tuple(tuple(clean[(a, b)] for b in (32, 256, 1024)) for a in (0, 512, 1536))
