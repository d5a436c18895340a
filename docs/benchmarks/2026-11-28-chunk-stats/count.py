"""How many statistics calls (and of how many rows) an exact-mode and a chunk-mode miss make, on
chunk_overhead.py's FAQ prompts (scratch script of 2026-11-28; run from the repository root):

    .venv/bin/python docs/benchmarks/2026-11-28-chunk-stats/count.py

Printed that day: exact 0 calls; auto 6 calls (the statistics layers) of every prompt row.
"""
import os, sys, random
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, ".")
import torch
from ragcache_backend.config import EngineConfig
from ragcache_backend.demo.datasets import faq_questions, python_docs_dir
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.model.kernels import chunk_stats
from ragcache_backend.model.loader import load_model
from ragcache_backend.model.sampling import SamplingParams
MiB = 1 << 20
torch.set_num_threads(2)
text = (python_docs_dir() / "faq" / "programming.rst.txt").read_text()
paras = [p for p in text.split("\n\n") if len(p) > 400]
questions = faq_questions()
rng = random.Random(0)
e = RAGCacheEngine(EngineConfig(dtype="bfloat16", threads=2, device_budget_bytes=512 * MiB, host_budget_bytes=1024 * MiB), loaded=load_model(None, dtype="bfloat16"))
one = SamplingParams(max_tokens=1)
calls = []
real = chunk_stats.segment_mass
chunk_stats.segment_mass = lambda *a: calls.append(a[0].shape[0]) or real(*a)
for i in range(3):
    segs, _ = e.segments_for(questions[i], rng.sample(paras, 5), one, question_first=True)
    for m in ("exact", "auto"):
        e.reset_cache(); calls.clear()
        r = e.submit_segments(segs, one, reuse=m).result()
        print(i, m, r.prompt_tokens, "segment_mass calls (rows):", calls)
e.close()
