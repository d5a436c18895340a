"""``ragcache bench``: serving under load, side by side (RAGCache §7, SPEC §5).

``--quick`` (about two minutes, used as the test-suite smoke test): our engine only, on the
Python FAQ corpus with FAQ questions, three systems (ragcache, cache off, device-only LRU), one
trace replayed at two rates; prints a table and the ratios, writes JSON.

Default (the full comparison): the Python docs corpus, FAQ + MMLU questions, the bf16 model
folder written by ``benchmarks/convert_model.py``; our three systems plus the peers (vLLM CPU,
llama.cpp) in their own virtual environments (``benchmarks/setup_peers.sh``), driven by
``benchmarks/peer_runner.py`` over the same token ids and arrival times; the policy ablation
(PGDSF/GDSF/LRU/LFU across host-tier sizes), the reordering ablation near saturation and the
model-free policy replay on a stationary and a drifting trace; JSON, PNG plots and a Markdown
summary (``bench_report``) under ``--out``.

Steady state: each timed run starts from an empty cache, then serves the trace's first
``--warmup`` requests one at a time, untimed (every system, peers included, gets the same
warm-up), then the timed requests open-loop at the given rate.
"""

from __future__ import annotations

import dataclasses

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from ragcache_backend.bench.report import (compact_records, paired_by_hit, plot, render_report,
                                          slo_throughput, summarize)

MiB = 1024 * 1024
REPO = Path(__file__).resolve().parents[2]  # ragcache_backend/bench/bench.py -> the repository
BENCH_DIR = REPO / "benchmarks"
PEER_VENVS = {"vllm": BENCH_DIR / ".venv-vllm", "llamacpp": BENCH_DIR / ".venv-llamacpp"}


@dataclass(slots=True, frozen=True)
class OurSystem:
    """One configuration of our engine."""

    name: str
    enable_cache: bool = True
    policy: str = "pgdsf"
    host: bool = True
    reorder: bool = True


OUR_SYSTEMS = (
    OurSystem("ragcache"),
    OurSystem("no-cache", enable_cache=False, reorder=False),
    OurSystem("lru-device", policy="lru", host=False, reorder=False),
)


