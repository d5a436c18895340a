"""Forward-pass speed of ragcache vs vLLM CPU, in one process order on one machine, plus our miss overhead.

    .venv/bin/python benchmarks/forward_vs_vllm.py [--repeats N] [--json OUT]

Same bf16 weights (``benchmarks/models/smollm2-135m-bf16`` from ``convert_model.py``), same seeded
random token ids, ``--threads`` (2) each. vLLM (``bash benchmarks/setup_peers.sh vllm``) is one
long-lived subprocess in its own venv (``vllm_forward_worker.py``: offline ``vllm.LLM``, prefix
caching on, block size 32). Each round runs every measurement on both, alternating who goes first,
on fresh ids shared by both; each side starts only once vLLM's processes are idle again, after at
least a second's idle: on a VM the first call after an idle second pays extra (2026-11-28, this
2-core Xeon KVM guest: a 1.75 ms GEMM took 14-27 ms, ours and oneDNN's alike, the memory cold), so
both start from the same state (before 2026-11-28 only ours did, and paid it alone). One untimed
warm-up round; median (min) over rounds. Ours: ``ModelRunner.forward`` + argmax, timed alone. vLLM:
wall time of ``LLM.generate`` (plus its engine-core timestamps, "vLLM core").

* cold prefill, 1,000 tokens: vLLM's TTFT of a fresh prompt (``max_tokens=1``), each side's
  timed pass right after an untimed one over other fresh ids, as the measurements below run an
  untimed prefix or prompt pass first (without it, the timed pass was the first after the idle
  second above: ours 443 ms and vLLM's 403 ms, against 253-265 and 291-303 ms warm).
* 30 new tokens over 1,024 cached (32 full blocks; vLLM caches full blocks only): the prefix is
  computed untimed first; vLLM's ``num_cached_tokens`` is checked to be 1,024.
* decode step, batch 1, 4, 8 and 16, 1,024 tokens of context each: ours ``--decode-steps`` N batched greedy
  steps / N; vLLM ``(t(max_tokens=N+1) - t(max_tokens=1)) / N`` (``ignore_eos``) on cached prompts.
* miss overhead (ours only): ``engine.generate`` over two fresh random documents (~1,000 prompt
  tokens, 0% document hits), ``max_tokens=1``, cache on vs ``use_cache=False`` in alternating pairs,
  once the cache is full (so every cache-on miss also evicts): mean TTFT on / off - 1. Cache-on
  still reuses the system prompt, as every real miss does.

* memory bandwidth (the same run): the best of 5 reads of a 1 GiB float32 tensor by ``torch.sum`` on
  ``--threads`` threads; the **weights-read floor** of a decode step is the model's unique weight
  bytes (tied embeddings once) divided by it: no batch-1 decode step can be faster. It is measured
  at the start and again (best of 3) right after our batch-1 decode step in every round, and the
  target is judged on the median of each round's step over its own round's floor: this VM's memory
  speed moves by 1.5-2x within a run (2026-11-29: vLLM's batch-1 step took 76-109 ms in one run,
  52-55 ms in another the same day), so a floor from the start alone can be off by that much.

Targets (issue 23): every ratio ours/vLLM <= 0.9; decode at batch 1 within 1.5x the floor; miss
overhead <= 3%. A failing peer is reported with its error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
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
DECODE_BATCHES = (1, 4, 8, 16)
MEASUREMENTS = {"cold": "cold prefill, 1000 tokens", "extend": f"prefill {NEW} over {CACHED} cached",
                **{f"decode{b}": f"decode step, batch {b} (ctx {CACHED})" for b in DECODE_BATCHES}}
TARGET = 0.9  # issue 23: every ratio ours / vLLM at most this
FLOOR_TARGET = 1.5  # decode at batch 1 within this multiple of the weights-read floor


class Ours:
    """Kernel-level timings on ``engine.runner``, in blocks borrowed from the engine's allocator (no request runs)."""

    def __init__(self, engine: RAGCacheEngine) -> None:
        self.engine, self.runner, self.first_token = engine, engine.runner, None

    @contextlib.contextmanager
    def blocks(self, *tokens: int):
        """Arena blocks for sequences of ``tokens`` tokens each (one tuple of block ids per sequence),
        taken from the engine's allocator for the block and freed after it (no request may run)."""
        got = [tuple(self.engine.cache.allocate(-(-n // self.runner.block_size))) for n in tokens]
        try:
            yield got
        finally:
            for b in got:
                self.engine.cache.free(b)

    def _step(self, batch: list[tuple], *, decode: bool = False) -> list[int]:
        """One forward of ``(new_tokens, cached_runs, target_runs)`` items; greedy next token of each.
        ``decode``: the new tokens are generated ones (the engine's decode kernel), not prompt tokens."""
        items = [ForwardInput(tuple(n), c, t, decode=decode) for n, c, t in batch]
        return [int(torch.argmax(x)) for x in self.runner.forward(items)]

    def cold(self, cmd: dict) -> float:
        ids = cmd["ids"]
        if cmd.get("warm_ids"):  # untimed, as the other measurements' first passes
            with self.blocks(len(cmd["warm_ids"])) as (b,):
                self._step([(cmd["warm_ids"], (), (KVRun(b, 0, len(cmd["warm_ids"])),))])
        with self.blocks(len(ids)) as (b,):
            t = time.perf_counter()
            self.first_token = self._step([(ids, (), (KVRun(b, 0, len(ids)),))])[0]
            return time.perf_counter() - t

    def extend(self, cmd: dict) -> float:
        prefix, new, n = cmd["prefix"], cmd["new"], len(cmd["prefix"])
        with self.blocks(n + len(new)) as (b,):
            self._step([(prefix, (), (KVRun(b, 0, n),))])
            t = time.perf_counter()
            self._step([(new, (KVRun(b, 0, n),), (KVRun(b, n, len(new)),))])
            return time.perf_counter() - t

    def decode(self, cmd: dict) -> float:
        prompts, steps = cmd["prompts"], cmd["steps"]
        with self.blocks(*(len(p) + steps for p in prompts)) as blocks:
            toks = [self._step([(p, (), (KVRun(b, 0, len(p)),))])[0] for p, b in zip(prompts, blocks)]
            t = time.perf_counter()
            for s in range(steps):
                toks = self._step([((tok,), (KVRun(b, 0, len(p) + s),), (KVRun(b, len(p) + s, 1),))
                                   for tok, p, b in zip(toks, prompts, blocks)], decode=True)
            return (time.perf_counter() - t) / steps


class PeerError(RuntimeError):
    pass


class VLLMPeer:
    """``vllm_forward_worker.py`` in vLLM's venv: JSON commands on stdin, one JSON answer line each."""

    def __init__(self, threads: int, kv_bytes: int, out_dir: Path, dtype: str = "bfloat16") -> None:
        if not (VLLM_VENV / ".ok").exists():
            raise PeerError("vLLM is not set up: run `bash benchmarks/setup_peers.sh vllm` (log: benchmarks/logs/setup-vllm.log)")
        job = out_dir / "forward-vllm-job.json"
        job.write_text(json.dumps({"model_dir": str(MODEL_DIR), "kv_bytes": kv_bytes, "block_size": 32,
                                   "max_num_seqs": max(DECODE_BATCHES),
                                   "dtype": dtype}))
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
        lines = self.log.read_text(errors="replace").strip().splitlines()
        first_error = [ln.strip() for ln in lines if re.search(r"\w(Error|Exception): ", ln)][:1]
        raise PeerError(f"vLLM exited ({self.proc.returncode}) or timed out; log {self.log}: "
                        + " | ".join(first_error + [ln.strip() for ln in lines[-3:]]))

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        res = self._read(timeout=900)
        if "error" in res:
            raise PeerError(f"vLLM {cmd['op']}: {res['error']}")
        return res

    def settle(self, limit_s: float = 5.0) -> float:
        """Wait until vLLM's processes are idle: its worker busy-polls its queue for 1 s after each request."""
        t0 = time.perf_counter()
        time.sleep(1.0)
        while time.perf_counter() - t0 < limit_s:
            c0 = tree_cpu_s(self.proc.pid)
            time.sleep(0.1)
            if tree_cpu_s(self.proc.pid) - c0 < 0.01:
                break
        return time.perf_counter() - t0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # ends the worker's command loop
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def miss_overhead(engine: RAGCacheEngine, args, rng: random.Random) -> dict:
    """Mean TTFT of 0%-hit requests with the cache on vs off (steady state: the cache is full)."""
    eng = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype=engine.config.dtype, threads=args.threads,
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
    eng.close()
    on, off = (statistics.mean(x["ttft_s"] for x in recs[m]) for m in ("on", "off"))
    med = [statistics.median(x["ttft_s"] for x in recs[m]) for m in ("on", "off")]
    return {"records": recs, "mean_on_s": on, "mean_off_s": off, "overhead": on / off - 1.0, "fill_requests": fill + 1,
            "median_on_s": med[0], "median_off_s": med[1], "overhead_of_medians": med[0] / med[1] - 1.0,
            "mean_prompt_tokens": statistics.mean(x["prompt_tokens"] for x in recs["on"] + recs["off"]),
            "mean_cached_tokens_on": statistics.mean(x["cached_tokens"] for x in recs["on"])}


def memory_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> dict:
    """Read bandwidth of this machine now: ``torch.sum`` over a ``gib`` GiB float32 tensor on
    ``threads`` threads (the weights of a decode step stream the same way); best and median GB/s."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    del x
    return {"best_gb_s": max(rates), "median_gb_s": statistics.median(rates), "all_gb_s": rates, "threads": threads}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights, each tensor's storage counted once (tied embeddings once)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.untyped_storage().nbytes()
    return total


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


def load() -> str:
    """Load average and, where the kernel has PSI, the share of time some task waited for a CPU (avg60)."""
    psi = next((ln.split()[2] for ln in open("/proc/pressure/cpu") if ln.startswith("some")), "") \
        if os.path.exists("/proc/pressure/cpu") else ""
    return f"load average {os.getloadavg()[0]:.2f} (1 min)" + (f", CPU pressure {psi.split('=')[1]}%" if psi else "")


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    if "amx_bf16" in flags:
        isa += " + AMX-BF16"
    return {"cpu": cpu, "isa": isa, "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "load_start": load()}


def summary(xs: list[float]) -> dict:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "n": len(xs)} if xs else {}


def rounds(ours: Ours, peer: VLLMPeer | None, args, res: dict, ids) -> str | None:
    """The interleaved rounds; fills ``res`` and returns vLLM's error if it failed on the way."""
    error = None
    res.update(vllm_core={}, cold_first_tokens=[], vllm_cpu_s_while_ours_ran=0.0, ours_wall_s=0.0, settle_s=0.0,
               bandwidth_rounds=[])
    for rnd in range(-1, args.repeats):  # round -1 is the warm-up
        for key in MEASUREMENTS:
            cmd = ({"op": "cold", "ids": ids(COLD), "warm_ids": ids(COLD)} if key == "cold" else
                   {"op": "extend", "prefix": ids(CACHED), "new": ids(NEW)} if key == "extend" else
                   {"op": "decode", "prompts": [ids(CACHED) for _ in range(int(key.removeprefix("decode")))],
                    "steps": args.decode_steps})
            vtok = None
            for side in (("ours", "vllm") if rnd % 2 else ("vllm", "ours")):
                res["settle_s"] += peer.settle() if peer else 0.0  # both sides from the same idle state
                if side == "ours":
                    c0, w0 = tree_cpu_s(peer.proc.pid) if peer else 0.0, time.perf_counter()
                    t = getattr(ours, cmd["op"])(cmd)
                    if peer:  # a check that vLLM stayed idle while ours ran
                        res["vllm_cpu_s_while_ours_ran"] += tree_cpu_s(peer.proc.pid) - c0
                        res["ours_wall_s"] += time.perf_counter() - w0
                    if rnd >= 0:
                        res["ours"].setdefault(key, []).append(t)
                        if key == "decode1":  # the floor of this round: the bandwidth right after the step
                            res["bandwidth_rounds"].append(memory_bandwidth(args.threads, repeats=3)["best_gb_s"])
                elif peer:
                    try:
                        r = peer.ask(cmd)
                    except PeerError as exc:
                        error, peer = str(exc), None
                        print(f"vLLM failed: {error}", flush=True)
                        continue
                    vtok = r.get("first_token")
                    if rnd >= 0:
                        res["vllm"].setdefault(key, []).append(r["wall_s"])
                        res.setdefault("vllm_raw", {}).setdefault(key, []).append(r)
                        res["vllm_core"].setdefault(key, []).append(r.get("core_step_s" if "decode" in key else "core_prefill_s"))
            if vtok is not None:  # same weights, same ids: the greedy first tokens should agree
                res["cold_first_tokens"].append([ours.first_token, vtok])
        print(f"round {rnd + 1}/{args.repeats} done" if rnd >= 0 else "warm-up round done", flush=True)
        if args.json and rnd >= 0:  # the raw numbers so far: a run stopped later still leaves its rounds
            args.json.write_text(json.dumps({**res, "partial": f"{rnd + 1} of {args.repeats} rounds"}, indent=1))
    if peer:
        peer.close()
    return error


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (each: every measurement on both systems)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--miss-pairs", type=int, default=10, help="cache-on/off request pairs of the miss overhead (0: skip it)")
    ap.add_argument("--miss-device-mib", type=int, default=64)
    ap.add_argument("--miss-host-mib", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=480, help="random token ids decoded into each document's text")
    ap.add_argument("--no-vllm", action="store_true", help="ours only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="both systems' dtype (float32 on CPUs without bf16 arithmetic, where bf16 is emulated)")
    ap.add_argument("--json", type=Path, default=None, help="write every raw number here (also after each timed round, marked \"partial\")")
    args = ap.parse_args()
    if args.miss_pairs < 0 or args.repeats < 1:
        ap.error("--miss-pairs must be >= 0 and --repeats >= 1")
    out_dir = (args.json.parent if args.json else HERE / "logs").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(), "ours": {}, "vllm": {}}
    if not (MODEL_DIR / "config.json").exists():
        sys.path.insert(0, str(HERE))
        from convert_model import convert_hf
        print("writing the bf16 model folder ...", flush=True)
        convert_hf(HERE / "models")
    print("ours: loading the engine (first run on this model also measures its prefill profile) ...", flush=True)
    engine = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype=args.dtype, threads=args.threads,
                                         device_budget_bytes=1024 * MiB, host_budget_bytes=0))
    res["machine"]["forward_path"] = engine.runner.kernel_tag
    res["bandwidth"] = memory_bandwidth(args.threads)
    res["weight_bytes"] = weight_bytes(engine.loaded.model)
    print(f"memory read bandwidth {res['bandwidth']['best_gb_s']:.1f} GB/s; weights {res['weight_bytes'] / 1e6:.0f} MB: "
          f"floor {1e3 * res['weight_bytes'] / (res['bandwidth']['best_gb_s'] * 1e9):.1f} ms per decode step", flush=True)
    ours = Ours(engine)
    peer, vllm_error = None, None
    if not args.no_vllm:
        print("vLLM: starting the worker (a minute or two) ...", flush=True)
        try:
            peer = VLLMPeer(args.threads, 1536 * MiB, out_dir, dtype=args.dtype)
            res["vllm_info"] = peer.info
        except PeerError as exc:
            vllm_error = str(exc)
            print(f"vLLM failed: {vllm_error}", flush=True)
    rng = random.Random(args.seed)
    vocab = engine.loaded.model.config.vocab_size
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    vllm_error = rounds(ours, peer, args, res, ids) or vllm_error
    res["vllm_error"] = vllm_error
    res["miss"] = None
    if args.miss_pairs:
        print("ours: miss overhead ...", flush=True)
        res["miss"] = miss_overhead(engine, args, rng)
    engine.close()
    res["machine"]["load_end"] = load()
    res["summary"] = {k: {"ours": summary(res["ours"].get(k, [])), "vllm": summary(res["vllm"].get(k, [])),
                          "vllm_core": summary([x for x in res["vllm_core"].get(k, []) if x is not None])} for k in MEASUREMENTS}
    report(res, args)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
        print(f"raw numbers: {args.json}")


def report(res: dict, args) -> None:
    m, vi = res["machine"], res.get("vllm_info", {})
    print(f"\nmachine: {m['cpu']} ({m['isa']}), nproc {m['nproc']}; {m['date']}; at start {m['load_start']}; "
          f"at end {m['load_end']}; our forward path {m.get('forward_path', '?')}")
    print(f"memory read bandwidth {res['bandwidth']['best_gb_s']:.1f} GB/s (best of {len(res['bandwidth']['all_gb_s'])}; "
          f"median {res['bandwidth']['median_gb_s']:.1f}); weights {res['weight_bytes'] / 1e6:.0f} MB")
    print(f"torch {m['torch']} (ours); vLLM {vi.get('vllm', '-')} with torch {vi.get('torch', '-')}; threads {args.threads} each; "
          f"{args.dtype} {MODEL_DIR.name}; {args.repeats} rounds, median (min) in ms")
    if res["ours_wall_s"]:
        print(f"vLLM's processes used {100 * res['vllm_cpu_s_while_ours_ran'] / res['ours_wall_s']:.1f}% of a core while ours ran")
    fmt = "{:<34} {:>17} {:>17} {:>8} {:>7} {:>7} {:>15}"
    print(fmt.format("measurement", "ours ms", "vLLM ms", "ratio", "target", "result", "vLLM core ms"))
    ms = lambda s: f"{1e3 * s['median_s']:.1f} ({1e3 * s['min_s']:.1f})" if s else "-"  # noqa: E731
    for key, label in MEASUREMENTS.items():
        s = res["summary"][key]
        ratio = s["ours"]["median_s"] / s["vllm"]["median_s"] if s["ours"] and s["vllm"] else None
        res["summary"][key]["ratio"] = ratio
        print(fmt.format(label, ms(s["ours"]), ms(s["vllm"]), f"{ratio:.2f}" if ratio else "-", f"<= {TARGET}",
                         ("met" if ratio <= TARGET else "MISSED") if ratio else "-", ms(s["vllm_core"])))
    floor_s = res["weight_bytes"] / (res["bandwidth"]["best_gb_s"] * 1e9)
    d1 = res["summary"]["decode1"]["ours"]
    if d1:
        over = d1["median_s"] / floor_s
        res["summary"]["decode1"]["over_floor"] = over
        print(fmt.format("decode batch 1 / floor at start", f"{1e3 * d1['median_s']:.1f}", f"{1e3 * floor_s:.1f} floor",
                         f"{over:.2f}", f"<= {FLOOR_TARGET}", "met" if over <= FLOOR_TARGET else "MISSED", "-"))
    steps, bws = res["ours"].get("decode1", []), res.get("bandwidth_rounds", [])
    if steps and len(bws) == len(steps):  # each round's step against the floor measured right after it
        floors = [res["weight_bytes"] / (bw * 1e9) for bw in bws]
        per_round = [t / f for t, f in zip(steps, floors)]
        over = statistics.median(per_round)
        res["summary"]["decode1"].update(over_floor_rounds=per_round, over_floor_by_round=over)
        print(fmt.format("decode batch 1 / floor of its round", f"{1e3 * statistics.median(steps):.1f}",
                         f"{1e3 * statistics.median(floors):.1f} floor", f"{over:.2f}", f"<= {FLOOR_TARGET}",
                         "met" if over <= FLOOR_TARGET else "MISSED", "-"))
        print(f"  - per round: step / floor {', '.join(f'{1e3 * t:.1f} / {1e3 * f:.1f} ms' for t, f in zip(steps, floors))}"
              f" (read bandwidth {', '.join(f'{bw:.1f}' for bw in bws)} GB/s)")
    mo, notes = res["miss"], []
    if mo is None:
        notes.append("miss overhead: not measured (--miss-pairs 0)")
    else:
        print(fmt.format("miss overhead, on vs off (0% hits)", f"{1e3 * mo['mean_on_s']:.1f} on", f"{1e3 * mo['mean_off_s']:.1f} off",
                         f"{100 * mo['overhead']:+.1f}%", "<= 3%", "met" if mo["overhead"] <= 0.03 else "MISSED", "-"))
        notes.append(f"miss: {args.miss_pairs} pairs, mean prompt {mo['mean_prompt_tokens']:.0f} tokens, cache-on reuses "
                     f"{mo['mean_cached_tokens_on']:.0f} system-prompt tokens, after {mo['fill_requests']} requests filled the cache")
    if res.get("vllm_raw", {}).get("extend"):
        notes.append(f"vLLM prefix hits of the {NEW}-over-{CACHED} requests: {[r['cached_tokens'][0] for r in res['vllm_raw']['extend']]}")
    if res["cold_first_tokens"]:
        same = sum(a == b for a, b in res["cold_first_tokens"])
        notes.append(f"greedy first token of the cold prompts, ours == vLLM: {same} of {len(res['cold_first_tokens'])}")
    if res["vllm_error"]:
        notes.append(f"vLLM error: {res['vllm_error']}")
    print("\n".join(f"  - {n}" for n in notes))


if __name__ == "__main__":
    main()
