"""A step of [one-row hit, 500-row chunk over 300 cached, 6 decodes] with the hit first vs after the chunk
(the same inputs, same engine, alternating; medians of 9)."""
import random, statistics, sys, time
sys.path.insert(0, "benchmarks")  # run from the repository root: .venv/bin/python docs/benchmarks/.../this.py [rounds]
import torch
from forward_vs_vllm import Ours
from ragcache_backend import EngineConfig, RAGCacheEngine
from ragcache_backend.model.forward import ForwardInput, KVRun
torch.set_num_threads(2)
engine = RAGCacheEngine(EngineConfig(dtype="float32"))
ours, r = Ours(engine), engine.runner
rng = random.Random(0); V = r.layers.vocab_size
ids = lambda n: tuple(rng.randrange(V) for _ in range(n))
with ours.blocks(301, 800, *([801] * 6)) as blocks:
    hb, cb, db = blocks[0], blocks[1], blocks[2:]
    r.forward([ForwardInput(ids(300), (), (KVRun(hb, 0, 300),))])
    r.forward([ForwardInput(ids(300), (), (KVRun(cb, 0, 300),))])
    for b in db:
        r.forward([ForwardInput(ids(800), (), (KVRun(b, 0, 800),))])
    hit = ForwardInput(ids(1), (KVRun(hb, 0, 300),), (KVRun(hb, 300, 1),))
    chunk = ForwardInput(ids(500), (KVRun(cb, 0, 300),), (KVRun(cb, 300, 500),))
    decs = [ForwardInput(ids(1), (KVRun(b, 0, 800),), (KVRun(b, 800, 1),), decode=True) for b in db]
    t = {"hit first": [], "hit after": []}
    for k in range(int(sys.argv[1]) if len(sys.argv) > 1 else 10):
        for name, batch in (("hit first", [hit, chunk] + decs), ("hit after", [chunk, hit] + decs))[:: 1 if k % 2 else -1]:
            t0 = time.perf_counter(); r.forward_step(batch); dt = time.perf_counter() - t0
            if k: t[name].append(dt * 1000)
    a, b = statistics.median(t["hit first"]), statistics.median(t["hit after"])
    print(f"hit first {a:.1f} ms, hit after {b:.1f} ms: {b/a:.3f}x")