# ---- our engine -----------------------------------------------------------------------------------
def run_ours(loaded, profile, prompts, arrivals, system: OurSystem, *, device_bytes: int, host_bytes: int,
             max_tokens: int, threads: int, max_batch_size: int, max_batch_tokens: int, window: int,
             warm_prompts=(), block_size: int = 16) -> dict:
    """Replay ``prompts`` (segment lists) at ``arrivals`` (seconds) open-loop against one system.

    The cache starts empty; ``warm_prompts`` (the trace's warm-up part) are then served one at a
    time, untimed, one token each, so the timed part sees the cache in its steady state."""
    from ragcache_backend.config import EngineConfig
    from ragcache_backend.engine.engine import RAGCacheEngine
    from ragcache_backend.model.sampling import SamplingParams
    from ragcache_backend.engine.scheduler import SchedulerConfig

    cfg = EngineConfig(dtype=_dtype_name(loaded), threads=threads, block_size=block_size,
                       device_budget_bytes=device_bytes, host_budget_bytes=host_bytes if system.host else 0,
                       policy=system.policy, enable_cache=system.enable_cache)
    sched = SchedulerConfig(max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                            reorder=system.reorder, window=window if system.reorder else 0)
    engine = RAGCacheEngine(cfg, loaded=loaded, profile=profile if system.policy == "pgdsf" else None, scheduler=sched)
    sampling = SamplingParams(max_tokens=max_tokens)
    # warm-up (one request, then the cache is emptied)
    engine.generate_segments(prompts[0], SamplingParams(max_tokens=2))
    engine.reset_cache()
    for segs in warm_prompts:
        engine.generate_segments(segs, SamplingParams(max_tokens=1))
    handles = []
    with engine:
        t0 = time.perf_counter()
        for segs, at in zip(prompts, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            handles.append(engine.submit_segments(segs, sampling))
        records = []
        for h, segs in zip(handles, prompts):
            # cacheable segments on the request's path (system prompt + documents): the node-hit denominator
            rec = {"cache_nodes": len(engine.prompt_plan(segs).lead)}
            try:
                r = h.result(timeout=3600)
            except Exception as exc:  # reported, never dropped
                rec["error"] = f"{type(exc).__name__}: {exc}"
            else:
                rec.update(ttft_s=r.ttft_s, total_s=r.total_s, prompt_tokens=r.prompt_tokens,
                           cached_tokens=r.cached_tokens, device_hits=r.device_hits, host_hits=r.host_hits,
                           output_tokens=len(r.token_ids), sched_s=h.metrics.sched_s, kv_copy_s=h.metrics.kv_copy_s,
                           guard_forward_s=h.metrics.guard_forward_s, queue_s=h.metrics.queue_s)
            records.append(rec)
        makespan = max(h.metrics.finished for h in handles) - t0
        stats = dataclasses.asdict(engine.stats)
    engine.cache.check_invariants()
    summary = summarize(records, makespan)
    summary["cache_stats"] = {k: getattr(engine.cache.stats, k) for k in engine.cache.stats.__dataclass_fields__}
    summary["serving_stats"] = stats
    return {"summary": summary, "records": records}


def _dtype_name(loaded) -> str:
    return str(loaded.dtype).removeprefix("torch.")


# ---- peers --------------------------------------------------------------------------------------------
def run_peer(peer: str, model_dir: Path, gguf: Path, prompts_ids, arrivals_by_rate: dict, *, max_tokens: int,
             threads: int, kv_bytes: int, out_dir: Path, max_num_seqs: int = 4, max_batch_tokens: int = 4096,
             warmup_ids=(), timeout_s: int = 5400) -> dict:
    """Run ``benchmarks/peer_runner.py`` in the peer's own venv; returns its JSON or the error."""
    py = PEER_VENVS[peer] / "bin" / "python"
    if not (PEER_VENVS[peer] / ".ok").exists():
        return {"error": f"{peer} is not set up: run `bash benchmarks/setup_peers.sh {peer}` "
                         f"(log: benchmarks/logs/setup-{peer}.log)"}
    out_dir = out_dir.resolve()
    job = out_dir / f"peer-{peer}-in.json"
    result = out_dir / f"peer-{peer}-out.json"
    job.write_text(json.dumps({
        "peer": peer, "model_dir": str(model_dir), "gguf": str(gguf), "prompts": prompts_ids,
        "warmup": list(warmup_ids),
        "arrivals": {str(k): v for k, v in arrivals_by_rate.items()}, "max_tokens": max_tokens,
        "threads": threads, "kv_bytes": kv_bytes, "max_num_seqs": max_num_seqs, "max_batch_tokens": max_batch_tokens,
    }))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS=str(threads), PYTHONPATH="")
    log = out_dir / f"peer-{peer}.log"
    with log.open("w") as fh:
        try:
            proc = subprocess.run([str(py), str(BENCH_DIR / "peer_runner.py"), str(job), str(result)],
                                  stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, cwd=str(out_dir))
        except subprocess.TimeoutExpired:
            return {"error": f"{peer} timed out after {timeout_s} s (log: {log})"}
    if proc.returncode != 0 or not result.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        return {"error": f"{peer} exited {proc.returncode}: " + " | ".join(tail)}
    data = json.loads(result.read_text())
    for rate, recs in data.get("runs", {}).items():
        data.setdefault("summaries", {})[rate] = summarize(recs["records"], recs["makespan_s"])
    return data


