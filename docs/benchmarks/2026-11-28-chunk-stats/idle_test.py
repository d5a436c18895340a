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
text = (python_docs_dir() / "faq" / "programming.rst.txt").read_text()
paras = [p for p in text.split("\n\n") if len(p) > 400]
questions = faq_questions()
rng = random.Random(5)
e = RAGCacheEngine(EngineConfig(dtype="bfloat16", threads=2, device_budget_bytes=512 * MiB, host_budget_bytes=1024 * MiB), loaded=load_model(None, dtype="bfloat16"))
one = SamplingParams(max_tokens=1)
docs = rng.sample(paras, 5)
first, _ = e.segments_for(questions[50], docs, one, question_first=True)
e.submit_segments(first, one, reuse="auto").result()
sh = docs[:]; rng.shuffle(sh)
segs, _ = e.segments_for(questions[51], sh, one, question_first=True)
res = {}
for sleep in (0.0, 0.3, 1.0, 2.0, 0.0, 1.0):
    ts = []
    for rep in range(5):
        time.sleep(sleep)
        r = e.submit_segments(segs, one, reuse="auto", store=False).result()
        ts.append(r.ttft_s)
    print(f"sleep {sleep}: median {statistics.median(ts)*1e3:.0f} ms  {[round(t*1e3) for t in ts]}  computed {r.computed_tokens}", flush=True)
