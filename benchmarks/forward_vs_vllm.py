"""Forward-pass speed of ragcache vs vLLM CPU, in one process order on one machine, plus our miss overhead.

    .venv/bin/python benchmarks/forward_vs_vllm.py [--repeats N] [--json OUT]

Both systems run the same bf16 weights (``benchmarks/models/smollm2-135m-bf16``, written by
``benchmarks/convert_model.py`` from the packaged SmolLM2-135M-Instruct GGUF) on the same seeded
random token ids, with 2 threads each (``--threads``). vLLM (``bash benchmarks/setup_peers.sh vllm``)
runs in its own venv as ONE long-lived subprocess (``benchmarks/vllm_forward_worker.py``: offline
``vllm.LLM``, bf16, prefix caching on, block size 32), commanded round by round, so the two systems
take turns: every round runs each measurement on both, alternating which goes first, with fresh
token ids shared by both. One untimed warm-up round first. Reported: median and min over rounds.

* cold prefill: 1,000 new tokens, no cache. Ours: one ``ModelRunner.forward`` + argmax. vLLM: the
  wall time of ``LLM.generate`` of a fresh prompt with ``max_tokens=1`` (its TTFT).
* 30 over 1,024 cached: the 1,024-token prefix (32 full vLLM blocks, vLLM caches full blocks only)
  computed untimed, then 30 new tokens timed. vLLM: the prefix served once, then prefix + 30 with
  ``max_tokens=1`` (its ``num_cached_tokens`` is recorded: 1,024 means the hit was real).
* decode step, batch 1 and 4, each sequence with a 1,024-token context. Ours: ``--decode-steps``
  greedy steps of a batched ``forward`` (one token per sequence), total / steps. vLLM: the prompts
  served once (cached), then ``(t(max_tokens=N+1) - t(max_tokens=1)) / N`` with ``ignore_eos``.
* miss overhead (ours only): ``engine.generate`` of a question over two fresh random documents
  (about 1,000 prompt tokens, 0% document hits), ``max_tokens=1``, cache on vs ``use_cache=False``,
  interleaved in alternating order, after the cache is filled so that every cache-on miss also
  evicts (``--miss-device-mib`` / ``--miss-host-mib``). Overhead = mean TTFT on / mean TTFT off - 1.
  Cache-on still hits the system prompt, as every real miss does.

Our figures time the forward pass alone; vLLM's time a request through its offline API (scheduler,
engine-core process, output processing included). vLLM's own engine-core timestamps (prefill =
first token - scheduled, decode = (last - first token) / N) are printed as "vLLM core" for reference.
Targets: every ratio ours/vLLM <= 1.0; miss overhead <= 3%. A peer that fails is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from ragcache_backend import EngineConfig, RAGCacheEngine, SamplingParams
from ragcache_backend.model.runner import ForwardInput, KVRun

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "models" / "smollm2-135m-bf16"
VLLM_VENV = HERE / ".venv-vllm"
MiB = 1024 * 1024
COLD, CACHED, NEW = 1000, 1024, 30
MEASUREMENTS = {"cold": "cold prefill, 1000 tokens", "extend": f"prefill {NEW} over {CACHED} cached",
                "decode1": f"decode step, batch 1 (ctx {CACHED})", "decode4": f"decode step, batch 4 (ctx {CACHED})"}


class Ours:
    """Kernel-level timings on ``engine.runner``, with blocks borrowed from the engine's allocator."""

    def __init__(self, engine: RAGCacheEngine) -> None:
        self.engine, self.runner = engine, engine.runner

    def _alloc(self, tokens: int) -> tuple[int, ...]:
        return tuple(self.engine.cache.allocate(-(-tokens // self.runner.block_size)))

    def _argmax(self, batch: list[ForwardInput]) -> list[int]:
        return [int(torch.argmax(x)) for x in self.runner.forward(batch)]

    def cold(self, ids: list[int]) -> float:
        b = self._alloc(len(ids))
        try:
            t = time.perf_counter()
            self._argmax([ForwardInput(tuple(ids), (), (KVRun(b, 0, len(ids)),))])
            return time.perf_counter() - t
        finally:
            self.engine.cache.free(b)

    def extend(self, prefix: list[int], new: list[int]) -> float:
        n = len(prefix)
        b = self._alloc(n + len(new))
        try:
            self._argmax([ForwardInput(tuple(prefix), (), (KVRun(b, 0, n),))])
            t = time.perf_counter()
            self._argmax([ForwardInput(tuple(new), (KVRun(b, 0, n),), (KVRun(b, n, len(new)),))])
            return time.perf_counter() - t
        finally:
            self.engine.cache.free(b)

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        blocks = [self._alloc(len(p) + steps) for p in prompts]
        try:
            toks = [self._argmax([ForwardInput(tuple(p), (), (KVRun(b, 0, len(p)),))])[0] for p, b in zip(prompts, blocks)]
            t = time.perf_counter()
            for s in range(steps):
                toks = self._argmax([ForwardInput((tok,), (KVRun(b, 0, len(p) + s),), (KVRun(b, len(p) + s, 1),))
                                     for tok, p, b in zip(toks, prompts, blocks)])
            return (time.perf_counter() - t) / steps
        finally:
            for b in blocks:
                self.engine.cache.free(b)


class PeerError(RuntimeError):
    pass


class VLLMPeer:
    """``vllm_forward_worker.py`` in vLLM's venv: JSON commands on stdin, one JSON answer line each."""

    def __init__(self, threads: int, kv_bytes: int, out_dir: Path) -> None:
        if not (VLLM_VENV / ".ok").exists():
            raise PeerError("vLLM is not set up: run `bash benchmarks/setup_peers.sh vllm` (log: benchmarks/logs/setup-vllm.log)")
        job = out_dir / "forward-vllm-job.json"
        job.write_text(json.dumps({"model_dir": str(MODEL_DIR), "kv_bytes": kv_bytes, "block_size": 32, "max_num_seqs": 4}))
        self.log = out_dir / "forward-vllm.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", OMP_NUM_THREADS=str(threads),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_LOGGING_STREAM="ext://sys.stderr")
        with self.log.open("w") as fh:
            self.proc = subprocess.Popen([str(VLLM_VENV / "bin" / "python"), str(HERE / "vllm_forward_worker.py"), str(job)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fh, env=env, text=True)
        self.info = self._read(timeout=1200)["info"]

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 1.0)[0]:
                line = self.proc.stdout.readline()
                if line:
                    return json.loads(line)
            if self.proc.poll() is not None:
                break
        self.close()
        tail = self.log.read_text(errors="replace").strip().splitlines()[-8:]
        raise PeerError(f"vLLM exited ({self.proc.returncode}) or timed out; log {self.log}: " + " | ".join(tail))

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        res = self._read(timeout=900)
        if "error" in res:
            raise PeerError(f"vLLM {cmd['op']}: {res['error']}")
        return res

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def miss_overhead(engine: RAGCacheEngine, args, rng: random.Random) -> dict:
    """Mean TTFT of 0%-hit requests with the cache on vs off (steady state: the cache is full)."""
    eng = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype="bfloat16", threads=args.threads,
                                      device_budget_bytes=args.miss_device_mib * MiB,
                                      host_budget_bytes=args.miss_host_mib * MiB),
                         loaded=engine.loaded, profile=engine.profile)
    vocab, sp = engine.loaded.model.config.vocab_size, SamplingParams(max_tokens=1)
    tok = engine.loaded.tokenizer

    def ask(use_cache: bool):
        docs = [tok.decode([rng.randrange(1000, vocab) for _ in range(args.doc_tokens)]) for _ in range(2)]
        return eng.generate("What do these documents say?", docs, sp, use_cache=use_cache)

    first = ask(True)
    fill = -(-(args.miss_device_mib + args.miss_host_mib) * MiB // (first.prompt_tokens * eng.runner.kv_bytes_per_token))
    for _ in range(fill + 1):  # untimed: from here on every cache-on miss evicts
        ask(True)
    recs: dict[str, list] = {"on": [], "off": []}
    for i in range(args.miss_pairs):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            r = ask(mode == "on")
            recs[mode].append({"ttft_s": r.ttft_s, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                               "computed_tokens": r.computed_tokens})
    on, off = (statistics.mean(x["ttft_s"] for x in recs[m]) for m in ("on", "off"))
    return {"records": recs, "mean_on_s": on, "mean_off_s": off, "overhead": on / off - 1.0, "fill_requests": fill + 1,
            "mean_prompt_tokens": statistics.mean(x["prompt_tokens"] for x in recs["on"] + recs["off"]),
            "mean_cached_tokens_on": statistics.mean(x["cached_tokens"] for x in recs["on"])}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its descendants (Linux /proc)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
            todo += [int(c) for t in Path(f"/proc/{p}/task").iterdir() for c in (t / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"cpu": cpu, "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def summary(xs: list[float]) -> dict:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "n": len(xs)} if xs else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (each: every measurement on both systems)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--miss-pairs", type=int, default=10, help="cache-on/off request pairs of the miss overhead")
    ap.add_argument("--miss-device-mib", type=int, default=64)
    ap.add_argument("--miss-host-mib", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=480, help="random token ids decoded into each document's text")
    ap.add_argument("--no-vllm", action="store_true", help="ours only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write every raw number here")
    args = ap.parse_args()
    out_dir = (args.json.parent if args.json else HERE / "logs").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(), "ours": {}, "vllm": {}}
    if not (MODEL_DIR / "config.json").exists():
        sys.path.insert(0, str(HERE))
        from convert_model import convert_hf
        print("writing the bf16 model folder ...", flush=True)
        convert_hf(HERE / "models")
    print("ours: loading the engine (first run on this model also measures its prefill profile) ...", flush=True)
    engine = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype="bfloat16", threads=args.threads,
                                         device_budget_bytes=256 * MiB, host_budget_bytes=0))
    ours = Ours(engine)
    peer, vllm_error = None, None
    if not args.no_vllm:
        print("vLLM: starting the worker (a minute or two) ...", flush=True)
        try:
            peer = VLLMPeer(args.threads, 512 * MiB, out_dir)
            res["vllm_info"] = peer.info
        except PeerError as exc:
            vllm_error = str(exc)
            print(f"vLLM failed: {vllm_error}", flush=True)
    rng = random.Random(args.seed)
    vocab = engine.loaded.model.config.vocab_size
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    vllm_core: dict[str, list] = {k: [] for k in MEASUREMENTS}
    idle_cpu = [0.0, 0.0]  # vLLM's CPU seconds while ours was timed, our timed seconds
    for rnd in range(-1, args.repeats):  # round -1 is the warm-up
        for key in MEASUREMENTS:
            if key == "cold":
                cmd = {"op": "cold", "ids": ids(COLD)}
                run = lambda c=cmd: ours.cold(c["ids"])  # noqa: E731
            elif key == "extend":
                cmd = {"op": "extend", "prefix": ids(CACHED), "new": ids(NEW)}
                run = lambda c=cmd: ours.extend(c["prefix"], c["new"])  # noqa: E731
            else:
                cmd = {"op": "decode", "prompts": [ids(CACHED) for _ in range(int(key[-1]))], "steps": args.decode_steps}
                run = lambda c=cmd: ours.decode(c["prompts"], c["steps"])  # noqa: E731
            for side in (("ours", "vllm") if rnd % 2 else ("vllm", "ours")):
                if side == "ours":
                    c0 = tree_cpu_s(peer.proc.pid) if peer else 0.0
                    t = run()
                    if peer:
                        idle_cpu[0] += tree_cpu_s(peer.proc.pid) - c0
                        idle_cpu[1] += t
                    if rnd >= 0:
                        res["ours"].setdefault(key, []).append(t)
                elif peer:
                    try:
                        r = peer.ask(cmd)
                    except PeerError as exc:
                        vllm_error, peer = str(exc), None
                        print(f"vLLM failed: {vllm_error}", flush=True)
                        continue
                    if rnd >= 0:
                        res["vllm"].setdefault(key, []).append(r["wall_s"])
                        res.setdefault("vllm_raw", {}).setdefault(key, []).append(r)
                        vllm_core[key].append(r.get("core_step_s" if key.startswith("decode") else "core_prefill_s"))
        print(f"round {rnd + 1}/{args.repeats} done" if rnd >= 0 else "warm-up round done", flush=True)
    if peer:
        res["vllm_cpu_s_while_ours_timed"], res["ours_timed_s"] = idle_cpu
        peer.close()
    res["vllm_error"] = vllm_error
    print("ours: miss overhead ...", flush=True)
    res["miss"] = miss_overhead(engine, args, rng)
    res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res["summary"] = {k: {"ours": summary(res["ours"].get(k, [])), "vllm": summary(res["vllm"].get(k, [])),
                          "vllm_core": summary([x for x in vllm_core[k] if x is not None])} for k in MEASUREMENTS}
    report(res, args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
        print(f"raw numbers: {args.json}")


def report(res: dict, args) -> None:
    m, vi = res["machine"], res.get("vllm_info", {})
    print(f"\nmachine: {m['cpu']}, nproc {m['nproc']}; {m['date']}; load average {m['loadavg_start']} -> {m['loadavg_end']}")
    print(f"torch {m['torch']} (ours); vLLM {vi.get('vllm', '-')} with torch {vi.get('torch', '-')}; threads {args.threads} each; "
          f"bf16 {MODEL_DIR.name}; {args.repeats} rounds, median (min) in ms")
    if "vllm_cpu_s_while_ours_timed" in res and res["ours_timed_s"]:
        print(f"vLLM processes used {100 * res['vllm_cpu_s_while_ours_timed'] / res['ours_timed_s']:.0f}% of a core while ours was timed")
    fmt = "{:<34} {:>17} {:>17} {:>8} {:>7} {:>7} {:>15}"
    print(fmt.format("measurement", "ours ms", "vLLM ms", "ratio", "target", "result", "vLLM core ms"))
    ms = lambda s: f"{1e3 * s['median_s']:.1f} ({1e3 * s['min_s']:.1f})" if s else "-"  # noqa: E731
    for key, label in MEASUREMENTS.items():
        s = res["summary"][key]
        ratio = s["ours"]["median_s"] / s["vllm"]["median_s"] if s["ours"] and s["vllm"] else None
        res["summary"][key]["ratio"] = ratio
        print(fmt.format(label, ms(s["ours"]), ms(s["vllm"]), f"{ratio:.2f}" if ratio else "-", "<= 1.0",
                         ("met" if ratio <= 1.0 else "MISSED") if ratio else "-", ms(s["vllm_core"])))
    mo = res["miss"]
    print(fmt.format("miss overhead, on vs off (0% hits)", f"{1e3 * mo['mean_on_s']:.1f} on", f"{1e3 * mo['mean_off_s']:.1f} off",
                     f"{100 * mo['overhead']:+.1f}%", "<= 3%", "met" if mo["overhead"] <= 0.03 else "MISSED", "-"))
    print(f"  (miss: {args.miss_pairs} pairs, mean prompt {mo['mean_prompt_tokens']:.0f} tokens, cache-on reuses "
          f"{mo['mean_cached_tokens_on']:.0f} system-prompt tokens, {mo['fill_requests']} fill requests first)")
    cached = [r.get("cached_tokens") for r in res.get("vllm_raw", {}).get("extend", [])]
    if cached:
        print(f"  (vLLM prefix hits on the {NEW}-over-{CACHED} request: {cached})")
    if res["vllm_error"]:
        print(f"vLLM error: {res['vllm_error']}")


if __name__ == "__main__":
    main()
