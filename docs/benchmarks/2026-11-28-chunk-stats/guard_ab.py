import os, sys, random, time, statistics
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, ".")
import torch
from ragcache_backend.config import EngineConfig
from ragcache_backend.demo.datasets import faq_questions, python_docs_dir
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.model.loader import load_model
from ragcache_backend.model.sampling import SamplingParams
MiB = 1 << 20
torch.set_num_threads(2)
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
text = (python_docs_dir() / "faq" / "programming.rst.txt").read_text()
paras = [p for p in text.split("\n\n") if len(p) > 400]
questions = faq_questions()
loaded = load_model(None, dtype=dtype)
import dataclasses
e = RAGCacheEngine(EngineConfig(dtype=dtype, threads=2, device_budget_bytes=512 * MiB, host_budget_bytes=1024 * MiB), loaded=loaded)
base = e.config.recompute_rule()
print(base)
rules = {"guard": base, "noguard": dataclasses.replace(base, guard=None)}
one = SamplingParams(max_tokens=1)
res = {k: [] for k in rules}; ex = []
for i in range(8):
    rng = random.Random(i)
    docs = rng.sample(paras, 5)
    sh = docs[:]; rng.shuffle(sh)
    e.reset_cache()
    first, _ = e.segments_for(questions[40 + 2 * i], docs, one, question_first=True)
    e.submit_segments(first, one, reuse="auto").result()
    segs, _ = e.segments_for(questions[41 + 2 * i], sh, one, question_first=True)
    t = {k: [] for k in rules}
    for rep in range(4):
        for k, rule in (list(rules.items()) if rep % 2 else list(rules.items())[::-1]):
            r = e.submit_segments(segs, one, reuse="auto", store=False, recompute=rule).result()
            t[k].append(r.ttft_s); info = (r.computed_tokens, r.recomputed_tokens, r.chunk_hits, r.prompt_tokens)
    for k in t: res[k].append(statistics.median(t[k]))
    print(i, info, {k: round(statistics.median(v) * 1e3, 1) for k, v in t.items()}, flush=True)
print({k: round(statistics.mean(v) * 1e3, 1) for k, v in res.items()})
