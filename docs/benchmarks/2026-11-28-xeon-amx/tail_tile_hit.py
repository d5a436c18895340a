import os, sys, time, random
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, "benchmarks")
import forward_vs_vllm as F
from ragcache_backend import EngineConfig, RAGCacheEngine
from ragcache_backend.model.kernels import linear as L
engine = RAGCacheEngine(EngineConfig(model=str(F.MODEL_DIR), dtype="bfloat16", threads=2, device_budget_bytes=1024*F.MiB, host_budget_bytes=0))
ours, rng = F.Ours(engine), random.Random(0)
for tile in (128, 64, 32, 128, 64, 32):
    L.ROW_TILE = tile
    ts = []
    for _ in range(5):
        ts.append(ours.extend({"prefix": [rng.randrange(100, 40000) for _ in range(500)], "new": [rng.randrange(100, 40000) for _ in range(20)]}))
    print(tile, "20 over 500: %.1f ms" % (sorted(ts)[2] * 1e3))
