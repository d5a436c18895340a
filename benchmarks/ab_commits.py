"""One benchmark at two versions of ragcache, alternating on this machine: is the new one slower?

    .venv/bin/python benchmarks/ab_commits.py --base 95dcb37 --rounds 2 \\
        --metric cold=summary.cold.ours.median_s --metric decode1=summary.decode1.ours.median_s \\
        -- forward_vs_vllm.py --no-vllm --dtype float32 --repeats 3

The base version is a git worktree of ``--base`` (under ``benchmarks/.cache/ab-<rev>``, sharing
this tree's untracked ``benchmarks/models``, ``benchmarks/.venv-vllm`` and ``.venv``, whose console
scripts servers are started with); the new one is this working tree. Each round runs the benchmark script once per version, in alternating
order (base first in odd rounds), each with ``PYTHONPATH`` on its own tree and the same venv, and
``--json`` pointing at a file of its own. Every ``--metric NAME=DOTTED.PATH`` is read from each
run's JSON; the report gives, per metric, every run's value, the median per version and the ratio
new / base (for times: above 1 is slower). The VM is shared and noisy: ratios within ~1.3x of 1
between runs at different times are noise; alternating rounds in one run is the fair comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def worktree(rev: str) -> Path:
    """A checkout of ``rev`` (created once, reused)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = HERE / ".cache" / f"ab-{sha}"
    if not (path / "ragcache_backend").is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--force", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    for shared in ("models", ".venv-vllm"):  # untracked benchmark inputs both versions use
        link = path / "benchmarks" / shared
        if (HERE / shared).exists() and not link.exists():
            link.symlink_to(HERE / shared)
    venv = path / ".venv"  # scripts that start servers run the venv's console scripts (PYTHONPATH picks the tree)
    if (ROOT / ".venv").exists() and not venv.exists():
        venv.symlink_to(ROOT / ".venv")
    return path


def lookup(data, dotted: str) -> float:
    """The number at ``dotted`` in ``data`` (a list there: its median).

    Raises:
        KeyError: the path is not in the JSON.
    """
    for part in dotted.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return statistics.median(data) if isinstance(data, list) else float(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the base version")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--metric", action="append", required=True, help="NAME=DOTTED.PATH into the benchmark's JSON")
    ap.add_argument("--out", type=Path, default=HERE / "logs" / "ab")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS... (a script in benchmarks/)")
    args = ap.parse_args()
    script = [a for a in args.script if a != "--"]
    if not script:
        ap.error("give the benchmark after --")
    metrics = dict(m.split("=", 1) for m in args.metric)
    args.out = args.out.resolve()  # the runs' working folders are their trees
    trees = {"base": worktree(args.base), "new": ROOT}
    args.out.mkdir(parents=True, exist_ok=True)
    values: dict[str, dict[str, list[float]]] = {name: {"base": [], "new": []} for name in metrics}
    runs = []
    for rnd in range(args.rounds):
        for side in ("base", "new") if rnd % 2 == 0 else ("new", "base"):
            tree = trees[side]
            out = args.out / f"{Path(script[0]).stem}-{side}-{rnd}.json"
            cmd = [sys.executable, str(tree / "benchmarks" / script[0]), *script[1:], "--json", str(out)]
            env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
            t0 = time.perf_counter()
            print(f"round {rnd + 1}/{args.rounds}: {side} ({tree})", flush=True)
            subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
            runs.append({"round": rnd, "side": side, "json": str(out), "wall_s": time.perf_counter() - t0})
            data = json.loads(out.read_text())
            for name, path in metrics.items():
                values[name][side].append(lookup(data, path))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"\n{' '.join(script)}: base {args.base} vs the working tree, {args.rounds} alternating rounds; "
          f"{cpu}, {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    fmt = "{:<16} {:>26} {:>26} {:>12}"
    print(fmt.format("metric", "base (median of runs)", "new (median of runs)", "new / base"))
    report = {"base": args.base, "script": script, "rounds": args.rounds, "cpu": cpu, "runs": runs, "metrics": {}}
    for name in metrics:
        b, n = statistics.median(values[name]["base"]), statistics.median(values[name]["new"])
        ratio = n / b if b else float("nan")
        report["metrics"][name] = {"base": values[name]["base"], "new": values[name]["new"], "ratio": ratio}
        print(fmt.format(name, f"{b:.4g}", f"{n:.4g}", f"{ratio:.3f}"))
    (args.out / f"{Path(script[0]).stem}-ab.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
