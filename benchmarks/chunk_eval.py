"""Chunk-cache mode (Cache-Craft) evaluated in one run: answer quality against full recomputation,
prompt tokens computed and TTFT against the knowledge tree alone and against vLLM's prefix caching.

    .venv/bin/python benchmarks/chunk_eval.py [--requests 60] [--warmup 60] [--vllm] [--json OUT] [--png OUT]

Workload: real questions (the Python FAQ headings and MMLU test questions) over the whole Python
3.11 documentation (the Faiss index of ``ragcache index``); document popularity is skewed (Zipf over
each question's top-1 document, ``ragcache_backend.bench.workload``). Each request retrieves its
question's top-k (k drawn from ``--k-min``..``--k-max``), presents the documents in a shuffled order,
and puts the question *first* (``Question: ... Context: <documents> Answer:``), as LangChain's stock
RAG prompt does: the knowledge tree and vLLM's prefix cache can reuse only the template before the
question; chunk caches can reuse every document seen before, at any position.

Protocol, per request, after ``--warmup`` requests that fill the caches (served one at a time):

1. Quality: one batch of concurrent requests on the chunk engine, all over the same cache state
   (``store=False``, ``reuse="chunk"``: every document goes through the rule under test): full
   recomputation (the reference), then each recompute rule: full reuse with
   RoPE fixed and no recomputation; CacheBlend-style selection (every reused token through layer 1,
   then the 15% whose K/V deviate most); each chunk's first 32 tokens (EPIC-style); Cache-Craft's
   CFO at every ``--alphas`` value with the serving rule's quality guard, and at the serving alpha
   also without the guard and with Algorithm 1's early termination; every token (share 1).
   Recompute shares count a token recomputed through l of L layers as l/L.
   Each generates ``--max-tokens`` greedy tokens; we score ROUGE-L F1 of the answer against the
   reference's, whether the first token agrees, and the KL divergence of the first-token
   distribution (reference || rule).
2. Speed: the same prompt alone with ``max_tokens=1`` on (a) the chunk engine with the serving rule
   (this request's new chunks become variants: the cache moves on), (b) the knowledge tree alone
   (``reuse="exact"``, its own engine and cache, fed the same trace), (c) no cache. vLLM (``--vllm``)
   serves the same token ids, warm-up included, one at a time in its own process afterwards.

Reported per rule: mean ROUGE-L F1, first-token agreement, mean KL, recompute share (recomputed /
tokens of chunks served from variants), computed prompt tokens (and against the tree alone);
TTFT means of the chunk engine, the tree alone, no cache and vLLM; the guard's effect on the worst
5% of requests; and the alpha trade-off curve (``--png``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ragcache_backend.bench.workload import build_workload, question_pool  # noqa: E402
from ragcache_backend.cache.chunk_reuse import RecomputeRule  # noqa: E402
from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.demo.datasets import python_docs_dir  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.sampling import SamplingParams  # noqa: E402
from ragcache_backend.retrieval.docstore import build_index  # noqa: E402

MiB = 1024 * 1024
MODEL_DIR = HERE / "models" / "smollm2-135m-bf16"


BLEND = "CacheBlend-style: 15% by K/V deviation at layer 1"
EPIC = "EPIC-style: first 32 tokens of each chunk"
NONE = "full reuse (RoPE fixed, no recompute)"
ALL = "recompute every token"


def cfo_name(alpha: float, extra: str = "") -> str:
    return f"Cache-Craft CFO, alpha {alpha:g}{extra}"


def selection_grid(shares: list[float]) -> dict[str, RecomputeRule]:
    """Token selection at equal recompute shares (``--selection-grid``): Cache-Craft's ranking by
    recorded inter-attention (eq. 14), CacheBlend-style deviation at layer 1, and each chunk's
    leading tokens (EPIC-style, 300-token chunks assumed for the count)."""
    out = {}
    for share in shares:
        out[f"share {share:g}: by inter-attention (eq. 14)"] = RecomputeRule("share", share=share)
        out[f"share {share:g}: by K/V deviation at layer 1"] = RecomputeRule("blend", share=share)
        out[f"share {share:g}: leading {round(share * 300)} tokens"] = RecomputeRule("leading", leading=round(share * 300))
    out[NONE] = RecomputeRule("none")
    return out


def rules(alphas: list[float], serving: RecomputeRule) -> dict[str, RecomputeRule]:
    """The rules compared on every request; the CFO sweep runs with the serving rule's guard."""
    out = {
        NONE: RecomputeRule("none"),
        BLEND: RecomputeRule("blend", share=0.15),
        EPIC: RecomputeRule("leading", leading=32),
    }
    for a in alphas:
        out[cfo_name(a)] = RecomputeRule("cfo", alpha=a, guard=serving.guard)
    out[cfo_name(serving.alpha, ", no guard")] = RecomputeRule("cfo", alpha=serving.alpha)
    out[cfo_name(serving.alpha, ", paper's beta (no added-context term)")] = RecomputeRule(
        "cfo", alpha=serving.alpha, guard=serving.guard, added_context=False)
    out[cfo_name(serving.alpha, ", Algorithm 1 (w=3)")] = RecomputeRule("cfo", alpha=serving.alpha, guard=serving.guard,
                                                                       focus_window=3)
    out[ALL] = RecomputeRule("all")
    return out


