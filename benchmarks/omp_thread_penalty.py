"""What a decode step costs on the engine's own thread once another thread owns an OpenMP team.

The engine runs its forward steps on its step-loop thread. libgomp gives every thread that starts
a parallel region its own pool of workers, and when the threads it manages outnumber the CPUs it
stops spinning between regions (100 spins instead of ~3 ms: ``gomp_throttled_spin_count_var``), so
each region then waits for a worker to wake. A process whose main thread also ran torch (loading
the model, embedding queries: the demo and the LangChain/LlamaIndex adapters) is in that state on a
2-core machine; a decode step run per operation has ~270 regions (oneDNN GEMMs and our row-wise
kernels, per layer), a whole-step one a single region (``rc32_decode_step``, and in bf16
``rc_decode_step`` since 2026-11-27 evening) whose ~270 barriers wait the same way: the bf16
whole step took 2.25x as long there (5.23 ms alone, 11.81 ms; 5.20 once released).

Measured here, the same decode steps (``forward_vs_vllm.py``'s kernel-level ``Ours.decode``: one
sequence, 500 cached tokens, 32 steps), interleaved: on the main thread; on another thread while
no other thread owns an OpenMP team (the model loaded on a thread that exited); on another thread
after the main thread ran one matmul; the same after the main thread's pool was released
(``openmp.release_thread_pool``, as the engine and the embedder now do). Prints each and the ratios.

Usage: ``.venv/bin/python benchmarks/omp_thread_penalty.py [--dtype auto|float32|bfloat16] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from forward_vs_vllm import Ours, machine  # noqa: E402
from ragcache_backend.config import EngineConfig  # noqa: E402
from ragcache_backend.engine.engine import RAGCacheEngine  # noqa: E402
from ragcache_backend.model.kernels import openmp  # noqa: E402


def on_thread(fn):
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = on_thread(lambda: RAGCacheEngine(EngineConfig(dtype=args.dtype, threads=args.threads)))
    ours = Ours(engine)
    cmd = {"prompts": [list(range(1000, 1500))], "steps": 32}
    ms = lambda: ours.decode(cmd) * 1e3  # noqa: E731
    on_thread(ms)  # warm-up, off the main thread (which must not own an OpenMP team yet)
    alone = [on_thread(ms) for _ in range(args.rounds)]  # no other thread owns an OpenMP team yet
    torch.ones(512, 512) @ torch.ones(512, 512)  # now the main thread does
    main_thread, other, released = [], [], []
    for _ in range(args.rounds):
        main_thread.append(ms())
        other.append(on_thread(ms))
        openmp.release_thread_pool()  # what the engine and the embedder do on the threads they run on
        released.append(on_thread(ms))
    med = statistics.median
    m = machine()
    print(f"{m['cpu']} ({m['isa']}), {m['nproc']} CPUs, {m['date']}, {m['load_start']}; {engine.dtype}, "
          f"{args.threads} threads; one decode step, ms, median of {args.rounds}")
    print(f"  another thread, no other OpenMP team : {med(alone):6.2f}")
    print(f"  the main thread (its own team)       : {med(main_thread):6.2f}")
    print(f"  another thread, the main one has a team: {med(other):6.2f}  "
          f"({med(other) / med(main_thread):.2f}x the main thread's)")
    print(f"  another thread, the main one's team released: {med(released):6.2f}  "
          f"({med(released) / med(main_thread):.2f}x)")
    engine.close()


if __name__ == "__main__":
    main()
