"""Smoke test of `ragcache bench --quick` (our engine only, about two minutes on 2 idle cores)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_bench_quick_runs_and_writes_json(tmp_path, faq_dir):
    typer = pytest.importorskip("typer")
    from typer.testing import CliRunner

    from ragcache_backend.bench.bench import bench

    app = typer.Typer()
    app.command()(bench)
    res = CliRunner().invoke(app, ["--quick", "--out", str(tmp_path), "--requests", "12"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["systems"]) == {"ragcache", "no-cache", "lru-device"}
    for runs in data["systems"].values():
        for summary in runs.values():
            assert summary["completed"] == summary["requests"] == 12  # nothing lost
            assert summary["ttft_mean_s"] > 0
    rc = data["systems"]["ragcache"]
    assert all(s["token_hit_rate"] > 0 for s in rc.values())
    assert all(s["token_hit_rate"] == 0 for s in data["systems"]["no-cache"].values())
    assert "share_requests_hitting_top_corpus" in data["workload"]["skew"]
    assert "ragcache" in (tmp_path / "summary.md").read_text()
