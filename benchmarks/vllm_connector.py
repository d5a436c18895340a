"""vLLM with and without ragcache as its KV cache (issue 21): `vllm serve` alone (automatic prefix
caching) against `vllm serve` with ``RAGCacheConnector`` (our host and disk tiers under it), and
vLLM's own CPU offloading connector at equal host memory, on a RAG trace over the Python docs whose
working set is larger than vLLM's KV memory; the same after a restart, and on a second replica
that shares only a Redis with the first.

    .venv/bin/python benchmarks/vllm_connector.py --json out.json

Trace: ``--requests`` context-first RAG chats (system prompt, then ``--k`` Python-docs passages and
the question in one user message; Zipf document popularity, as ``prefix_reuse_vs_vllm.py``'s
``rag`` trace), sent by vLLM's own client (``vllm bench serve --backend openai-chat``), one at a
time, ``--max-tokens`` each, temperature 0.

Systems (same weights ``benchmarks/models/smollm2-135m-bf16``, ``--dtype``, block size 32, KV
memory ``--kv-bytes`` each):
* ``vllm``: prefix caching only;
* ``vllm+ragcache``: plus ``RAGCacheConnector`` with a host tier of ``--host-mib``, a disk tier
  (4 GiB, a fresh folder) and a remote tier in a real ``redis-server`` on loopback (started here;
  ``--no-remote`` leaves it out, and then the replica pass too);
* ``vllm+memory``: vLLM alone given the connectors' host memory as KV memory too (``--kv-bytes``
  + ``--host-mib``): on a CPU the "device" KV and a host tier are the same DRAM, so this is the
  best vLLM does with the same memory, and the stand-in for its own offloading where that does
  not run (below); it is stopped before the miss pass (an idle vLLM server still costs the others
  CPU on two cores);
* ``vllm+offloading``: plus vLLM's ``--kv-offloading-size`` (its ``OffloadingConnector``) at
  ``--host-mib``; on vLLM's CPU build it refuses to start, and its error is reported;
* ``vllm+simple-offload``: plus vLLM's other built-in CPU offloading connector,
  ``SimpleCPUOffloadConnector`` (``cpu_bytes_to_use`` = ``--host-mib``); it too is written for
  CUDA streams, and its error is reported where it does not start;
* ``vllm+lmcache``: plus LMCache 0.5.x (``LMCacheConnectorV1``, CPU backend of ``--host-mib``,
  from ``benchmarks/.lmcache-site``: ``bash benchmarks/setup_peers.sh lmcache``); its error is
  reported when it does not start.

Passes, interleaved (both servers stay up, idle while the other runs): ``cold`` (empty caches),
``warm`` (the same trace again), then each server is restarted and runs ``restart``; last, ours is
stopped and a second replica starts with its own empty host and disk tiers and the same Redis, and
runs ``replica`` (compared with vLLM alone's ``cold``: a fresh vLLM replica has nothing). Per pass: mean,
median and p99 TTFT, throughput, the cached-token fraction (``vllm:prompt_tokens_cached_total /
vllm:prompt_tokens_total``), tokens vLLM took from the connector
(``vllm:external_prefix_cache_hits_total``) and our per-tier counters (``vllm:ragcache_*``).
Last, while both are still up, the ``miss`` pass measures what ours costs a request nothing can
serve: ``--miss-requests`` prompts of the trace made unique from their first token (a random
session line), sent to vLLM alone and to ours in turn (the order alternating), one at a time with
``--miss-gap`` seconds of quiet before each (a 2-core machine's servers disturb each other's
measurements otherwise); its figure is the geometric mean of the paired TTFT ratios with a 95%
confidence interval. The cold pass's requests whose document list is new give a second, noisier
estimate.
Targets (issue 21): mean TTFT with ours <= 0.6x vLLM alone and <= 0.85x vLLM's own offloading;
after a restart >= 90% of the warm hit rate (and, reported beside it, on the second replica); miss
overhead <= 3%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_client import SERVED, Server, cpu_info, failure, log_tail, measure, start_vllm, versions
from benchmark_report import write_report  # benchmarks/ is on sys.path when a script runs
from chat_traces import rag_trace, write_jsonl
from serve_load import ROOT, free_port, metrics_values, one_request

MiB = 1 << 20
SYSTEMS = ("vllm", "vllm+ragcache", "vllm+memory", "vllm+offloading", "vllm+simple-offload", "vllm+lmcache")
LMCACHE_SITE = ROOT / "benchmarks" / ".lmcache-site"


def log_name(system: str) -> str:
    return f"{system.replace('+', '-')}-serve.log"


class Redis:
    """A real ``redis-server`` on loopback for the remote tier (no persistence), or the reason it is not."""

    def __init__(self, out_dir: Path) -> None:
        self.url, self.error, self.proc = None, None, None
        exe = shutil.which("redis-server")
        if exe is None:
            self.error = "redis-server is not installed (apt-get install redis-server)"
            return
        port = free_port()
        self.proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", str(out_dir)], stdout=open(out_dir / "redis.log", "ab"),
                                     stderr=subprocess.STDOUT)
        import redis

        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(100):
            try:
                client.ping()
                self.url = f"redis://127.0.0.1:{port}/0"
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        self.error = "redis-server did not answer PING in 10 s"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def connector_flags(config: dict) -> list[str]:
    """``vllm serve``'s flags that load ``RAGCacheConnector`` with ``config`` as its
    ``kv_connector_extra_config``."""
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "RAGCacheConnector", "kv_connector_module_path": "ragcache_integrations.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": config})]


def start(system: str, args, out_dir: Path, kv_dir: Path, *, remote_url: str | None = None,
          log: str | None = None) -> Server:
    """``vllm serve`` as ``system`` runs it (block size 32, ``args.kv_bytes`` of KV each)."""
    extra: list[str] = []
    env = {"RAGCACHE_HOME": str(out_dir / "ragcache-home")}
    if system == "vllm+ragcache":
        config = {"host_mib": args.host_mib, "cache_dir": str(kv_dir), "disk_budget_mib": 4096}
        if remote_url:
            config["remote_url"] = remote_url
        extra = connector_flags(config)
        env["PYTHONPATH"] = str(ROOT)
    elif system == "vllm+memory":  # the same DRAM as KV memory (see the module docstring)
        args = argparse.Namespace(**{**vars(args), "kv_bytes": args.kv_bytes + args.host_mib * MiB})
    elif system == "vllm+offloading":
        extra = ["--kv-offloading-size", str(args.host_mib / 1024)]
    elif system == "vllm+simple-offload":
        extra = ["--kv-transfer-config", json.dumps({"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                                                     "kv_connector_extra_config": {"cpu_bytes_to_use": args.host_mib * MiB}})]
    elif system == "vllm+lmcache":
        if not (LMCACHE_SITE / ".ok").exists():
            raise RuntimeError(f"LMCache is not installed in {LMCACHE_SITE}: bash benchmarks/setup_peers.sh lmcache")
        extra = ["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})]
        env.update(PYTHONPATH=str(LMCACHE_SITE), LMCACHE_LOCAL_CPU="True", LMCACHE_CHUNK_SIZE="256",
                   LMCACHE_MAX_LOCAL_CPU_SIZE=str(args.host_mib / 1024))
    return start_vllm(args, out_dir, extra=extra, env=env, log_name=log or log_name(system))


def tier_counters(base: str) -> dict[str, float]:
    m = metrics_values(base)
    out = {k.split("{")[0].removeprefix("vllm:"): 0.0 for k in m if k.startswith("vllm:ragcache_")}
    for k, v in m.items():
        name = k.split("{")[0]
        if name.startswith("vllm:ragcache_"):
            out[name.removeprefix("vllm:")] += v
    out["external_hits"] = sum(v for k, v in m.items() if k.split("{")[0] == "vllm:external_prefix_cache_hits_total")
    return out


def run_pass(server: Server, label: str, spec: dict, args, out_dir: Path) -> dict:
    pass_dir = out_dir / label
    pass_dir.mkdir(parents=True, exist_ok=True)
    before = tier_counters(server.base)
    row = measure(server, "rag", spec, args, pass_dir)
    after = tier_counters(server.base)
    row["connector"] = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}
    row["startup_s"] = server.startup_s
    return row


def stream_ttft_ms(base: str, messages: list[dict], max_tokens: int) -> float:
    """One streamed chat request (``serve_load.one_request``); milliseconds until its first content chunk.

    Raises:
        RuntimeError: the request failed, or the stream ended without content.
    """
    return stream_ms(base, messages, max_tokens)[0]


def stream_ms(base: str, messages: list[dict], max_tokens: int) -> tuple[float, float]:
    """:func:`stream_ttft_ms`, and the milliseconds until the stream ended: ``(ttft, total)``.

    Raises:
        RuntimeError: the request failed, or the stream ended without content.
    """
    async def one() -> dict:
        async with httpx.AsyncClient(timeout=600) as client:
            return await one_request(client, base + "/v1/chat/completions", SERVED, {"messages": messages},
                                     max_tokens, False, time.perf_counter())

    res = asyncio.run(one())
    if "error" in res:
        raise RuntimeError(res["error"])
    if not res["completion_tokens"]:
        raise RuntimeError("the stream ended without content")
    return res["ttft_s"] * 1000, res["total_s"] * 1000


def miss_prompt(rows: list[dict], i: int, rng: random.Random) -> list[dict]:
    """Request ``i`` of the miss pass: the trace's prompt ``i`` (cycling) made unique from its first
    token by a random session line (a copy; ``rows`` unchanged)."""
    messages = json.loads(json.dumps(rows[i % len(rows)]["prompt"]))
    messages[0]["content"] = f"Session {rng.getrandbits(64):016x}.\n" + messages[0]["content"]
    return messages


def paired_ratio(base: list[float], other: list[float]) -> tuple[float, list[float]]:
    """The geometric mean of ``other[i] / base[i]`` and its 95% confidence interval (normal, over the
    logs; at least two pairs)."""
    logs = [math.log(b / a) for a, b in zip(base, other)]
    mean, half = statistics.fmean(logs), 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), [math.exp(mean - half), math.exp(mean + half)]


def miss_pass(alone: Server, ours: Server, rows: list[dict], args) -> dict:
    """Misses sent to both in turn (see the module docstring): per-system TTFTs and the paired ratio."""
    rng = random.Random(args.seed + 1)
    ttft: dict[str, list[float]] = {"vllm": [], "vllm+ragcache": []}
    for i in range(args.miss_requests):
        messages = miss_prompt(rows, i, rng)
        order = [("vllm", alone), ("vllm+ragcache", ours)]
        for name, server in order if i % 2 == 0 else order[::-1]:
            time.sleep(args.miss_gap)
            ttft[name].append(stream_ttft_ms(server.base, messages, args.max_tokens))
    ratio, ci95 = paired_ratio(ttft["vllm"], ttft["vllm+ragcache"])
    return {"requests": len(ttft["vllm"]), "gap_s": args.miss_gap,
            "mean_ttft_ms": {k: statistics.fmean(v) for k, v in ttft.items()},
            "median_ttft_ms": {k: statistics.median(v) for k, v in ttft.items()},
            "paired_ratio": ratio, "paired_ratio_ci95": ci95, "ttft_ms": ttft}


def short(row: dict) -> str:
    if "error" in row:
        return f"error: {row['error'][:160]}"
    return (f"mean TTFT {row['mean_ttft_ms']:.1f} ms, p99 {row['p99_ttft_ms']:.1f}, cached {row['cached_fraction']:.3f}, "
            f"{row['completed']} ok / {row['failed']} failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "auto"])
    ap.add_argument("--kv-bytes", type=int, default=128 * MiB, help="vLLM's KV memory in every system, bytes")
    ap.add_argument("--host-mib", type=int, default=1024, help="host memory of the connectors, MiB")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-remote", action="store_true", help="no Redis tier and no second-replica pass")
    ap.add_argument("--miss-requests", type=int, default=48, help="requests of the miss pass (0: none)")
    ap.add_argument("--miss-gap", type=float, default=1.0, help="seconds of quiet before each miss-pass request")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    # what start_vllm() / measure() / run_client() read
    args.max_concurrency, args.request_rate, args.client_timeout = 1, "inf", 3600
    args.vllm_block_size, args.vllm_prefix_match_unit = 32, 0
    cpu = cpu_info()
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu["avx512_bf16"] else "float32"
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="vllm-connector-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    kv_dir = out_dir / "ragcache-kv"
    shutil.rmtree(kv_dir, ignore_errors=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"outputs in {out_dir}", file=sys.stderr, flush=True)

    from ragcache_backend.bench.workload import question_pool
    from ragcache_integrations import default_store

    store = default_store()
    pool = question_pool(store, k=args.k, faq=True, mmlu=0, seed=args.seed)
    rows, meta = rag_trace(store, pool, args.requests, args.seed)
    path = out_dir / "rag.jsonl"
    digest = write_jsonl(path, rows)
    spec = {"path": path, "num": len(rows), "meta": meta}

    systems = [s for s in args.systems.split(",") if s]
    runs: dict[str, dict] = {s: {"passes": {}} for s in systems}
    servers: dict[str, Server] = {}
    redis = Redis(out_dir) if "vllm+ragcache" in systems and not args.no_remote else None
    if redis is not None and redis.error:
        runs["vllm+ragcache"]["passes"]["replica"] = {"error": redis.error}
        print(f"[vllm+ragcache] no remote tier: {redis.error}", file=sys.stderr, flush=True)
    remote_url = redis.url if redis is not None else None
    for system in systems:
        try:
            servers[system] = start(system, args, out_dir, kv_dir, remote_url=remote_url)
            runs[system]["command"] = " ".join(servers[system].cmd)
        except Exception as exc:  # reported, never hidden, with the worker's own exception when there is one
            log = out_dir / log_name(system)
            cause = [line.split("] ", 1)[-1] for line in log_tail(log, 200_000).splitlines()
                     if "Exception: " in line or "Worker failed with error" in line]
            runs[system]["error"] = failure(exc, log_tail(log))["error"] + (f" [worker: {cause[0]}]" if cause else "")
            print(f"[{system}] did not start: {runs[system]['error'][:300]}", file=sys.stderr, flush=True)
    for label in ("cold", "warm", "restart"):
        if label == "restart":
            for system in list(servers):
                servers[system].stop()
                try:
                    servers[system] = start(system, args, out_dir, kv_dir, remote_url=remote_url)
                except Exception as exc:
                    runs[system]["passes"]["restart"] = failure(exc, "")
                    del servers[system]
        for system, server in servers.items():
            try:
                row = run_pass(server, f"{system.replace('+', '-')}-{label}", spec, args, out_dir)
            except Exception as exc:
                row = failure(exc, server.log_tail())
            runs[system]["passes"][label] = row
            print(f"[{system}] {label}: {short(row)}", file=sys.stderr, flush=True)
    if "vllm+memory" in servers:  # an idle server disturbs the miss pass's two
        servers.pop("vllm+memory").stop()
    miss: dict = {}
    if args.miss_requests and "vllm" in servers and "vllm+ragcache" in servers:
        try:
            miss = miss_pass(servers["vllm"], servers["vllm+ragcache"], rows, args)
        except Exception as exc:
            miss = failure(exc, servers["vllm+ragcache"].log_tail())
        print(f"[miss] {json.dumps({k: v for k, v in miss.items() if k != 'ttft_ms'})[:400]}", file=sys.stderr, flush=True)
    for server in servers.values():
        server.stop()
    if remote_url and "vllm+ragcache" in runs and "error" not in runs["vllm+ragcache"]:
        # a second replica: its own empty host and disk tiers, the same Redis; the first one is stopped
        try:
            replica = start("vllm+ragcache", args, out_dir, out_dir / "ragcache-kv-replica-b", remote_url=remote_url,
                            log="vllm-ragcache-replica-b-serve.log")
            try:
                row = run_pass(replica, "vllm-ragcache-replica", spec, args, out_dir)
            finally:
                replica.stop()
        except Exception as exc:
            row = failure(exc, "")
        runs["vllm+ragcache"]["passes"]["replica"] = row
        print(f"[vllm+ragcache] replica: {short(row)}", file=sys.stderr, flush=True)
    if redis is not None:
        redis.stop()

    report = {"benchmark": "vllm_connector", "date": started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "cpu": cpu, "versions": versions(), "out_dir": str(out_dir),
              "config": {"dtype": args.dtype, "kv_bytes": args.kv_bytes, "host_mib": args.host_mib, "block_size": 32,
                         "max_tokens": args.max_tokens, "requests": len(rows), "k": args.k, "seed": args.seed,
                         "remote": bool(remote_url), "miss_requests": args.miss_requests, "miss_gap_s": args.miss_gap},
              "dataset": {"path": str(path), "sha256_16": digest, **{k: v for k, v in meta.items()
                                                                      if not k.endswith("_of_request")}},
              "runs": runs, "miss": miss}
    report["comparison"] = compare(runs, miss)
    write_report(report, args.json, echo=args.json is None)
    print_table(report)


def compare(runs: dict, miss: dict) -> dict:
    ours, alone = runs.get("vllm+ragcache", {}).get("passes", {}), runs.get("vllm", {}).get("passes", {})
    out: dict = {}
    for label in ("cold", "warm", "restart"):
        a, b = ours.get(label, {}), alone.get(label, {})
        if a.get("mean_ttft_ms") and b.get("mean_ttft_ms"):
            out[f"{label}_mean_ttft_ratio"] = a["mean_ttft_ms"] / b["mean_ttft_ms"]
            out[f"{label}_p99_ttft_ratio"] = a["p99_ttft_ms"] / b["p99_ttft_ms"]
    warm, restart, replica = ours.get("warm", {}), ours.get("restart", {}), ours.get("replica", {})
    if warm.get("cached_fraction") and restart.get("cached_fraction") is not None:
        out["restart_over_warm_hit_rate"] = restart["cached_fraction"] / warm["cached_fraction"]
    if warm.get("cached_fraction") and replica.get("cached_fraction") is not None:
        out["replica_over_warm_hit_rate"] = replica["cached_fraction"] / warm["cached_fraction"]
    if replica.get("mean_ttft_ms") and alone.get("cold", {}).get("mean_ttft_ms"):
        out["replica_mean_ttft_vs_alone_cold"] = replica["mean_ttft_ms"] / alone["cold"]["mean_ttft_ms"]
    a, b = ours.get("cold", {}), alone.get("cold", {})
    if a.get("mean_ttft_ms_documents_first_seen") and b.get("mean_ttft_ms_documents_first_seen"):
        out["miss_overhead_cold_pass"] = a["mean_ttft_ms_documents_first_seen"] / b["mean_ttft_ms_documents_first_seen"] - 1
    if miss.get("paired_ratio"):
        out["miss_overhead"] = miss["paired_ratio"] - 1
        out["miss_overhead_ci95_low"], out["miss_overhead_ci95_high"] = (x - 1 for x in miss["paired_ratio_ci95"])
    for peer in ("vllm+memory", "vllm+offloading", "vllm+simple-offload", "vllm+lmcache"):
        for label in ("cold", "warm", "restart"):
            theirs = runs.get(peer, {}).get("passes", {}).get(label, {})
            if ours.get(label, {}).get("mean_ttft_ms") and theirs.get("mean_ttft_ms"):
                out[f"{label}_mean_ttft_vs_{peer.removeprefix('vllm+')}"] = ours[label]["mean_ttft_ms"] / theirs["mean_ttft_ms"]
    out["targets"] = {"warm_mean_ttft_vs_alone": "<= 0.6", "vs_offloading": "<= 0.85",
                      "restart_over_warm_hit_rate": ">= 0.9", "miss_overhead": "<= 0.03"}
    return out


def print_table(report: dict) -> None:
    cpu, cfg = report["cpu"], report["config"]
    print(f"\nvLLM with and without RAGCacheConnector | {report['date']} | {cpu['model']}, {cpu['cpus']} CPUs, "
          f"AVX512-BF16 {'yes' if cpu['avx512_bf16'] else 'no'} | dtype {cfg['dtype']} | vLLM KV {cfg['kv_bytes'] / MiB:.0f} MiB "
          f"each (vllm+memory: + the host memory), connector host {cfg['host_mib']} MiB (+ disk 4 GiB{' + Redis' if cfg.get('remote') else ''} for ours) | {cfg['requests']} RAG requests, "
          f"k={cfg['k']}, max_tokens {cfg['max_tokens']} | vLLM {report['versions'].get('vllm')} | ragcache "
          f"{report['versions'].get('ragcache_commit')}")
    print(f"command: {report['command']}\n")
    print(f"{'system':18} {'pass':8} {'mean TTFT':>10} {'p50':>8} {'p99':>8} {'req/s':>7} {'cached':>7} {'ext. hits':>9}  tiers")
    for system, run in report["runs"].items():
        if "error" in run:
            print(f"{system:18} error: {run['error'][:300]}")
            continue
        for label, row in run["passes"].items():
            if "error" in row:
                print(f"{system:18} {label:8} error: {row['error'][:200]}")
                continue
            c = row.get("connector", {})
            tiers = (f"host {c.get('ragcache_hit_tokens_host_total', 0):.0f} / disk {c.get('ragcache_hit_tokens_disk_total', 0):.0f}"
                     f" / remote {c.get('ragcache_hit_tokens_remote_total', 0):.0f} tokens, failed "
                     f"{c.get('ragcache_failed_total', 0):.0f}" if system == "vllm+ragcache" else "")
            print(f"{system:18} {label:8} {row['mean_ttft_ms']:10.1f} {row['median_ttft_ms']:8.1f} {row['p99_ttft_ms']:8.1f} "
                  f"{row['request_throughput']:7.2f} {row['cached_fraction']:7.3f} {c.get('external_hits', 0):9.0f}  {tiers}")
    miss = report.get("miss") or {}
    if miss.get("paired_ratio"):
        print(f"miss pass: {miss['requests']} unique prompts to each, {miss['gap_s']:.1f} s apart: mean TTFT "
              f"{miss['mean_ttft_ms']['vllm+ragcache']:.1f} ms ours / {miss['mean_ttft_ms']['vllm']:.1f} ms alone; paired "
              f"ratio {miss['paired_ratio']:.3f} (95% CI {miss['paired_ratio_ci95'][0]:.3f}-{miss['paired_ratio_ci95'][1]:.3f})")
    elif "error" in miss:
        print(f"miss pass: error: {miss['error'][:300]}")
    print()
    for k, v in report["comparison"].items():
        if k != "targets":
            print(f"{k:34} {v:.3f}")
    print("targets:", report["comparison"]["targets"])


if __name__ == "__main__":
    main()
