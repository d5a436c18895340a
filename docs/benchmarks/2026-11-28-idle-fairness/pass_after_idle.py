"""A 1,000-token cold pass of the engine (bf16, 2 threads) warm and right after an idle second, the
time per native call summed (scratch script of 2026-11-28; run from the repository root):
.venv/bin/python docs/benchmarks/2026-11-28-idle-fairness/pass_after_idle.py 1000

Printed that day (ms, means of 6; Linear: qkv, o, down and the LM head; Linear.silu: gate/up):
warm {'embed': 1.5, 'add_rms_norm': 14.8, 'Linear': 86.6, 'rope_write': 6.7, 'paged_attention': 58.6, 'Linear.silu': 79.4, 'run': 249.4, 'logits': 6.6, 'forward': 260.0, 'PASS': 260.8}
idle {'embed': 3.7, 'add_rms_norm': 19.6, 'Linear': 117.4, 'rope_write': 10.5, 'paged_attention': 58.3, 'Linear.silu': 104.2, 'run': 314.6, 'logits': 11.0, 'forward': 351.8, 'PASS': 358.9}
The GEMMs (reading the weights) take the extra time; the attention (reading what the pass wrote) none.
"""
import random, sys, time, collections
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from forward_vs_vllm import MODEL_DIR, MiB, Ours
from ragcache_backend import EngineConfig, RAGCacheEngine
from ragcache_backend.model.kernels import native
from ragcache_backend.model.kernels.linear import Linear
import ragcache_backend.model.llama as llama
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
engine = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype="bfloat16", threads=int(__import__("os").environ.get("NT","2")), device_budget_bytes=1024 * MiB, host_budget_bytes=0))
ours, rng = Ours(engine), random.Random(0)
spent = collections.Counter(); calls = collections.Counter()
def wrap(obj, name, tag=None):
    f = getattr(obj, name); tag = tag or name
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: spent[tag] += time.perf_counter() - t; calls[tag] += 1
    setattr(obj, name, w)
for n in ["add_rms_norm", "rope_write", "paged_attention", "attention_batch"]:
    wrap(native, n)
wrap(Linear, "__call__", "Linear")
from ragcache_backend.model.runner import ModelRunner
wrap(llama.PagedLlama, "embed", "embed"); wrap(llama.PagedLlama, "run", "run"); wrap(llama.PagedLlama, "logits", "logits"); wrap(ModelRunner, "forward", "forward")
wrap(Linear, "silu_gated", "Linear.silu")
agg = {"warm": collections.Counter(), "idle": collections.Counter()}
for r in range(7):
    for kind in ("warm", "idle"):
        ids = [rng.randrange(100, 40000) for _ in range(N)]
        if kind == "idle": time.sleep(1.0)
        spent.clear(); calls.clear()
        t = time.perf_counter(); ours.cold({"ids": ids}); spent["PASS"] = time.perf_counter() - t
        if r: agg[kind].update(spent)
for kind, c in agg.items():
    print(kind, {k: round(1e3 * v / 6, 1) for k, v in c.items()})
engine.close()
