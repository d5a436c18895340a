"""chunk_serve_vllm.py's trace (same seed, warm-up and engine settings) on the chunk engine alone, each
measured request run twice with ``store=False`` (the cache state untouched), once on the package's
kernels and once on another csrc/ folder's, the order alternating, IDLE seconds before each run
(scratch script of 2026-11-28; run from the repository root):

    git archive 3cdf1e1 ragcache_backend/model/kernels/csrc | tar -x -C /tmp/prev
    .venv/bin/python docs/benchmarks/2026-11-28-chunk-stats/ab_trace.py /tmp/prev/ragcache_backend/model/kernels/csrc [IDLE]
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import torch  # noqa: E402
from chunk_eval import trace  # noqa: E402

from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.kernels import library  # noqa: E402
from ragcache_backend.model.loader import load_model  # noqa: E402
from ragcache_backend.model.sampling import SamplingParams  # noqa: E402

MiB = 1 << 20
torch.set_num_threads(2)
old = library.build_library(Path(sys.argv[1]))
idle = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
args = argparse.Namespace(requests=24, warmup=60, calibrate=8, k_min=5, k_max=8, mmlu=200, zipf=1.0, question_first=True,
                          library=True, seed=0, alpha=1.0, guard=None, threads=2, dtype="bfloat16", device_mib=2048, host_mib=4096)
_s, _w, items = trace(args)
cfg = EngineConfig(reuse="auto", chunk_alpha=1.0, dtype="bfloat16", threads=2, device_budget_bytes=2048 * MiB,
                   host_budget_bytes=4096 * MiB, max_batch_size=16, max_batch_tokens=32768, host_commit="background")
engine = RAGCacheEngine(cfg, loaded=load_model(None, dtype="bfloat16"))
rule = cfg.recompute_rule()
one = SamplingParams(max_tokens=1)
segs = [engine.segments_for(q, docs, one, question_first=True)[0] for q, _src, docs in items]
for ss in segs[:60]:
    engine.submit_segments(ss, one, recompute=rule).result()
rows = []
for n in range(24):
    t = {}
    for k in (("old", "new") if n % 2 else ("new", "old")):
        time.sleep(idle)
        if k == "old":
            with library.using_library(old):
                r = engine.submit_segments(segs[60 + n], one, recompute=rule, store=False).result()
        else:
            r = engine.submit_segments(segs[60 + n], one, recompute=rule, store=False).result()
        t[k] = r.ttft_s
    engine.submit_segments(segs[60 + n], one, recompute=rule).result()  # then stored, as the trace does
    rows.append((t["old"], t["new"], r.chunk_hits))
    print(f"{n + 1}: {r.prompt_tokens} tok, {r.chunk_hits} chunk hits, {r.computed_tokens} computed: "
          f"old {t['old']:.3f} s, new {t['new']:.3f} s ({t['new'] / t['old']:.2f}x)", flush=True)
engine.close()
held = rows[8:]
o, w = statistics.mean(r[0] for r in held), statistics.mean(r[1] for r in held)
print(f"held-out 16: old {o:.3f} s, new {w:.3f} s ({w / o:.2f}x)")
