import sys, random, statistics, torch
from pathlib import Path
sys.path.insert(0, "benchmarks")
import forward_vs_vllm as f
from ragcache_backend import EngineConfig, RAGCacheEngine
from ragcache_backend.model.kernels import native
dtype = sys.argv.pop(1) if sys.argv[1] in ("float32", "bfloat16") else "bfloat16"
eng = RAGCacheEngine(EngineConfig(model=str(f.MODEL_DIR), dtype=dtype, threads=2, device_budget_bytes=2048 * 2**20, host_budget_bytes=0))
ours = f.Ours(eng)
libs = {"A": native._library()}
names = ("paged_attention_bf16.c", "fused_bf16.c", "decode_bf16.c", "kernels_f32.c")
for v in sys.argv[1:]:
    native.SOURCES = tuple(Path(f"/tmp/kvar/{v}") / n for n in names)
    native.HEADERS = tuple(Path(f"/tmp/kvar/{v}") / n for n in ("simd_exp.h", "bf16_common.h"))
    libs[v] = native._build()
rng = random.Random(0)
ids = lambda n: [rng.randrange(100, 40000) for _ in range(n)]
res = {}
for rnd in range(5):
    order = list(libs) if rnd % 2 else list(reversed(libs))
    for b in (1, 4, 8, 16):
        prompts = [ids(1024) for _ in range(b)]
        for v in order:
            native._lib = libs[v]
            t = ours.decode({"prompts": prompts, "steps": 16})
            if rnd: res.setdefault((v, b), []).append(t)
for b in (1, 4, 8, 16):
    base = statistics.median(res[("A", b)])
    print(f"b{b}: " + ", ".join(f"{v} {1e3*statistics.median(res[(v, b)]):.1f} ms ({statistics.median(res[(v, b)])/base:.2f}x)" for v in libs))
