"""Load test of `ragcache serve` (and `vllm serve`, when its peer venv exists) on loopback.

Both servers get the same trace: ``--clients`` concurrent streaming chat requests, all sent at
once (a burst, the hardest case for admission and memory), each the default system prompt plus a
user message ``documents + question`` built from the Python docs with skewed document popularity
(:mod:`ragcache_backend.bench.workload`). ragcache also receives the documents in its ``documents``
body field (that is its API for document reuse); vLLM reuses prefixes by itself.

Per server and burst (``--bursts``, the first on a cold cache) it reports: requests answered /
failed (with the error), TTFT p50/p99 (time to the first streamed content), end-to-end p50/p99,
output tokens per second over the burst, cached prompt tokens, server RSS before, at the end of
and 5 s after each burst, and for ragcache the tier bytes against their budgets read from
``/metrics``. Servers run one after the other (2 cores: never
both at once), ragcache first; ratios are printed side by side. Both get the same KV memory
(``--vllm-kv-gib``: vLLM's ``VLLM_CPU_KVCACHE_SPACE``, ragcache's device + host tiers), the same
sequences and tokens per step (``--max-batch`` 8: ragcache's default, vLLM's CPU server has 128;
``--max-batch-tokens`` 2,048: vLLM's CPU server default).

    .venv/bin/python benchmarks/serve_load.py --clients 200 --max-tokens 16 --vllm-kv-gib 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmark_report import write_report  # benchmarks/ is on sys.path when a script runs

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VLLM_PY = HERE / ".venv-vllm" / "bin" / "python"
VLLM_MODEL = HERE / "models" / "smollm2-135m-bf16"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its children, MiB (Linux /proc)."""
    total = 0
    pids = [pid]
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        pids += [int(p) for p in out]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    idx = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[idx]


def build_trace(clients: int, k: int, seed: int) -> list[dict]:
    """``clients`` chat requests: messages, the documents in them, the question."""
    from ragcache_backend.bench.workload import build_workload, question_pool
    from ragcache_backend.prompts.builder import DEFAULT_SYSTEM_PROMPT
    from ragcache_integrations import default_store

    store = default_store()
    pool = question_pool(store, k=k, faq=True, mmlu=0, seed=seed)
    wl = build_workload(store, pool, num_requests=clients, seed=seed)
    trace = []
    for r in wl.requests:
        docs = [wl.documents[d] for d in r.doc_ids]
        user = "Answer from these documents.\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {r.question}"
        trace.append({"messages": [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                   {"role": "user", "content": user}],
                      "documents": docs})
    return trace


async def one_request(client: httpx.AsyncClient, url: str, model: str, item: dict, max_tokens: int,
                      with_documents: bool, t0: float) -> dict:
    body = {"model": model, "messages": item["messages"], "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if with_documents:
        body["documents"] = item["documents"]
    first = None
    usage = {}
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                return {"error": f"HTTP {resp.status_code}: {text}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return {"error": json.dumps(chunk["error"])[:300]}
                if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as exc:  # report, never hide
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    done = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": (first or done) - t0, "total_s": done - t0, "completion_tokens": usage.get("completion_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": (details or {}).get("cached_tokens") or 0}


async def run_burst(base: str, model: str, trace: list[dict], max_tokens: int, with_documents: bool) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=len(trace) + 8, max_keepalive_connections=len(trace) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, f"{base}/v1/chat/completions", model, item, max_tokens,
                                                     with_documents, t0) for item in trace))
        return list(results), time.perf_counter() - t0


def wait_health(base: str, proc: subprocess.Popen, timeout: float, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout} s")


