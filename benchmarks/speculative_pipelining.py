"""Dynamic speculative pipelining (RAGCache §5.3, Table 3 / Figure 19), speculation on and off
side by side in one run, over a >= 1M-vector IVF index of real text.

The index: every 64-word window (stride 1 word) of the Python 3.11 documentation
(``python3.11-doc``), about 1.4M windows, each one a retrievable document. Embedding 1.4M texts
with the full all-MiniLM-L6-v2 transformer would take hours on 2 cores, so the windows and the
questions are embedded with that model's *static* word-piece embeddings (the sum of a text's
token vectors from its input embedding table, L2-normalised: a bag-of-embeddings encoder). The
IVF index (nlist = 4 sqrt(n), trained on a 200k sample) is built once and cached under
``benchmarks/.cache/`` (outside the test suite); its size and build time are printed and stored.

For each share of the index searched (nprobe / nlist, as Table 3 varies it) every question runs
twice, speculation off (search, then generate: ``ask``) and on (``ask(pipelined=True)``: the
search in ``--stages`` stages, Algorithm 2), alternating which goes first, each from the same
cache state: ``cold`` (``reset_cache``: the whole prompt is prefilled) and ``warm`` (the final
documents' KV cached by an earlier request with another question, so only the question is
prefilled: the case where search and prefill take about the same time here). Reported: TTFT from the question to the
first token, the search time and the part of it not overlapped with the prefill of the final
documents, wasted speculative tokens, and whether the answers were identical. Then the high-load
case: ``--clients`` threads each sending ``--burst`` requests at once, on and off alternately;
throughput and mean TTFT.

    .venv/bin/python benchmarks/speculative_pipelining.py --questions 12 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmark_report import write_report  # benchmarks/ is on sys.path when a script runs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

WINDOW = 64
CACHE = Path(__file__).resolve().parent / ".cache" / "speculative-pipelining"


class StaticEmbedder:
    """Bag of all-MiniLM-L6-v2 word-piece input embeddings, L2-normalised (float32 [384])."""

    name = "static-wordpiece-all-MiniLM-L6-v2"

    def __init__(self) -> None:
        from safetensors.numpy import load_file
        from transformers import AutoTokenizer

        from ragcache_backend.retrieval.embedder import default_model_path

        path = default_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        weights = load_file(str(path / "model.safetensors"))
        key = next(k for k in weights if k.endswith("word_embeddings.weight"))
        self.table = weights[key].astype(np.float32)
        self.dim = self.table.shape[1]

    def word_vectors(self, words: list[str]) -> np.ndarray:
        """Sum of each word's token vectors: float32 [len(words), dim]."""
        out = np.zeros((len(words), self.dim), dtype=np.float32)
        for start in range(0, len(words), 4096):
            batch = self.tokenizer(words[start:start + 4096], add_special_tokens=False)["input_ids"]
            for i, ids in enumerate(batch):
                if ids:
                    out[start + i] = self.table[ids].sum(axis=0)
        return out

    def embed_query(self, text: str) -> np.ndarray:
        vector = self.word_vectors(text.split()).sum(axis=0)
        return (vector / max(np.linalg.norm(vector), 1e-12)).astype(np.float32)


def corpus_words() -> tuple[list[str], str]:
    from ragcache_backend.demo.datasets import python_docs_dir

    files = sorted(python_docs_dir().rglob("*.rst.txt"))
    words: list[str] = []
    digest = hashlib.sha256()
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        digest.update(path.name.encode())
        digest.update(str(len(text)).encode())
        words.extend(text.split())
    return words, digest.hexdigest()[:16]


