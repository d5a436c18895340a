"""What a miss costs under ``RAGCacheConnector``, by part (issue 21's miss-overhead target, <= 3%).

    .venv/bin/python benchmarks/connector_miss.py --config '{"host_mib": 1024, "disk_cache": false}' \\
        --config-b '{"host_mib": 0, "disk_cache": false}' [--remote] [--prefill 96] [--json OUT]

``vllm_connector.py``'s miss pass gives one figure for the whole connector after three passes of
traffic. This runs the same pass (prompts of its RAG trace made unique from their first token, 16
tokens each, one at a time, a second of quiet before each) against vLLM alone and one or two
``vllm serve`` processes with the connector under different settings (``kv_connector_extra_config``
as JSON: e.g. no tiers at all, the host tier alone, host and disk), the order rotating request by
request, so that the connector's parts can be told apart in one run:

* ``--prefill N`` first serves the trace's first N requests to every server (the state a server is
  in after traffic: host arena, disk folder and Redis filled, vLLM's prefix cache full);
* ``--remote`` starts a real ``redis-server`` on loopback; a config with ``"remote": false`` leaves
  it out for that server (each server gets its own Redis database and disk folder);
* ``--root-b DIR`` runs the second connector server from another checkout of this repository
  (``git worktree add DIR COMMIT``), to compare code versions side by side.

Printed per connector server: the geometric mean of the paired TTFT ratios against vLLM alone with
its 95% confidence interval, mean TTFT, the same ratio for the whole request (16 tokens: where a
cost moved off the first token shows), and the worker's own time copying the step's new blocks
into the host arena (``vllm:ragcache_save_us`` per block and per request). The servers share the
machine's cores: an idle vLLM worker polls for work, so every server up disturbs the others a
little, the same for all of them.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import vllm_connector as vc  # benchmarks/ is on sys.path when a script runs
from chat_traces import rag_trace

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default='{"host_mib": 1024}', help="connector server A's kv_connector_extra_config (JSON)")
    ap.add_argument("--config-b", default="", help="connector server B's (JSON; empty: no server B)")
    ap.add_argument("--root-b", default="", help="a checkout of this repository server B runs from (default: this one)")
    ap.add_argument("--remote", action="store_true", help="a Redis on loopback for the remote tier")
    ap.add_argument("--prefill", type=int, default=0, help="trace requests served to every server before the misses")
    ap.add_argument("--requests", type=int, default=36, help="miss requests (each sent to every server)")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds of quiet before each request")
    ap.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "auto"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    cpu = vc.cpu_info()
    dtype = ("bfloat16" if cpu["avx512_bf16"] else "float32") if a.dtype == "auto" else a.dtype
    args = argparse.Namespace(requests=96, k=3, max_tokens=16, dtype=dtype, kv_bytes=128 * MiB, host_mib=1024, seed=a.seed,
                              max_concurrency=1, request_rate="inf", client_timeout=3600, vllm_block_size=32,
                              vllm_prefix_match_unit=0)
    out = a.out_dir or Path(tempfile.mkdtemp(prefix="connector-miss-"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    from ragcache_backend.bench.workload import question_pool
    from ragcache_integrations import default_store

    store = default_store()
    rows, _ = rag_trace(store, question_pool(store, k=3, faq=True, mmlu=0, seed=a.seed), 96, a.seed)
    redis = vc.Redis(out) if a.remote else None
    if redis is not None and redis.error:
        raise SystemExit(f"no Redis: {redis.error}")
    configs = {"A": json.loads(a.config)}
    if a.config_b:
        configs["B"] = json.loads(a.config_b)

    def connector_server(name: str, config: dict, root: str) -> vc.Server:
        config = dict(config)
        if config.get("disk_cache", True):
            config.setdefault("cache_dir", str(out / f"kv-{name}"))
        if redis is not None and config.pop("remote", True):
            config["remote_url"] = redis.url.rsplit("/", 1)[0] + ("/1" if name == "A" else "/2")
        config.pop("remote", None)
        return vc.start_vllm(args, out, extra=vc.connector_flags(config), env={"RAGCACHE_HOME": str(out / f"home-{name}")},
                             log_name=f"connector-{name}.log", cwd=Path(root))

    servers = {"vllm": vc.start("vllm", args, out, out / "kv")}
    try:
        for name, config in configs.items():
            servers[name] = connector_server(name, config, a.root_b if name == "B" and a.root_b else str(vc.ROOT))
        for j in range(a.prefill):
            for server in servers.values():
                vc.stream_ttft_ms(server.base, rows[j % len(rows)]["prompt"], args.max_tokens)
        before = {k: vc.tier_counters(s.base) for k, s in servers.items() if k != "vllm"}
        rng = random.Random(a.seed + 1)
        ttft: dict[str, list[float]] = {k: [] for k in servers}
        total: dict[str, list[float]] = {k: [] for k in servers}  # until the stream's end (16 tokens)
        names = list(servers)
        for i in range(a.requests):
            messages = vc.miss_prompt(rows, i, rng)
            r = i % len(names)
            for name in names[r:] + names[:r]:
                time.sleep(a.gap)
                first, end = vc.stream_ms(servers[name].base, messages, args.max_tokens)
                ttft[name].append(first)
                total[name].append(end)
        result: dict = {"vllm_mean_ttft_ms": statistics.fmean(ttft["vllm"]),
                        "vllm_mean_total_ms": statistics.fmean(total["vllm"])}
        for name in configs:
            ratio, ci95 = vc.paired_ratio(ttft["vllm"], ttft[name])
            total_ratio, total_ci95 = vc.paired_ratio(total["vllm"], total[name])
            after = vc.tier_counters(servers[name].base)
            delta = {k: after[k] - before[name].get(k, 0.0) for k in after if not k.endswith("_created")}
            saved = delta.get("ragcache_saved_host_total", 0.0)
            result[name] = {"config": configs[name], "root": a.root_b if name == "B" and a.root_b else str(vc.ROOT),
                            "paired_ratio": ratio, "paired_ratio_ci95": ci95,
                            "mean_ttft_ms": statistics.fmean(ttft[name]),
                            "total_paired_ratio": total_ratio, "total_paired_ratio_ci95": total_ci95,
                            "mean_total_ms": statistics.fmean(total[name]),
                            "save_us_per_block": delta.get("ragcache_save_us_total", 0.0) / saved if saved else None,
                            "save_ms_per_request": delta.get("ragcache_save_us_total", 0.0) / 1000 / a.requests,
                            "saved_host_blocks": saved}
    finally:
        for server in servers.values():
            server.stop()
        if redis is not None:
            redis.stop()
    print(f"connector_miss | {started} | {cpu['model']}, {cpu['cpus']} CPUs | {dtype} | {a.requests} misses, "
          f"{a.gap:.1f} s apart, after {a.prefill} trace requests | Redis {'yes' if a.remote else 'no'}")
    print(f"vLLM alone: mean TTFT {result['vllm_mean_ttft_ms']:.1f} ms, whole request {result['vllm_mean_total_ms']:.1f} ms")
    for name in configs:
        r = result[name]
        per_block = f"{r['save_us_per_block']:.0f} us/block" if r["save_us_per_block"] else "no host saves"
        print(f"{name} {json.dumps(r['config'])}: paired ratio {r['paired_ratio']:.3f} (95% CI {r['paired_ratio_ci95'][0]:.3f}-"
              f"{r['paired_ratio_ci95'][1]:.3f}), mean TTFT {r['mean_ttft_ms']:.1f} ms; host-arena copies "
              f"{per_block}, {r['save_ms_per_request']:.1f} ms/request; whole request (16 tokens): paired ratio "
              f"{r['total_paired_ratio']:.3f} (95% CI {r['total_paired_ratio_ci95'][0]:.3f}-{r['total_paired_ratio_ci95'][1]:.3f})")
    if a.json:
        a.json.write_text(json.dumps({"benchmark": "connector_miss", "date": started, "cpu": cpu,
                                      "command": " ".join([Path(sys.executable).name, *sys.argv]),
                                      "args": {k: str(v) for k, v in vars(a).items()}, "result": result,
                                      "ttft_ms": ttft, "total_ms": total}, indent=1))


if __name__ == "__main__":
    main()
