"""Mixed steps, the layer GEMMs' new route (Linear._decode_apart: one pass / one oneDNN call over every
row) against the old one (prompt rows and generated tokens' rows apart, then joined), alternating in one
process on the default model, float32; medians of N rounds."""
import random, statistics, sys, time
sys.path.insert(0, "benchmarks")  # run from the repository root: .venv/bin/python docs/benchmarks/.../this.py [rounds]
import torch
from forward_vs_vllm import Ours
from ragcache_backend import EngineConfig, RAGCacheEngine
from ragcache_backend.model.forward import ForwardInput, KVRun
from ragcache_backend.model.kernels import linear as L
torch.set_num_threads(2)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
new = L.Linear._decode_apart
def old(self, x, classes):
    return self._split_by_class(x, classes, self._prompt_parts, self._native)
engine = RAGCacheEngine(EngineConfig(dtype="float32"))
ours, r = Ours(engine), engine.runner
rng = random.Random(0); V = r.layers.vocab_size
ids = lambda n: tuple(rng.randrange(V) for _ in range(n))
cases = {"30 over 1,024 + 7 decodes": (30, 7), "60 over 1,024 + 7 decodes": (60, 7), "1,000 over 1,024 + 2 decodes": (1000, 2), "2,000 over 1,024 + 2 decodes": (2000, 2)}
for name, (n, d) in cases.items():
    with ours.blocks(1024 + n, *([1025] * d)) as blocks:
        cb, db = blocks[0], blocks[1:]
        r.forward([ForwardInput(ids(1024), (), (KVRun(cb, 0, 1024),))])
        for b in db:
            r.forward([ForwardInput(ids(1024), (), (KVRun(b, 0, 1024),))])
        batch = [ForwardInput(ids(n), (KVRun(cb, 0, 1024),), (KVRun(cb, 1024, n),))]
        batch += [ForwardInput(ids(1), (KVRun(b, 0, 1024),), (KVRun(b, 1024, 1),), decode=True) for b in db]
        t = {"old": [], "new": []}
        for k in range(rounds + 1):
            for which, fn in (("old", old), ("new", new))[:: 1 if k % 2 else -1]:
                L.Linear._decode_apart = fn
                t0 = time.perf_counter(); r.forward_step(batch); dt = time.perf_counter() - t0
                if k: t[which].append(dt * 1000)
        a, b = statistics.median(t["old"]), statistics.median(t["new"])
        print(f"{name}: old {a:.1f} ms, new {b:.1f} ms: {b/a:.3f}x", flush=True)
L.Linear._decode_apart = new