def metrics_values(base: str) -> dict[str, float]:
    """``/metrics`` as name{labels} -> value (prometheus text)."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def summarise(name: str, results: list[dict], wall: float, rss: dict) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft_s"] for r in ok]
    total = [r["total_s"] for r in ok]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    return {"server": name, "requests": len(results), "answered": len(ok), "failed": len(errors),
            "errors": sorted(set(errors))[:5], "wall_s": wall,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99), "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "e2e_p50_s": percentile(total, 0.5), "e2e_p99_s": percentile(total, 0.99),
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall if wall else 0.0,
            "requests_per_s": len(ok) / wall if wall else 0.0,
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "cached_tokens": sum(r["cached_tokens"] for r in ok),
            "rss_mib": rss}


def measure(name: str, base: str, model: str, proc: subprocess.Popen, trace: list[dict], args,
            with_documents: bool) -> dict:
    """Warm-up request, then ``args.bursts`` bursts of the whole trace; RSS before, after each burst
    and after 5 s idle (the second burst shows whether memory keeps growing once the cache is full)."""
    asyncio.run(run_burst(base, model, trace[:1], args.max_tokens, with_documents))  # warm-up (one request)
    time.sleep(1.0)
    baseline = rss_mib(proc.pid)
    bursts = []
    for b in range(args.bursts):
        results, wall = asyncio.run(run_burst(base, model, trace, args.max_tokens, with_documents))
        end = rss_mib(proc.pid)
        time.sleep(5.0)
        bursts.append(summarise(name, results, wall, {"end_of_burst": end, "after_idle_5s": rss_mib(proc.pid)}))
    return {"server": name, "rss_baseline_mib": baseline, "bursts": bursts}


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def run_ragcache(args, trace: list[dict], log_dir: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cache_dir = log_dir / "ragcache-kv"
    shutil.rmtree(cache_dir, ignore_errors=True)  # a cold burst is cold: no disk tier left by an earlier run
    cmd = [str(ROOT / ".venv" / "bin" / "ragcache"), "serve", "--port", str(port), "--cache-dir", str(cache_dir),
           "--dtype", args.ragcache_dtype or args.dtype, "--max-queue", str(args.clients * 2), "--max-batch-size", str(args.max_batch),
           "--max-batch-tokens", str(args.max_batch_tokens), "--device-mib", str(args.device_mib),
           "--host-mib", str(max(0, args.vllm_kv_gib * 1024 - args.device_mib))]
    log = open(log_dir / "ragcache-serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_health(base, proc, 600)
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        out = measure("ragcache", base, model, proc, trace, args, True)
        out["metrics"] = {k: v for k, v in metrics_values(base).items()
                          if any(s in k for s in ("bytes", "budget", "queue", "running", "in_flight", "evictions", "hits",
                                                  "disk", "retries", "engine_requests"))}
        out["exit_code"] = stop(proc)
        return out
    except Exception as exc:
        proc.kill()
        return {"server": "ragcache", "error": f"{type(exc).__name__}: {exc}"}


def run_vllm(args, trace: list[dict], log_dir: Path) -> dict:
    if not VLLM_PY.exists() or not VLLM_MODEL.exists():
        return {"server": "vllm", "error": f"peer not installed ({VLLM_PY} / {VLLM_MODEL}); run benchmarks/setup_peers.sh vllm"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    threads = os.cpu_count() or 1
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib), HF_HUB_OFFLINE="1", PYTHONPATH="",
               OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(VLLM_MODEL), "--port", str(port),
           "--dtype", args.dtype, "--enable-prefix-caching", "--max-model-len", "4096", "--served-model-name", "smollm2",
           "--max-num-seqs", str(args.max_batch), "--max-num-batched-tokens", str(args.max_batch_tokens),
           "--block-size", "32", "--enable-prompt-tokens-details"]
    log = open(log_dir / "vllm-serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        wait_health(base, proc, 900)
        out = measure("vllm", base, "smollm2", proc, trace, args, False)
        out["exit_code"] = stop(proc)
        return out
    except Exception as exc:
        proc.kill()
        tail = (log_dir / "vllm-serve.log").read_text(errors="replace")[-800:]
        return {"server": "vllm", "error": f"{type(exc).__name__}: {exc}", "log_tail": tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--k", type=int, default=3, help="documents per request")
    ap.add_argument("--dtype", default="float32", help="both servers' dtype (auto: each its own default; ours: "
                    "bfloat16 where its native bf16 kernels run, vLLM's: the checkpoint's, bfloat16)")
    ap.add_argument("--ragcache-dtype", default=None, help="ours only, instead of --dtype (e.g. float32 against vLLM's auto)")
    ap.add_argument("--max-batch", type=int, default=8, help="sequences per step, both servers (vLLM --max-num-seqs, "
                                                                "ragcache --max-batch-size)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048,
                    help="tokens per step, both servers (vLLM --max-num-batched-tokens, its CPU server default; "
                         "ragcache --max-batch-tokens)")
    ap.add_argument("--vllm-kv-gib", type=int, default=3,
                    help="VLLM_CPU_KVCACHE_SPACE, whole GiB; ragcache gets the same KV memory (device + host tiers)")
    ap.add_argument("--device-mib", type=int, default=512, help="ragcache's device tier; its host tier gets the rest")
    ap.add_argument("--servers", default="ragcache,vllm", help="which servers, in order (comma-separated)")
    ap.add_argument("--bursts", type=int, default=2, help="bursts of the whole trace per server (the first on a cold cache)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    log_dir = Path(os.environ.get("SERVE_LOAD_LOGS", "/tmp/serve_load"))
    log_dir.mkdir(parents=True, exist_ok=True)
    trace = build_trace(args.clients, args.k, args.seed)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runners = {"ragcache": run_ragcache, "vllm": run_vllm}
    runs = [runners[name](args, trace, log_dir) for name in args.servers.split(",")]
    from forward_vs_vllm import machine  # the CPU model and its vector ISA, as every benchmark here reports them

    report = {"date": started, "machine": machine(), "cpus": os.cpu_count(),
              "command": " ".join(sys.argv), "clients": args.clients, "max_tokens": args.max_tokens, "runs": runs}
    ours = runs[0]
    for peer in runs[1:] if ours["server"] == "ragcache" else ():
        if "error" not in peer and "error" not in ours:
            report[f"ratio_vs_{peer['server']}"] = [
                {m: (a[m] / b[m] if b[m] else None)
                 for m in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "output_tokens_per_s")}
                for a, b in zip(ours["bursts"], peer["bursts"])]
    write_report(report, args.json)


if __name__ == "__main__":
    main()