def build_or_load(embedder: StaticEmbedder):
    """``(documents, faiss index, meta)``, built once and cached."""
    import faiss

    from ragcache_backend.retrieval.documents import Document, content_id

    words, fingerprint = corpus_words()
    n = len(words) - WINDOW + 1
    meta_path, index_path = CACHE / "meta.json", CACHE / "index.faiss"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if meta is None or meta.get("fingerprint") != fingerprint or not index_path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        vocab = sorted(set(words))
        uid = {w: i for i, w in enumerate(vocab)}
        vocab_vectors = embedder.word_vectors(vocab)
        ids = np.fromiter((uid[w] for w in words), dtype=np.int64, count=len(words))
        vectors = np.empty((n, embedder.dim), dtype=np.float32)
        step = 50_000
        for s in range(0, n, step):
            e = min(n, s + step)
            run = vocab_vectors[ids[s:e + WINDOW - 1]].astype(np.float64)
            cs = np.concatenate([np.zeros((1, embedder.dim)), np.cumsum(run, axis=0)])
            vectors[s:e] = cs[WINDOW:WINDOW + e - s] - cs[:e - s]
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        embed_s = time.perf_counter() - t0
        nlist = round(4 * np.sqrt(n))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(embedder.dim), embedder.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        sample = vectors[np.random.default_rng(0).choice(n, size=min(n, 200_000), replace=False)]
        index.train(sample)
        index.add(vectors)
        build_s = time.perf_counter() - t0
        faiss.write_index(index, str(index_path))
        meta = {"fingerprint": fingerprint, "vectors": n, "dim": embedder.dim, "nlist": nlist, "window_words": WINDOW,
                "corpus_words": len(words), "embed_s": round(embed_s, 1), "build_s": round(build_s, 1),
                "index_bytes": index_path.stat().st_size, "built": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        meta_path.write_text(json.dumps(meta, indent=2))
        del vectors
    index = faiss.read_index(str(index_path))
    t0 = time.perf_counter()
    docs = []
    for s in range(n):
        text = " ".join(words[s:s + WINDOW])
        docs.append(Document(content_id(text), text, "python-docs", f"window {s}"))
    meta["documents_s"] = round(time.perf_counter() - t0, 1)
    return docs, index, meta


def one(engine, store, question: str, k: int, sampling, pipelined: bool, stages: int, warm: bool) -> dict:
    engine.reset_cache()  # cold: the whole prompt is prefilled, both ways
    if warm:  # the documents' KV from an earlier request that asked something else
        from ragcache_backend.model.sampling import SamplingParams

        docs = [h.document for h in store.search(question, k)]
        engine.generate("Summarise these documents in one sentence.", docs, SamplingParams(max_tokens=1))
    r = engine.ask(question, k=k, sampling=sampling, pipelined=pipelined, num_stages=stages)
    return {"ttft_s": r.ttft_s, "search_s": r.search_s, "unoverlapped_s": r.unoverlapped_search_s,
            "prefill_s": r.ttft_s - r.search_s, "wasted": r.wasted_tokens, "spec": r.speculative_requests,
            "kept": r.speculation_kept, "tokens": r.token_ids, "docs": r.documents}


def burst(engine, questions: list[str], k: int, sampling, pipelined: bool, stages: int, clients: int) -> dict:
    engine.reset_cache()
    ttfts: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def client(i: int) -> None:
        barrier.wait()
        for q in questions[i::clients]:
            r = engine.ask(q, k=k, sampling=sampling, pipelined=pipelined, num_stages=stages)
            with lock:
                ttfts.append(r.ttft_s)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"requests": len(ttfts), "wall_s": wall, "throughput_rps": len(ttfts) / wall,
            "mean_ttft_s": statistics.fmean(ttfts), "p50_ttft_s": statistics.median(ttfts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--shares", default="0.125,0.25,0.5,1.0", help="nprobe / nlist values")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the engine (default: torch's)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--burst", type=int, default=3, help="requests per client in the high-load bursts")
    ap.add_argument("--load-share", type=float, default=0.5)
    ap.add_argument("--caches", default="cold,warm", help="cache states to measure: cold, warm")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()

    from ragcache_backend.config import EngineConfig
    from ragcache_backend.demo.datasets import faq_questions
    from ragcache_backend.engine.engine import RAGCacheEngine
    from ragcache_backend.model.sampling import SamplingParams
    from ragcache_backend.retrieval.docstore import DocumentStore

    embedder = StaticEmbedder()
    t0 = time.perf_counter()
    docs, index, meta = build_or_load(embedder)
    print(f"index: {meta['vectors']:,} vectors x {meta['dim']} (IVF, nlist {meta['nlist']}), "
          f"{meta['index_bytes'] / 2**30:.2f} GiB, built in {meta['build_s']} s on {meta['built']}; "
          f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    base = DocumentStore(docs, index, embedder, nprobe=index.nlist)
    engine = RAGCacheEngine(EngineConfig(threads=args.threads))
    sampling = SamplingParams(max_tokens=args.max_tokens)
    questions = faq_questions()
    low_q = questions[: args.questions]
    engine.store = base.with_nprobe(max(1, round(0.125 * index.nlist)))
    engine.ask(low_q[0], k=args.k, sampling=sampling)  # warm-up
    engine.ask(low_q[0], k=args.k, sampling=sampling, pipelined=True)

    rows = []
    for cache, share in [(c, float(s)) for c in args.caches.split(",") for s in args.shares.split(",")]:
        nprobe = max(1, round(share * index.nlist))
        engine.store = base.with_nprobe(nprobe)
        off, on, same = [], [], 0
        for i, q in enumerate(low_q):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {p: one(engine, engine.store, q, args.k, sampling, p, args.stages, cache == "warm") for p in order}
            off.append(got[False])
            on.append(got[True])
            same += got[False]["tokens"] == got[True]["tokens"] and got[False]["docs"] == got[True]["docs"]

        def mean(xs, key):
            return statistics.fmean(x[key] for x in xs)

        row = {"cache": cache, "share": share, "nprobe": nprobe, "requests": len(low_q), "identical_answers": same,
               "search_s": mean(off, "search_s"), "prefill_s_off": mean(off, "prefill_s"),
               "ttft_off_s": mean(off, "ttft_s"), "ttft_on_s": mean(on, "ttft_s"),
               "unoverlapped_off_s": mean(off, "unoverlapped_s"), "unoverlapped_on_s": mean(on, "unoverlapped_s"),
               "search_on_s": mean(on, "search_s"), "kept": sum(x["kept"] for x in on),
               "speculative_per_request": mean(on, "spec"), "wasted_tokens_per_request": mean(on, "wasted")}
        row["ttft_ratio_off_on"] = row["ttft_off_s"] / row["ttft_on_s"]
        row["unoverlapped_reduction"] = 1 - row["unoverlapped_on_s"] / row["unoverlapped_off_s"]
        rows.append(row)
        print(f"{cache} share {share:>6.3f} (nprobe {nprobe}): search {row['search_s']*1e3:6.0f} ms, prefill {row['prefill_s_off']*1e3:5.0f} ms | "
              f"TTFT off {row['ttft_off_s']*1e3:6.0f} ms, on {row['ttft_on_s']*1e3:6.0f} ms ({row['ttft_ratio_off_on']:.2f}x) | "
              f"unoverlapped search off {row['unoverlapped_off_s']*1e3:5.0f} ms, on {row['unoverlapped_on_s']*1e3:5.0f} ms "
              f"(-{row['unoverlapped_reduction']*100:.0f}%) | kept {row['kept']}/{len(low_q)}, "
              f"{row['speculative_per_request']:.1f} speculative/request, {row['wasted_tokens_per_request']:.0f} wasted tok/request | "
              f"identical {same}/{len(low_q)}", flush=True)

    engine.store = base.with_nprobe(max(1, round(args.load_share * index.nlist)))
    load_q = questions[args.questions: args.questions + args.clients * args.burst]
    load = {False: [], True: []}
    for p in (False, True, False, True):
        load[p].append(burst(engine, load_q, args.k, sampling, p, args.stages, args.clients))
    high = {name: {"throughput_rps": statistics.fmean(b["throughput_rps"] for b in load[p]),
                   "mean_ttft_s": statistics.fmean(b["mean_ttft_s"] for b in load[p]), "bursts": load[p]}
            for name, p in (("off", False), ("on", True))}
    high["throughput_ratio_on_off"] = high["on"]["throughput_rps"] / high["off"]["throughput_rps"]
    print(f"high load ({args.clients} clients x {args.burst} requests at once, share {args.load_share}): throughput "
          f"off {high['off']['throughput_rps']:.2f} req/s, on {high['on']['throughput_rps']:.2f} req/s "
          f"({high['throughput_ratio_on_off']:.2f}x); mean TTFT off {high['off']['mean_ttft_s']:.2f} s, "
          f"on {high['on']['mean_ttft_s']:.2f} s", flush=True)

    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "command": " ".join([Path(sys.executable).name, *sys.argv]), "index": meta,
           "config": vars(args) | {"json": str(args.json), "plot": str(args.plot)}, "low_load": rows, "high_load": high}
    write_report(out, args.json, echo=False)
    if args.plot:
        plot(rows, args.plot)
    engine.close()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caches = sorted({r["cache"] for r in rows}, key=["cold", "warm"].index)
    fig, axes = plt.subplots(len(caches), 2, figsize=(10, 3.4 * len(caches)), squeeze=False)
    for (a, b), cache in zip(axes, caches):
        part = [r for r in rows if r["cache"] == cache]
        shares = [f"{r['share'] * 100:g}%" for r in part]
        x = np.arange(len(part))
        a.bar(x - 0.2, [r["ttft_off_s"] * 1e3 for r in part], 0.4, label="speculation off")
        a.bar(x + 0.2, [r["ttft_on_s"] * 1e3 for r in part], 0.4, label="speculation on")
        a.set(xticks=x, xticklabels=shares, xlabel="share of the index searched", ylabel="mean TTFT (ms)",
              title=f"{cache} cache: question in -> first token out")
        a.legend()
        b.bar(x - 0.2, [r["unoverlapped_off_s"] * 1e3 for r in part], 0.4, label="off")
        b.bar(x + 0.2, [r["unoverlapped_on_s"] * 1e3 for r in part], 0.4, label="on")
        b.plot(x, [r["search_s"] * 1e3 for r in part], "k.", label="search time")
        b.set(xticks=x, xticklabels=shares, xlabel="share of the index searched", ylabel="ms",
              title=f"{cache} cache: search time not overlapped with prefill")
        b.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)

if __name__ == "__main__":
    main()
