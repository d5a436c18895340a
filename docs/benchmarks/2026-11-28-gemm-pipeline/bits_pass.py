"""Logits of cold and cached passes (every row), the package's kernels against another csrc/ folder:
identical? (scratch script of 2026-11-28, run from the repository root:
    git archive <rev> ragcache_backend/model/kernels/csrc | tar -x -C /tmp/old
    .venv/bin/python docs/benchmarks/2026-11-28-gemm-pipeline/bits_pass.py /tmp/old/ragcache_backend/model/kernels/csrc
Printed that day for the GEMM pipeline (d13d5e9) against d13d5e9~1, and for the pipelined AMX attention
tried then (not kept) against d13d5e9: "same" for all five cases, "bad 0".)"""
import random, sys, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from pathlib import Path
from forward_vs_vllm import MODEL_DIR
from ragcache_backend import EngineConfig, RAGCacheEngine
from ragcache_backend.cache.blocks import KVRun
from ragcache_backend.model.forward import ForwardInput
from ragcache_backend.model.kernels import library
torch.set_num_threads(2)
lib = library.build_library(Path(sys.argv[1]))
eng = RAGCacheEngine(EngineConfig(model=str(MODEL_DIR), dtype="bfloat16", threads=2, device_budget_bytes=1024 * 2**20, host_budget_bytes=0))
rng = random.Random(1); bad = 0
for n, cached in ((1000, 0), (77, 0), (300, 700), (33, 1024), (1500, 0)):
    ids = [rng.randrange(100, 40000) for _ in range(n + cached)]
    outs = []
    for use in (None, lib):
        b = tuple(eng.cache.allocate(-(-(n + cached) // eng.runner.block_size)))
        try:
            ctx = library.using_library(use) if use else __import__("contextlib").nullcontext()
            with ctx:
                if cached:
                    eng.runner.forward([ForwardInput(tuple(ids[:cached]), (), (KVRun(b, 0, cached),))])
                lg = eng.runner.forward([ForwardInput(tuple(ids[cached:]), (KVRun(b, 0, cached),) if cached else (), (KVRun(b, cached, n),))], all_logits=True)[0]
        finally:
            eng.cache.free(b)
        outs.append(lg)
    same = torch.equal(outs[0], outs[1])
    bad += not same
    print(n, cached, "same" if same else f"DIFF max {float((outs[0]-outs[1]).abs().max()):.3g}")
print("bad", bad)