def rouge_l(reference: str, candidate: str) -> float:
    from rouge_score import rouge_scorer

    if not reference.strip() and not candidate.strip():
        return 1.0
    return rouge_scorer.RougeScorer(["rougeL"]).score(reference, candidate)["rougeL"].fmeasure


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p = torch.log_softmax(ref_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum())


def trace(args):
    store = build_index(python_docs_dir(), progress=True)
    pool = question_pool(store, k=args.k_max, faq=True, mmlu=args.mmlu, seed=args.seed)
    wl = build_workload(store, pool, num_requests=args.warmup + args.requests, zipf_s=args.zipf, seed=args.seed,
                        warmup=args.warmup)
    rng = random.Random(args.seed + 1)
    items = []
    for r in wl.requests:
        k = rng.randint(args.k_min, args.k_max)
        docs = list(r.doc_ids[:k])
        rng.shuffle(docs)
        items.append((r.question, [store.get(d) for d in docs]))
    return store, wl, items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--k-min", type=int, default=3)
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--mmlu", type=int, default=100)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--alphas", default="0.5,1,2,4,8")
    ap.add_argument("--alpha", type=float, default=None, help="the serving rule's alpha (default: the engine's)")
    ap.add_argument("--guard", type=float, default=None, help="the guard threshold (default: the engine's)")
    ap.add_argument("--model", default=str(MODEL_DIR) if MODEL_DIR.exists() else "")
    ap.add_argument("--dtype", default="bfloat16", help="ours and vLLM's (float32 on CPUs without bf16 arithmetic)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device-mib", type=int, default=512)
    ap.add_argument("--host-mib", type=int, default=2048)
    ap.add_argument("--vllm", action="store_true", help="run vLLM (benchmarks/setup_peers.sh vllm) on the same prompts")
    ap.add_argument("--selection-grid", default="", help="instead of the rule table: token selection methods at these "
                    "comma-separated recompute shares (e.g. 0.1,0.3,0.5,0.7)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from forward_vs_vllm import machine

    t0 = time.perf_counter()
    store, wl, items = trace(args)
    print(f"[{time.perf_counter() - t0:6.0f}s] trace: {args.warmup} warm-up + {args.requests} requests, "
          f"{len(wl.documents)} distinct documents of {len(store)}", flush=True)
    loaded = load_model(args.model or None, dtype=args.dtype)
    base = dict(dtype=args.dtype, threads=args.threads, device_budget_bytes=args.device_mib * MiB,
                host_budget_bytes=args.host_mib * MiB, max_batch_size=16)
    chunk_cfg = EngineConfig(reuse="auto", **base)
    if args.alpha is not None:
        chunk_cfg = chunk_cfg.model_copy(update={"chunk_alpha": args.alpha})
    if args.guard is not None:
        chunk_cfg = chunk_cfg.model_copy(update={"chunk_guard": args.guard})
    chunk = RAGCacheEngine(chunk_cfg, loaded=loaded)
    tree = RAGCacheEngine(EngineConfig(reuse="exact", **base), loaded=loaded, profile=chunk.profile)
    off = RAGCacheEngine(EngineConfig(enable_cache=False, **base), loaded=loaded, profile=chunk.profile)
    serving = chunk_cfg.recompute_rule()
    grid = [float(x) for x in args.selection_grid.split(",") if x]
    table = selection_grid(grid) if grid else rules([float(a) for a in args.alphas.split(",") if a], serving)
    one, gen = SamplingParams(max_tokens=1), SamplingParams(max_tokens=args.max_tokens)
    prompts = []
    for question, docs in items[: args.warmup]:
        segs, _ = chunk.segments_for(question, docs, gen, question_first=True)
        prompts.append([t for s in segs for t in s.token_ids])
        chunk.submit_segments(segs, one).result()
        tree.submit_segments(segs, one).result()
    print(f"[{time.perf_counter() - t0:6.0f}s] warm-up done: {chunk.cache.num_variants} chunk variants", flush=True)
    records = []
    for n, (question, docs) in enumerate(items[args.warmup:]):
        segs, _ = chunk.segments_for(question, docs, gen, question_first=True)
        prompts.append([t for s in segs for t in s.token_ids])
        ref = chunk.submit_segments(segs, gen, use_cache=False, keep_logits=True)
        # reuse="chunk": every document is served by the rule under test (no exact or approximate
        # tree path past the first document), all over the same cache state
        runs = {name: chunk.submit_segments(segs, gen, reuse="chunk", recompute=rule, store=False, keep_logits=True)
                for name, rule in table.items()}
        ref_res = ref.result()
        rec = {"question": question, "docs": [d.doc_id for d in docs], "prompt_tokens": ref_res.prompt_tokens,
               "reference": ref_res.answer, "rules": {}}
        for name, h in runs.items():
            res = h.result()
            reused = res.chunk_cached_tokens + res.recomputed_tokens
            rec["rules"][name] = {
                "rouge_l": rouge_l(ref_res.answer, res.answer),
                "first_token": bool(res.token_ids[:1] == ref_res.token_ids[:1]),
                "kl": kl(ref.first_logits, h.first_logits),
                "computed_tokens": res.computed_tokens, "recomputed_tokens": res.recomputed_tokens,
                "reused_chunk_tokens": reused, "chunk_hits": res.chunk_hits, "guarded": res.guarded_chunks,
                "deviation": res.chunk_deviation,
                "answer": res.answer,
            }
        serve = chunk.submit_segments(segs, one).result()
        exact = tree.submit_segments(segs, one).result()
        cold = off.submit_segments(segs, one).result()
        rec["ttft_s"] = {"chunk": serve.ttft_s, "tree": exact.ttft_s, "no_cache": cold.ttft_s}
        rec["computed"] = {"chunk": serve.computed_tokens, "tree": exact.computed_tokens, "no_cache": cold.computed_tokens}
        rec["serving"] = {"chunk_hits": serve.chunk_hits, "recomputed": serve.recomputed_tokens,
                          "chunk_cached": serve.chunk_cached_tokens, "guarded": serve.guarded_chunks}
        records.append(rec)
        cc = rec["rules"].get(cfo_name(serving.alpha, ", no guard"), rec["rules"][NONE])
        print(f"[{time.perf_counter() - t0:6.0f}s] {n + 1}/{args.requests} prompt {ref_res.prompt_tokens} tok: "
              f"computed chunk {serve.computed_tokens} / tree {exact.computed_tokens}; TTFT chunk {serve.ttft_s:.3f} "
              f"tree {exact.ttft_s:.3f} off {cold.ttft_s:.3f}; CFO rouge {cc['rouge_l']:.2f} first {cc['first_token']}",
              flush=True)
    res = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "config": chunk_cfg.model_dump(mode="json"),
           "serving_rule": {"kind": serving.kind, "alpha": serving.alpha, "guard": serving.guard},
           "trace": {"distinct_documents": len(wl.documents), "corpus": len(store), "skew": wl.skew},
           "variants_at_end": chunk.cache.num_variants, "cache_stats": dataclasses.asdict(chunk.cache.stats),
           "records": records}
    if args.vllm:
        res["vllm"] = run_vllm(prompts, args)
    res["summary"] = summarise(res, table, serving)
    report(res, table)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    if args.png and not grid:
        plot(res, args.png, [float(a) for a in args.alphas.split(",") if a])
    for eng in (chunk, tree, off):
        eng.close()


