"""Drive one peer system over the benchmark trace; runs inside the peer's OWN venv.

    <venv>/bin/python benchmarks/peer_runner.py JOB.json OUT.json

JOB (written by ``ragcache_backend.bench.bench.run_peer``): ``peer`` ("vllm" or "llamacpp"),
``model_dir`` (bf16 HF folder), ``gguf`` (the same weights as a bf16 GGUF), ``prompts`` (token
ids, identical to what our engine computes), ``arrivals`` ({rate: [seconds]}), ``max_tokens``,
``threads``, ``kv_bytes`` (the KV budget given to the peer), ``warmup`` (token ids served one at a
time, untimed, after each cache reset and before the timed requests). Greedy decoding, open-loop arrivals,
TTFT from a request's arrival to its first generated token. The cache is emptied between rates.
Imports nothing from ragcache (it is not installed in the peer venvs).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time


def run_vllm(job: dict) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    import vllm

    t_start = time.perf_counter()
    args = AsyncEngineArgs(
        model=job["model_dir"], dtype="bfloat16", enable_prefix_caching=True,
        kv_cache_memory_bytes=int(job["kv_bytes"]), max_model_len=4096, seed=0,
        max_num_seqs=int(job.get("max_num_seqs", 4)), max_num_batched_tokens=int(job.get("max_batch_tokens", 4096)),
        block_size=32,  # the CPU backend warns that other sizes are not optimised
    )
    engine = AsyncLLM.from_engine_args(args)
    startup = time.perf_counter() - t_start
    sp = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=0.0)
    runs = {}

    async def one(rate: str, i: int, ids: list[int], t_arr: float) -> dict:
        await asyncio.sleep(max(0.0, t_arr - time.perf_counter()))
        first, last = None, None
        try:
            async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=f"r{rate}-{i}"):
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter()
                last = out
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        done = time.perf_counter()
        return {"ttft_s": (first or done) - t_arr, "total_s": done - t_arr, "prompt_tokens": len(ids),
                "cached_tokens": int(getattr(last, "num_cached_tokens", 0) or 0),
                "output_tokens": len(last.outputs[0].token_ids) if last else 0, "finished_at": done}

    async def main() -> None:
        # warm-up, then an empty prefix cache for each rate
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=job["prompts"][0]), SamplingParams(max_tokens=2), request_id="warm"):
            pass
        for rate, arrivals in job["arrivals"].items():
            await engine.reset_prefix_cache()
            for j, ids in enumerate(job.get("warmup", [])):  # untimed, one at a time (steady state)
                async for _ in engine.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1, temperature=0.0),
                                               request_id=f"w{rate}-{j}"):
                    pass
            t0 = time.perf_counter()
            recs = await asyncio.gather(*(one(rate, i, ids, t0 + a) for i, (ids, a) in enumerate(zip(job["prompts"], arrivals))))
            end = max((r.get("finished_at", t0) for r in recs), default=t0)
            runs[rate] = {"records": recs, "makespan_s": end - t0}
            print(f"vllm rate {rate}: done in {end - t0:.1f} s", flush=True)

    asyncio.run(main())
    engine.shutdown()
    return {"runs": runs, "info": {"version": vllm.__version__, "startup_s": startup,
                                   "kv_cache_memory_bytes": int(job["kv_bytes"]), "prefix_caching": True,
                                   "max_num_seqs": int(job.get("max_num_seqs", 4))}}


def run_llamacpp(job: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama, LlamaRAMCache

    threads = int(job["threads"])
    t_start = time.perf_counter()
    llm = Llama(model_path=job["gguf"], n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512,
                seed=0, verbose=False)
    startup = time.perf_counter() - t_start
    runs = {}
    for rate, arrivals in job["arrivals"].items():
        llm.set_cache(LlamaRAMCache(capacity_bytes=int(job["kv_bytes"])))
        llm.reset()
        if rate == next(iter(job["arrivals"])):  # warm-up once
            for _ in llm.create_completion(prompt=job["prompts"][0], max_tokens=2, temperature=0.0, stream=True):
                pass
            llm.set_cache(LlamaRAMCache(capacity_bytes=int(job["kv_bytes"])))
            llm.reset()
        for ids in job.get("warmup", []):  # untimed, one at a time (steady state)
            for _ in llm.create_completion(prompt=list(ids), max_tokens=1, temperature=0.0, top_k=1, stream=True):
                pass
        recs = []
        t0 = time.perf_counter()
        for ids, a in zip(job["prompts"], arrivals):  # one request at a time, FIFO (llama.cpp's Python server)
            t_arr = t0 + a
            delay = t_arr - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            first = None
            n_out = 0
            try:
                for chunk in llm.create_completion(prompt=list(ids), max_tokens=int(job["max_tokens"]),
                                                   temperature=0.0, top_k=1, stream=True):
                    if first is None:
                        first = time.perf_counter()
                    n_out += 1
            except Exception as exc:
                recs.append({"error": f"{type(exc).__name__}: {exc}"})
                continue
            done = time.perf_counter()
            recs.append({"ttft_s": (first or done) - t_arr, "total_s": done - t_arr, "prompt_tokens": len(ids),
                         "output_tokens": n_out, "finished_at": done})
        end = max((r.get("finished_at", t0) for r in recs), default=t0)
        runs[rate] = {"records": recs, "makespan_s": end - t0}
        print(f"llama.cpp rate {rate}: done in {end - t0:.1f} s", flush=True)
    return {"runs": runs, "info": {"version": llama_cpp.__version__, "startup_s": startup, "n_ctx": 4096,
                                   "ram_cache_bytes": int(job["kv_bytes"]), "concurrency": 1}}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = run_vllm(job) if job["peer"] == "vllm" else run_llamacpp(job)
    with open(sys.argv[2], "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
