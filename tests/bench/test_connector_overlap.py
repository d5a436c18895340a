"""benchmarks/connector_overlap.py (a GPU benchmark) kept runnable: its logic on the CPU, small."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_connector_overlap_runs_on_cpu_and_checks_its_loads(tmp_path) -> None:
    base = tmp_path / "worker.py"  # the comparison path: a worker module loaded from a file
    base.write_text((ROOT / "ragcache_integrations/vllm/worker.py").read_text())
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/connector_overlap.py"), "--device", "cpu",
                    "--shape", "smollm2-135m", "--dtype", "float32", "--cached-tokens", "48", "--new-tokens", "32",
                    "--repeats", "1", "--base-file", str(base), "--json", str(out)], check=True, timeout=300,
                   capture_output=True)
    res = json.loads(out.read_text())
    assert res["loaded_blocks_exact"] == {"this": True, ", base": True}
    assert set(res["median_ms"]) == {"resident", "compute all", "load", "save", "load, base", "save, base"}
    assert res["loaded_mib"] == 3 * 30 * 3 * 16 * 128 * 4 / 2**20  # 3 blocks of 30 layers, 3 heads, 16 tokens
