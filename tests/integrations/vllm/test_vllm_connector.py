"""RAGCacheConnector inside real vLLM processes (vLLM's CPU build, from ``benchmarks/.venv-vllm``,
which ``make test`` installs), on the default model's weights as a Hugging Face folder
(``benchmarks/convert_model.py``): a prompt computed before a restart is served from our disk
tier with the same answer as vLLM without the connector; salts never share KV; damaged files are
recomputed, never an error; two replicas share blocks through a real Redis on loopback, and a Redis
that is down costs recomputation, never an error; an unsupported vLLM version is refused at start.

Each vLLM start takes ~40 s on 2 cores (eager: torch.compile would add ~75 s), so the engines run once
per module.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = ROOT / "benchmarks" / ".venv-vllm" / "bin" / "python"
MODEL = ROOT / "benchmarks" / "models" / "smollm2-135m-bf16"
DRIVER = Path(__file__).with_name("vllm_driver.py")

PASSAGE = ("The knowledge tree keeps the key-value tensors of retrieved documents so that a later request "
           "which retrieves the same documents in the same order skips their prefill. ")
PROMPT = "".join(f"Passage {i}. {PASSAGE}" for i in range(16)) + "Question: what does the knowledge tree keep?"
OTHER = "".join(f"Section {i}. The disk tier keeps checksummed files of key-value blocks, so that an engine "
                "started again finds what it computed before. " for i in range(16)) + "Question: what does section 3 say?"


def _require_vllm() -> None:
    if not VLLM_PY.exists() or not MODEL.is_dir():
        pytest.fail(f"the vLLM venv ({VLLM_PY}) or the model folder ({MODEL}) is missing: run `make test` "
                    "(it runs `make vllm-env`), or `make vllm-env` alone")


def run_vllm(tmp: Path, name: str, prompts: list[dict], *, connector: bool, cache_dir: Path | None = None,
             extra: dict | None = None) -> dict:
    """One vLLM engine answering ``prompts`` in turn; returns the driver's JSON."""
    _require_vllm()
    plist, out = tmp / f"{name}-prompts.json", tmp / f"{name}.json"
    plist.write_text(json.dumps(prompts))
    cfg = dict(extra or {})
    if cache_dir is not None:
        cfg["cache_dir"] = str(cache_dir)
    cmd = [str(VLLM_PY), str(DRIVER), "--model", str(MODEL), "--prompts", str(plist), "--out", str(out),
           "--extra", json.dumps(cfg)] + (["--connector"] if connector else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    env.update(HF_HUB_OFFLINE="1", RAGCACHE_HOME=str(tmp / "home"), PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"vLLM run {name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tests.conftest import RedisServer

    tmp = tmp_path_factory.mktemp("vllm-connector")
    redis = RedisServer(tmp)
    kv, kv_b = tmp / "kv", tmp / "kv-replica-b"
    plain, other = {"prompt": PROMPT}, {"prompt": OTHER}
    salted_a, salted_b = {"prompt": PROMPT, "salt": "tenant-a"}, {"prompt": PROMPT, "salt": "tenant-b"}
    shared = {"remote_url": redis.url}
    out = {"tmp": tmp, "kv": kv}
    try:
        out["without"] = run_vllm(tmp, "without", [plain, other], connector=False)
        out["first"] = run_vllm(tmp, "first", [plain, salted_a], connector=True, cache_dir=kv, extra=shared)
        out["restart"] = run_vllm(tmp, "restart", [plain, salted_a, salted_b], connector=True, cache_dir=kv,
                                  extra=shared)
        # requests aborted while their blocks load from disk (as soon as sent: racing the engine's
        # step) or right after the step that loaded and saved them; other's blocks are saved by
        # the aborted request only
        aborted = [{**plain, "abort_after_steps": 0}, {**plain, "abort_after_steps": 1},
                   {**other, "abort_after_steps": 1}, plain]
        out["aborted"] = run_vllm(tmp, "aborted", aborted, connector=True, cache_dir=kv, extra=shared)
        # another replica: its own (empty) disk tier, the same Redis
        out["replica_b"] = run_vllm(tmp, "replica_b", [plain, other], connector=True, cache_dir=kv_b, extra=shared)
    finally:
        redis.stop()
    files = sorted(kv.rglob("*.kv.safetensors"))
    out["files"] = len(files)
    for f in files:  # damage every entry: the next engine must recompute, with the same answer
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    # ... with Redis unreachable from its start: served by recomputation, never an error
    dead = {"remote_url": redis.url}
    out["damaged"] = run_vllm(tmp, "damaged", [plain], connector=True, cache_dir=kv, extra=dead)
    out["healed"] = run_vllm(tmp, "healed", [plain], connector=True, cache_dir=kv)
    return out


def test_a_restarted_vllm_is_served_from_our_disk_tier_with_the_same_answer(runs) -> None:
    first, restart, without = runs["first"]["results"], runs["restart"]["results"], runs["without"]["results"]
    n = first[0]["prompt_tokens"]
    assert n > 400 and first[0]["cached"] == 0
    assert runs["files"] >= 2 * (n // 32) - 2  # the plain and the salted prompt's full blocks
    assert restart[0]["cached"] >= 0.9 * n, restart[0]
    assert restart[0]["token_ids"] == without[0]["token_ids"] == first[0]["token_ids"]
    metrics = runs["restart"]["metrics"]
    assert metrics.get("vllm:ragcache_hit_tokens_disk", 0) >= restart[0]["cached"]


def test_salts_never_share_kv(runs) -> None:
    first, restart = runs["first"]["results"], runs["restart"]["results"]
    assert first[1]["cached"] == 0  # tenant-a after the plain prompt: nothing shared
    assert restart[1]["cached"] >= 0.9 * restart[1]["prompt_tokens"]  # tenant-a's own blocks, after the restart
    assert restart[2]["cached"] == 0  # tenant-b never sees tenant-a's or the plain blocks
    assert restart[1]["token_ids"] == restart[2]["token_ids"] == restart[0]["token_ids"]


def test_damaged_entries_are_recomputed_not_served(runs) -> None:
    damaged, without = runs["damaged"]["results"], runs["without"]["results"]
    assert damaged[0]["token_ids"] == without[0]["token_ids"]
    metrics = runs["damaged"]["metrics"]
    # every planned block failed its checks in the worker and was reported: vLLM recomputed them
    # (its log: "Recovered from KV load failure"; its cached-token count still includes them)
    assert metrics["vllm:ragcache_loaded_disk"] == 0
    assert metrics["vllm:ragcache_failed"] == metrics["vllm:ragcache_hit_tokens_disk"] // 32 >= 1
    assert "Recovered from KV load failure" in (runs["tmp"] / "damaged.log").read_text()
    # the damaged files were deleted and the recomputed blocks written again: the next engine hits
    healed = runs["healed"]
    assert healed["results"][0]["cached"] >= 0.9 * healed["results"][0]["prompt_tokens"]
    assert healed["metrics"]["vllm:ragcache_loaded_disk"] >= 18 and healed["metrics"]["vllm:ragcache_failed"] == 0
    assert healed["results"][0]["token_ids"] == without[0]["token_ids"]


def test_an_unsupported_vllm_version_is_refused_with_a_clear_message() -> None:
    _require_vllm()
    code = ("from ragcache_integrations.vllm.connector import check_version, UnsupportedVllmError\n"
            "check_version('0.32.0')\n"
            "try:\n    check_version('0.31.2')\nexcept UnsupportedVllmError as e:\n    print('REFUSED', e)\n")
    proc = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED RAGCacheConnector supports vLLM 0.32.x; this is vLLM 0.31.2" in proc.stdout


def test_a_prompt_computed_on_one_replica_is_a_hit_on_another_through_redis(runs) -> None:
    b, without = runs["replica_b"], runs["without"]["results"]
    n = b["results"][0]["prompt_tokens"]
    assert b["results"][0]["cached"] >= 0.9 * n
    assert b["metrics"]["vllm:ragcache_hit_tokens_remote"] >= 0.9 * n
    assert b["metrics"]["vllm:ragcache_loaded_remote"] >= 18 and b["metrics"]["vllm:ragcache_failed"] == 0
    assert b["results"][0]["token_ids"] == without[0]["token_ids"]


def test_requests_aborted_while_their_kv_loads_or_saves_leave_nothing_wrong_behind(runs) -> None:
    results, without = runs["aborted"]["results"], runs["without"]["results"]
    assert [r.get("aborted", False) for r in results] == [True, True, True, False]
    n = results[3]["prompt_tokens"]
    assert results[3]["cached"] >= 0.9 * n and results[3]["token_ids"] == without[0]["token_ids"]
    assert runs["aborted"]["metrics"]["vllm:ragcache_failed"] == 0
    # what the aborted request saved is whole: another replica reads other's blocks from Redis
    b = runs["replica_b"]["results"][1]
    assert b["cached"] >= 0.9 * b["prompt_tokens"] and b["token_ids"] == without[1]["token_ids"]


def test_redis_unreachable_from_the_start_is_served_by_recomputation(runs) -> None:
    log = (runs["tmp"] / "damaged.log").read_text()
    assert "serving by recomputation" in log
    assert runs["damaged"]["metrics"].get("vllm:ragcache_hit_tokens_remote", 0) == 0
