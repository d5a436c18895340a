"""Time llama.cpp on one prompt of a peer job with 1 and 2 threads (shows its OpenMP slowdown when
another process shares the cores). Usage: benchmarks/.venv-llamacpp/bin/python benchmarks/llamacpp_threads_check.py
OUT/peer-llamacpp-in.json (written by `ragcache bench --peers llamacpp`)."""
import json, sys, time
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
ids = job["prompts"][0]
for threads in (1, 2):
    llm = Llama(model_path=job["gguf"], n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512, seed=0, verbose=False)
    for rep in range(2):
        llm.reset()
        t0 = time.perf_counter(); first = None
        for _ in llm.create_completion(prompt=list(ids), max_tokens=4, temperature=0.0, top_k=1, stream=True):
            first = first or time.perf_counter()
        print(f"threads={threads} rep={rep} prompt={len(ids)} ttft={first - t0:.2f}s total={time.perf_counter() - t0:.2f}s", flush=True)
    del llm
