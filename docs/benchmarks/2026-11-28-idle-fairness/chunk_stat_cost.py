"""What the chunk mode's statistics add to a 1,800-token bf16 prefill (scratch script of 2026-11-28;
run from the repository root): a plain forward, with ``stat_segments`` (6 sampled layers, as the
engine's default ``chunk_stat_layers``), and with ``guard_segments`` too (the last row's mass, every
layer). Printed that day (medians of 5): plain 538.6 ms, stat 578.5 ms, stat + guard_segments 609.8 ms.
"""
import sys, time, random, statistics, torch
sys.path.insert(0, ".")
from ragcache_backend.model.loader import load_model
from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner
torch.set_num_threads(2)
loaded = load_model(None, dtype="bfloat16")
r = ModelRunner(loaded, num_device_blocks=400, block_size=16)
r.sample_stat_layers(6)
rng = random.Random(0)
N = 1800
segs = (29, 18, 250, 300, 280, 310, 290, 323)
assert sum(segs) == N
res = {k: [] for k in ("plain", "stat", "stat+guard_segments")}
for rnd in range(6):
    for k in res:
        ids = tuple(rng.randrange(100, 40000) for _ in range(N))
        kw = {} if k == "plain" else {"stat_segments": segs} if k == "stat" else {"stat_segments": segs, "guard_segments": segs}
        item = ForwardInput(ids, (), (KVRun(tuple(range(0, 113)), 0, N),), **kw)
        t = time.perf_counter(); r.forward_step([item]); dt = time.perf_counter() - t
        if rnd: res[k].append(dt)
for k, v in res.items(): print(k, f"{1e3*statistics.median(v):.1f} ms")