def run_vllm(prompts: list[list[int]], args) -> dict:
    from forward_vs_vllm import PeerError, VLLMPeer

    out = (args.json.parent if args.json else Path("bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        peer = VLLMPeer(args.threads, (args.device_mib + args.host_mib) * MiB, out, dtype=args.dtype)
    except PeerError as exc:
        return {"error": str(exc)}
    try:
        ans = peer.ask({"op": "trace", "prompts": prompts})
        return {"info": peer.info, "ttft_s": ans["wall_s"][args.warmup:], "cached_tokens": ans["cached_tokens"][args.warmup:]}
    except PeerError as exc:
        return {"error": str(exc), "info": peer.info}
    finally:
        peer.close()


def summarise(res: dict, table: dict, serving: RecomputeRule) -> dict:
    recs = res["records"]
    tree_computed = sum(r["computed"]["tree"] for r in recs)
    out = {"rules": {}}
    for name in table:
        rows = [r["rules"][name] for r in recs]
        hit = [x for x in rows if x["chunk_hits"] or x["guarded"]]  # requests where chunk reuse was tried
        reused = sum(x["reused_chunk_tokens"] for x in rows)
        computed = sum(x["computed_tokens"] for x in rows)
        worst = sorted(x["rouge_l"] for x in rows)[: max(1, math.ceil(0.05 * len(rows)))]
        devs = sorted(x["deviation"] for x in hit)
        out["rules"][name] = {
            "rouge_l": statistics.mean(x["rouge_l"] for x in rows),
            "first_token_agreement": statistics.mean(x["first_token"] for x in rows),
            "kl": statistics.mean(x["kl"] for x in rows),
            "requests_with_chunk_reuse": len(hit),
            "rouge_l_reused": statistics.mean(x["rouge_l"] for x in hit) if hit else float("nan"),
            "first_token_reused": statistics.mean(x["first_token"] for x in hit) if hit else float("nan"),
            "recompute_share": sum(x["recomputed_tokens"] for x in rows) / reused if reused else 0.0,
            "computed_tokens_mean": computed / len(rows),
            "computed_vs_tree": computed / tree_computed if tree_computed else float("nan"),
            "worst5_rouge_l": statistics.mean(worst),
            "guarded_chunks": sum(x["guarded"] for x in rows),
            "deviation_p50_p90_max": [devs[len(devs) // 2], devs[int(0.9 * (len(devs) - 1))], devs[-1]] if devs else [],
        }
    ttft = {k: statistics.mean(r["ttft_s"][k] for r in recs) for k in ("chunk", "tree", "no_cache")}
    if "ttft_s" in res.get("vllm", {}):
        ttft["vllm"] = statistics.mean(res["vllm"]["ttft_s"])
    out["ttft_mean_s"] = ttft
    out["computed_tokens_mean"] = {k: statistics.mean(r["computed"][k] for r in recs) for k in ("chunk", "tree", "no_cache")}
    if "cached_tokens" in res.get("vllm", {}):
        out["computed_tokens_mean"]["vllm"] = statistics.mean(
            r["prompt_tokens"] - c for r, c in zip(recs, res["vllm"]["cached_tokens"]))
    out["prompt_tokens_mean"] = statistics.mean(r["prompt_tokens"] for r in recs)
    return out


def report(res: dict, table: dict) -> None:
    s = res["summary"]
    print(f"\n{len(res['records'])} requests, mean prompt {s['prompt_tokens_mean']:.0f} tokens; machine {res['machine']['cpu']}")
    print(f"{'rule':52s} {'ROUGE-L':>7s} {'first':>6s} {'KL':>7s} {'n reuse':>7s} {'R-L re':>6s} {'1st re':>6s} "
          f"{'recomp':>7s} {'computed':>8s} {'vs tree':>7s} {'worst5%':>7s} {'guard':>5s}  deviation p50/p90/max")
    for name, x in s["rules"].items():
        dev = "/".join(f"{d:.3f}" for d in x["deviation_p50_p90_max"])
        print(f"{name:52s} {x['rouge_l']:7.3f} {x['first_token_agreement']:6.1%} {x['kl']:7.4f} "
              f"{x['requests_with_chunk_reuse']:7d} {x['rouge_l_reused']:6.3f} {x['first_token_reused']:6.1%} "
              f"{x['recompute_share']:7.1%} {x['computed_tokens_mean']:8.0f} {x['computed_vs_tree']:7.2f} "
              f"{x['worst5_rouge_l']:7.3f} {x['guarded_chunks']:5d}  {dev}")
    t = s["ttft_mean_s"]
    print("mean TTFT (s): " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))
    print("mean computed prompt tokens: " + ", ".join(f"{k} {v:.0f}" for k, v in s["computed_tokens_mean"].items()))
    if "vllm" in t:
        print(f"chunk / vLLM = {t['chunk'] / t['vllm']:.2f} (target <= 0.6); chunk / tree = {t['chunk'] / t['tree']:.2f}")
    if "error" in res.get("vllm", {}):
        print(f"vLLM failed: {res['vllm']['error']}")


def plot(res: dict, path: Path, alphas: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules_ = res["summary"]["rules"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    xs = [rules_[cfo_name(a)]["recompute_share"] for a in alphas]
    for i, (key, label) in enumerate((("rouge_l", "ROUGE-L F1"), ("first_token_agreement", "first-token agreement"))):
        ax[i].plot(xs, [rules_[cfo_name(a)][key] for a in alphas], "o-", label="Cache-Craft CFO (alpha sweep)")
        for a, x in zip(alphas, xs):
            ax[i].annotate(f"{a:g}", (x, rules_[cfo_name(a)][key]), fontsize=8)
        for name, marker in ((NONE, "x"), (BLEND, "s"), (EPIC, "^"), (ALL, "D")):
            ax[i].plot([rules_[name]["recompute_share"]], [rules_[name][key]], marker, label=name)
        ax[i].set_xlabel("recomputed share of reused chunk tokens")
        ax[i].set_ylabel(label)
        ax[i].grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    fig.suptitle(f"chunk reuse vs full recomputation, {len(res['records'])} question-first requests, {res['machine']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
