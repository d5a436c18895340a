"""A chunk request's TTFT by phase (chunk_serve_vllm.py's trace, the chunk engine alone, bf16, an idle
second before each request), with the whole arena committed at construction (argument "1": the
shared pool's host part too) or the host part left to be committed as it fills (no argument).
Scratch script of 2026-11-28, run from the repository root, one run each, one after the other:
    commit: engine built in 9.7 s, mean TTFT 0.478 s over the 24 measured requests
    lazy:   engine built in 2.2 s, mean TTFT 0.557 s
(the 7.5 s: this VM's first touch of fresh guest memory, ~0.8 GB/s; first_touch.py). What ships is
neither: host_commit="background" commits the host part from a thread at nice 19 after start.
"""
import runpy
import sys
import time

sys.path.insert(0, ".")
import ragcache_backend.engine.engine as engine_module  # noqa: E402
import ragcache_backend.engine.setup as setup  # noqa: E402

if len(sys.argv) > 1:
    class _CommittedRunner(setup.ModelRunner):
        def __init__(self, *args, **kwargs):
            kwargs["committed_blocks"] = None  # the whole arena zeroed at construction
            super().__init__(*args, **kwargs)

    setup.ModelRunner = _CommittedRunner


class _TimedEngine(engine_module.RAGCacheEngine):
    def __init__(self, *args, **kwargs):
        t0 = time.perf_counter()
        super().__init__(*args, **kwargs)
        print("engine built", round(time.perf_counter() - t0, 2), "s", flush=True)


engine_module.RAGCacheEngine = _TimedEngine
sys.argv = sys.argv[:1]
runpy.run_path("docs/benchmarks/2026-11-28-idle-fairness/chunk_request_phases.py", run_name="__main__")