# ---- the benchmark ------------------------------------------------------------------------------------
def _machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_at_start": [round(x, 2) for x in load],
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def bench(
    quick: bool = typer.Option(False, "--quick", help="our engine only, small FAQ trace, about two minutes"),
    out: Path = typer.Option(Path("bench-results"), "--out", help="folder for JSON, plots and summary"),
    rates: str = typer.Option("", "--rates", help="comma-separated request rates (req/s); default per mode"),
    num_requests: int = typer.Option(0, "--requests", help="timed requests per trace; default per mode"),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="untimed requests of the same trace served one at "
                                         "a time before each timed run (steady state); default: quick 0, full 64"),
    max_tokens: int = typer.Option(0, "--max-tokens", help="tokens generated per request; default per mode"),
    k: Optional[int] = typer.Option(None, "--k", help="documents retrieved per request; default: quick 2, full 3"),
    zipf: float = typer.Option(1.0, "--zipf", help="Zipf exponent of document popularity"),
    seed: int = typer.Option(0, "--seed", help="seed of the trace"),
    threads: int = typer.Option(2, "--threads", help="CPU threads for every system"),
    model: str = typer.Option("", "--model", help="model for our engine (default: quick = packaged GGUF in fp32; "
                              "full = benchmarks/models/smollm2-135m-bf16 in bf16)"),
    device_mib: int = typer.Option(0, "--device-mib", help="our device tier (peers' KV in the paper's setting)"),
    host_mib: int = typer.Option(0, "--host-mib", help="our host tier"),
    peers: str = typer.Option("vllm,llamacpp", "--peers", help="peers to run in the full mode ('' for none)"),
    ablations: bool = typer.Option(True, "--ablations/--no-ablations", help="policy and reordering ablations (full mode)"),
    max_batch_size: int = typer.Option(4, "--max-batch-size"),
    max_batch_tokens: int = typer.Option(4096, "--max-batch-tokens"),
    window: int = typer.Option(32, "--window", help="reordering starvation window (requests)"),
    corpus: str = typer.Option("docs", "--corpus", help="full mode corpus: 'docs' (all Python docs) or 'faq'"),
    mmlu: int = typer.Option(300, "--mmlu", help="MMLU questions in the full mode's pool"),
    host_sizes: str = typer.Option("0,256,768", "--ablation-host-mib", help="host-tier sizes of the policy ablation"),
    policy_sim: Optional[int] = typer.Option(None, "--policy-sim", help="requests of the model-free policy replay on a "
                                             "stationary and a drifting trace (0: skip); default: quick 0, full 1000"),
    drift_every: int = typer.Option(100, "--drift-every", help="drifting trace: popularity re-drawn every N requests"),
    sim_host_sizes: str = typer.Option("0,64,128,256,512,1024", "--sim-host-mib",
                                       help="host-tier sizes of the policy replay"),
    ours: str = typer.Option("ragcache,no-cache,lru-device", "--ours", help="our systems to run ('' for none)"),
    resume: bool = typer.Option(False, "--resume", help="keep the systems and ablations already in OUT/results.json"),
) -> None:
    """Benchmark serving under load: TTFT vs rate, throughput at an SLO, hit rates, ablations."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from ragcache_backend.demo.datasets import python_docs_dir
    from ragcache_backend.retrieval.docstore import build_index
    from ragcache_backend.model.loader import load_model
    from ragcache_backend.bench.workload import build_workload, question_pool

    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    machine = _machine()
    docs = python_docs_dir()
    if quick:
        rate_list = [float(x) for x in rates.split(",")] if rates else [0.5, 2.0]
        k = 2 if k is None else k
        n = num_requests or 24
        max_tokens = max_tokens or 4
        store = build_index(docs / "faq", out / "index-faq", progress=False)
        pool = question_pool(store, k=k, faq=True, mmlu=0, seed=seed)
        model_path, dtype = (model or None), "float32"
        device_mib, host_mib = device_mib or 64, host_mib or 256
        warmup = 0 if warmup is None else warmup
        policy_sim = policy_sim or 0
        peer_list: list[str] = []
        ablations = False
    else:
        # defaults = the run reported in docs/benchmarks.md
        rate_list = [float(x) for x in rates.split(",")] if rates else [0.5, 1.0, 2.0, 3.0, 4.0]
        k = 3 if k is None else k
        n = num_requests or 48
        max_tokens = max_tokens or 4
        if corpus == "faq":
            store = build_index(docs / "faq", out / "index-faq", progress=False)
        else:
            store = build_index(docs, progress=False)
        pool = question_pool(store, k=k, faq=True, mmlu=mmlu, seed=seed, docs_dir=docs)
        model_path, dtype = (model or str(BENCH_DIR / "models" / "smollm2-135m-bf16")), "bfloat16"
        device_mib, host_mib = device_mib or 192, host_mib or 768
        warmup = 64 if warmup is None else warmup
        policy_sim = 1000 if policy_sim is None else policy_sim
        peer_list = [p for p in peers.split(",") if p]
    if warmup < 0:
        raise typer.BadParameter("--warmup must be >= 0")
    wl = build_workload(store, pool, num_requests=warmup + n, zipf_s=zipf, seed=seed, warmup=warmup)
    typer.echo(f"trace: {warmup} warm-up + {n} timed requests, {len(wl.documents)} distinct documents of "
               f"{wl.corpus_size}; share of timed requests hitting the top 3% of documents: "
               f"{wl.skew['share_requests_hitting_top_corpus']:.0%} (corpus), "
               f"{wl.skew['share_requests_hitting_top_used']:.0%} (of documents used)")
    typer.echo(f"[{time.perf_counter() - started:6.1f}s] loading the model ...")
    loaded = load_model(model_path, dtype=dtype)
    profile = _profile(loaded, threads, device_mib)
    typer.echo(f"[{time.perf_counter() - started:6.1f}s] model and prefill profile ready")
    from ragcache_backend.prompts.builder import PromptBuilder
    from ragcache_backend.config import EngineConfig

    builder = PromptBuilder(loaded.tokenizer, EngineConfig().system_prompt)
    all_prompts = _trace_prompts(builder, wl)
    warm_prompts, prompts = all_prompts[:warmup], all_prompts[warmup:]
    timed = wl.timed_requests()
    prompt_ids, warm_ids = _token_ids(prompts), _token_ids(warm_prompts)
    device_bytes, host_bytes = device_mib * MiB, host_mib * MiB
    common = dict(device_bytes=device_bytes, host_bytes=host_bytes, max_tokens=max_tokens, threads=threads,
                  max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens, window=window,
                  warm_prompts=warm_prompts)
    results: dict = {"corpus": "python-docs/faq" if quick or corpus == "faq" else "python-docs", "machine": machine, "mode": "quick" if quick else "full", "model": loaded.name,
                     "model_path": model_path or "packaged GGUF", "dtype": dtype, "threads": threads,
                     "device_mib": device_mib, "host_mib": host_mib, "max_tokens": max_tokens,
                     "rates": rate_list, "workload": wl.to_json(), "systems": {}, "records": {},
                     "prompt_tokens_mean": statistics.fmean(len(p) for p in prompt_ids),
                     "scheduler": {"max_batch_size": max_batch_size, "max_batch_tokens": max_batch_tokens,
                                   "window": window}}
    if resume and (out / "results.json").exists():
        old = json.loads((out / "results.json").read_text())
        for key in ("systems", "records", "policy_ablation", "reorder_ablation", "peer_info", "policy_sim"):
            if key in old:
                results[key] = old[key]
        results["machine"]["previous_runs"] = old.get("machine")
    wanted = {x for x in ours.split(",") if x}
    # rates outer, systems inner: slow drifts of this shared machine's speed hit every system alike
    for rate in rate_list:
        for system in [s for s in OUR_SYSTEMS if s.name in wanted]:
            arrivals = [wl.timed_arrival_s(r, rate) for r in timed]
            typer.echo(f"[{time.perf_counter() - started:6.1f}s] {system.name} @ {rate} req/s ...")
            run = run_ours(loaded, profile, prompts, arrivals, system, **common)
            results["systems"].setdefault(system.name, {})[str(rate)] = run["summary"]
            results["records"].setdefault(system.name, {})[str(rate)] = compact_records(run["records"])
            _save(out, results)
    kv_settings = {"paper": device_bytes, "equal-total": device_bytes + host_bytes}
    for peer in peer_list:
        for setting, kv in kv_settings.items():
            typer.echo(f"  {peer} (KV {kv // MiB} MiB, {setting}) ...")
            arrivals = {rate: [wl.timed_arrival_s(r, rate) for r in timed] for rate in rate_list}
            data = run_peer(peer, Path(model_path), BENCH_DIR / "models" / "smollm2-135m-bf16.gguf", prompt_ids,
                            arrivals, max_tokens=max_tokens, threads=threads, kv_bytes=kv, out_dir=out,
                            max_num_seqs=max_batch_size, max_batch_tokens=max_batch_tokens, warmup_ids=warm_ids)
            name = f"{peer} ({setting} KV {kv // MiB} MiB)"
            if "error" in data:
                results["systems"][name] = {"error": data["error"]}
                typer.echo(f"    error: {data['error'][:300]}")
            else:
                results["systems"][name] = data["summaries"]
                for rate_key, recs in data.get("runs", {}).items():
                    results["records"].setdefault(name, {})[rate_key] = compact_records(recs["records"])
                results.setdefault("peer_info", {})[name] = data.get("info", {})
            _save(out, results)
    if ablations:
        hosts = [int(x) for x in host_sizes.split(",") if x]
        results["policy_ablation"] = _policy_ablation(loaded, profile, prompts, wl, rate_list, common, out, results, hosts)
        results["reorder_ablation"] = _reorder_ablation(loaded, profile, prompts, wl, rate_list, common, out, results)
    if policy_sim:
        typer.echo(f"[{time.perf_counter() - started:6.1f}s] policy replay, {policy_sim} requests ...")
        results["policy_sim"] = policy_simulation(
            store, pool, builder, loaded, profile, num_requests=policy_sim, zipf_s=zipf, seed=seed,
            drift_every=drift_every, device_bytes=device_bytes,
            host_sizes_bytes=[int(x) * MiB for x in sim_host_sizes.split(",") if x])
        _save(out, results)
    results["paired"] = paired_by_hit(results)
    results["slo"] = slo_throughput(results)
    results["elapsed_s"] = time.perf_counter() - started
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    _save(out, results)
    report = render_report(results)
    (out / "summary.md").write_text(report)
    typer.echo(report)
    if not quick:
        try:
            plot(results, out)
        except Exception as exc:  # plotting is optional
            typer.echo(f"plots skipped: {exc!r}")


def _trace_prompts(builder, wl) -> list:
    """Every request of the trace as prompt segments (system, its documents in rank order, question)."""
    return [builder.build(r.question, [(wl.documents[d], d) for d in r.doc_ids]) for r in wl.requests]


def _token_ids(prompts) -> list[list[int]]:
    """The token ids of each prompt, concatenated (what the peers receive)."""
    return [[t for seg in segs for t in seg.token_ids] for segs in prompts]


def _profile(loaded, threads: int, device_mib: int):
    """PGDSF needs a prefill profile: measured once per model/dtype/threads, cached on disk."""
    from ragcache_backend.config import EngineConfig
    from ragcache_backend.engine.engine import RAGCacheEngine

    eng = RAGCacheEngine(EngineConfig(dtype=_dtype_name(loaded), threads=threads, device_budget_bytes=device_mib * MiB,
                                      host_budget_bytes=0), loaded=loaded)
    return eng.profile


def _policy_ablation(loaded, profile, prompts, wl, rate_list, common, out, results, hosts) -> dict:
    """Hit rate and mean TTFT of PGDSF/GDSF/LRU/LFU across host-tier sizes (RAGCache Table 2)."""
    rate = rate_list[1] if len(rate_list) > 1 else rate_list[0]
    arrivals = [wl.timed_arrival_s(r, rate) for r in wl.timed_requests()]
    table: dict = {"rate": rate, "runs": {}}
    dev = common["device_bytes"]
    for host_mib in hosts:
        for policy in ("pgdsf", "gdsf", "lru", "lfu"):
            typer.echo(f"  ablation policy={policy} host={host_mib} MiB ...")
            c = dict(common, host_bytes=host_mib * MiB, device_bytes=dev)
            run = run_ours(loaded, profile, prompts, arrivals, OurSystem(policy, policy=policy, host=host_mib > 0), **c)
            s = run["summary"]
            table["runs"].setdefault(str(host_mib), {})[policy] = {
                k: s.get(k) for k in ("token_hit_rate", "device_hit_rate", "host_hit_rate", "ttft_mean_s")}
            results["policy_ablation"] = table
            _save(out, results)
    return table


def _reorder_ablation(loaded, profile, prompts, wl, rate_list, common, out, results) -> dict:
    """ragcache with and without cache-aware reordering at the highest rate (near saturation)."""
    rate = rate_list[-1]
    arrivals = [wl.timed_arrival_s(r, rate) for r in wl.timed_requests()]
    table: dict = {"rate": rate}
    for reorder in (True, False):
        run = run_ours(loaded, profile, prompts, arrivals, OurSystem("ragcache", reorder=reorder), **common)
        table["reorder" if reorder else "fifo"] = run["summary"]
        results["reorder_ablation"] = table
        _save(out, results)
    return table


def policy_simulation(store, pool, builder, loaded, profile, *, num_requests: int, zipf_s: float, seed: int,
                      drift_every: int, device_bytes: int, host_sizes_bytes: list[int]) -> dict:
    """Token and node hit rates of PGDSF/GDSF/LRU/LFU (RAGCache Table 2's shape) on two long traces
    from the same question pool: stationary popularity, and popularity re-drawn every
    ``drift_every`` requests. Model-free replay through the real cache (``bench_policy``)."""
    from ragcache_backend.bench.policy_replay import policy_table
    from ragcache_backend.model.runner import kv_bytes_per_token
    from ragcache_backend.bench.workload import build_workload

    out: dict = {"requests": num_requests, "device_mib": device_bytes / MiB, "drift_every": drift_every,
                 "bytes_per_token": kv_bytes_per_token(loaded), "traces": {}}
    for name, drift in (("stationary", 0), ("drifting", drift_every)):
        wl = build_workload(store, pool, num_requests=num_requests, zipf_s=zipf_s, seed=seed, drift_every=drift)
        prompts = _trace_prompts(builder, wl)
        table = policy_table(prompts, profile=profile, device_bytes=device_bytes, host_sizes_bytes=host_sizes_bytes,
                             bytes_per_token=out["bytes_per_token"])
        out["traces"][name] = {"distinct_documents": len(wl.documents), "skew": wl.skew,
                               "hosts_mib": {str(h // MiB): row for h, row in table.items()}}
    return out


def _save(out: Path, results: dict) -> None:
    path = out / "results.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


if __name__ == "__main__":
    typer.run(bench)
