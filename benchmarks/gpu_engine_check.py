"""The engine's CUDA path on a model of the default's shape: exactness of KV reuse through every tier,
and time to first token with and without a hit.

Where ``torch.cuda`` sees a GPU (the lent GPU machine, ``benchmarks/gpu_check.sh``), this builds
SmolLM2-135M's architecture (its ``config.json``) with seeded random weights (the real weights do
not travel to that machine; a forward pass costs the same whatever the values) and the real
tokenizer, and runs RAG requests over a pool of documents through :class:`RAGCacheEngine` with a
device tier too small for the pool, a pinned host tier and a disk tier, so that hits come from
each tier (a host hit is copied host -> device; a disk hit is read, checked and copied in).

For each request, in float32: the answer with the cache equals the answer without it (greedy, same
tokens) and the last prompt token's logits agree within 1e-3 (the script exits non-zero otherwise);
cached tokens and the tier of each hit are counted. Then TTFT (median of ``--repeats``) for a cold prompt, the same prompt fully
cached, and a prompt whose documents are cached but whose question is new, in float32 and
bfloat16. Prints one JSON object (and writes it to ``--out``).

Run: ``python benchmarks/gpu_engine_check.py --config DIR --tokenizer DIR`` (see gpu_check.sh).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ragcache_backend.cache.profile import PrefillProfile
from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.model.loader import LoadedModel
from ragcache_backend.model.runner import kv_bytes_per_token
from ragcache_backend.model.sampling import SamplingParams

WORDS = ("cache prefix tensor block python thread memory lock decorator module import class value "
         "iterator generator exception context manager string bytes list tuple dict set frozen "
         "interpreter compile bytecode garbage collector reference cycle weak slot attribute").split()


def documents(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "." for i in range(n)]


def build(config_dir: str, tokenizer_dir: str, dtype: torch.dtype, device: str) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return LoadedModel(model=model, tokenizer=tok, name="SmolLM2-135M-shape (random weights)",
                       fingerprint=f"smollm2-shape-seed0-{dtype}", dtype=dtype, device=torch.device(device),
                       context_window=int(cfg.max_position_embeddings))


def ttft(engine: RAGCacheEngine, question: str, docs: list[str], *, use_cache: bool) -> float:
    """Seconds to the first token (the engine reads the sampled token back, which waits for the GPU)."""
    return engine.generate(question, docs, SamplingParams(max_tokens=1), use_cache=use_cache).ttft_s


def exactness(loaded: LoadedModel, docs: list[str], requests: int, disk: Path) -> dict:
    """Answers with the cache against answers without it, hits counted per tier."""
    block = kv_bytes_per_token(loaded) * 16
    cfg = EngineConfig(device_budget_bytes=block * 160, host_budget_bytes=block * 240, disk_dir=disk,
                       disk_budget_bytes=1 << 30, policy="pgdsf", max_batch_size=4)
    profile = PrefillProfile(alphas=(0, 512, 1536), betas=(32, 256, 1024),
                             times=((0.01, 0.02, 0.05), (0.012, 0.025, 0.06), (0.015, 0.03, 0.08)))
    rng = random.Random(1)
    out = {"requests": requests, "same_tokens": 0, "max_logit_diff": 0.0, "cached_tokens": 0,
           "prompt_tokens": 0, "device_hits": 0, "host_hits": 0, "disk_hits": 0}
    greedy = SamplingParams(max_tokens=8)
    first: list[str] = []
    with RAGCacheEngine(cfg, loaded=loaded, profile=profile) as eng:
        for i in range(requests):
            picked = rng.sample(docs, 3)
            first = first or picked
            q = f"Question {i % 7}: which document mentions {rng.choice(WORDS)}?"
            on = eng.generate(q, picked, greedy)
            off = eng.generate(q, picked, greedy, use_cache=False)
            out["same_tokens"] += on.token_ids == off.token_ids
            out["cached_tokens"] += on.cached_tokens
            out["prompt_tokens"] += on.prompt_tokens
            out["device_hits"] += on.device_hits
            out["host_hits"] += on.host_hits
            out["disk_hits"] += on.disk_hits
            if i % 5 == 0:
                segs, _ = eng.segments_for(q, picked, greedy)
                a, _ = eng.first_token_logits(segs, use_cache=True)
                b, _ = eng.first_token_logits(segs, use_cache=False)
                out["max_logit_diff"] = max(out["max_logit_diff"], float((a - b).abs().max()))
        eng.cache.check_invariants()
        st = eng.cache.stats
        out["cache"] = {"swap_outs": st.swap_outs, "swap_ins": st.swap_ins, "copy_s": st.copy_s,
                        "device_evictions": st.device_evictions, "host_evictions": st.host_evictions,
                        "disk_queued": st.disk_queued, "disk_hits": st.disk_hits}
    # a restart: a new engine over the same disk folder finds the first request's documents there
    with RAGCacheEngine(cfg, loaded=loaded, profile=profile) as eng:
        on = eng.generate("After a restart: which document is first?", first, greedy)
        off = eng.generate("After a restart: which document is first?", first, greedy, use_cache=False)
        out["restart"] = {"disk_hits": on.disk_hits, "cached_tokens": on.cached_tokens,
                          "prompt_tokens": on.prompt_tokens, "same_tokens": on.token_ids == off.token_ids}
    return out


def timing(loaded: LoadedModel, repeats: int, words: int, profile_dir: Path | None = None) -> dict:
    docs = documents(6, words, seed=7)
    cfg = EngineConfig(device_budget_bytes=1 << 30, host_budget_bytes=1 << 30)
    res: dict = {}
    with RAGCacheEngine(cfg, loaded=loaded) as eng:
        ttft(eng, "warm-up", docs[:3], use_cache=False)
        cold = [ttft(eng, f"Cold question {i}?", docs[:3], use_cache=False) for i in range(repeats)]
        ttft(eng, "Hit question?", docs[:3], use_cache=True)
        hit = [ttft(eng, "Hit question?", docs[:3], use_cache=True) for _ in range(repeats)]
        docs_hit = [ttft(eng, f"New question {i} over cached documents?", docs[:3], use_cache=True)
                    for i in range(repeats)]
        r = eng.generate("Prompt size?", docs[:3], SamplingParams(max_tokens=1), use_cache=False)
        if profile_dir is not None:  # where a request's time goes, cold and with a whole-prompt hit
            step = eng.step  # the loop thread calls engine.step(): profile it there
            for name, use_cache in (("cold", False), ("hit", True)):
                prof = cProfile.Profile()
                eng.step = functools.partial(prof.runcall, step)
                for _ in range(repeats):
                    ttft(eng, "Hit question?", docs[:3], use_cache=use_cache)
                eng.step = step
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                (profile_dir / f"profile_{name}_{loaded.dtype}.txt".replace("torch.", "")).write_text(text.getvalue())
    res.update(prompt_tokens=r.prompt_tokens, cold_ms=1e3 * statistics.median(cold),
               exact_repeat_ms=1e3 * statistics.median(hit), cached_documents_ms=1e3 * statistics.median(docs_hit))
    res["cached_documents_over_cold"] = res["cached_documents_ms"] / res["cold_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="folder with SmolLM2-135M's config.json")
    ap.add_argument("--tokenizer", required=True, help="folder the tokenizer was saved to")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--words", type=int, default=250, help="words per document (~1.3 tokens each)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile-dir", type=Path, default=None, help="write cProfile tables of cold and hit requests here")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script without a GPU")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check runs on a GPU machine (or pass --device cpu)")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none (cpu smoke test)"
    report: dict = {"gpu": gpu, "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    fp32 = build(args.config, args.tokenizer, torch.float32, args.device)
    with tempfile.TemporaryDirectory() as disk:
        report["exactness_fp32"] = exactness(fp32, documents(24, args.words, seed=3), args.requests, Path(disk))
    report["ttft_fp32"] = timing(fp32, args.repeats, args.words, args.profile_dir)
    del fp32
    report["ttft_bf16"] = timing(build(args.config, args.tokenizer, torch.bfloat16, args.device), args.repeats, args.words,
                                 args.profile_dir)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text)
    ex = report["exactness_fp32"]
    if ex["same_tokens"] < ex["requests"] or ex["max_logit_diff"] > 1e-3 or not ex["restart"]["same_tokens"]:
        raise SystemExit("exactness failed: answers or logits with the cache differ from those without it")


if __name__ == "__main__":
    main()
