"""vLLM side of ``benchmarks/forward_vs_vllm.py``; runs inside vLLM's OWN venv (imports nothing from ragcache).

    benchmarks/.venv-vllm/bin/python benchmarks/vllm_forward_worker.py JOB.json

JOB: ``model_dir`` (bf16 HF folder), ``kv_bytes``, ``block_size``, ``max_num_seqs``, optional ``dtype``
(default ``bfloat16``). One offline ``vllm.LLM`` (prefix caching on) serves every measurement. Commands arrive as JSON lines on
stdin; each answer is one JSON line on the ORIGINAL stdout (everything else that writes to fd 1,
vLLM's logs included, is sent to stderr). Every command is timed on the wall clock around
``LLM.generate`` and, where vLLM records them, with its engine-core timestamps (``metrics``):
prefill = ``first_token_ts - scheduled_ts``, decode = ``(last_token_ts - first_token_ts) / steps``.

* ``{"op": "cold", "ids": [...]}``: a fresh prompt (no prefix hit), ``max_tokens=1``.
* ``{"op": "extend", "prefix": [...], "new": [...]}``: ``prefix`` served once (untimed, fills the
  prefix cache), then ``prefix + new`` timed with ``max_tokens=1``.
* ``{"op": "decode", "prompts": [[...], ...], "steps": N}``: the prompts are served once (untimed,
  cached), then timed together with ``max_tokens=1`` and with ``max_tokens=N+1`` (``ignore_eos``);
  step = difference / N.
* ``{"op": "trace", "prompts": [[...], ...]}``: the prompts served one at a time in order, each
  with ``max_tokens=1`` and timed (prefix caching on, so later prompts reuse earlier ones' blocks);
  per prompt: wall time and cached tokens.
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

RESULTS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # stray prints (and child processes) go to the log, not the result channel
sys.stdout = sys.stderr


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["model_dir"], dtype=job.get("dtype", "bfloat16"), enable_prefix_caching=True, seed=0,
              kv_cache_memory_bytes=int(job["kv_bytes"]), max_model_len=4096, block_size=int(job["block_size"]),
              max_num_seqs=int(job["max_num_seqs"]), max_num_batched_tokens=4096, disable_log_stats=False)
    info = {"vllm": vllm.__version__, "torch": torch.__version__, "startup_s": time.perf_counter() - t0,
            "torch_threads": torch.get_num_threads(), "kv_cache_memory_bytes": int(job["kv_bytes"]),
            "block_size": int(job["block_size"]), "prefix_caching": True, "dtype": job.get("dtype", "bfloat16"),
            "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                                                   "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")}}

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        reqs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        t = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        return time.perf_counter() - t, outs

    def core(outs: list, steps: int = 0) -> dict:
        m = [o.metrics for o in outs]
        res = {"cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
               "output_tokens": [len(o.outputs[0].token_ids) for o in outs]}
        if all(x is not None and x.first_token_ts for x in m):
            res["core_prefill_s"] = max(x.first_token_ts for x in m) - min(x.scheduled_ts for x in m)
            if steps:
                res["core_step_s"] = (max(x.last_token_ts for x in m) - max(x.first_token_ts for x in m)) / steps
        return res

    run([[1, 2, 3, 4]], 2)  # warm-up
    answer({"ready": True, "info": info})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "cold":
                if cmd.get("warm_ids"):  # untimed, as the other ops' first passes
                    run([cmd["warm_ids"]], 1)
                wall, outs = run([cmd["ids"]], 1)
                answer({"wall_s": wall, "first_token": outs[0].outputs[0].token_ids[0], **core(outs)})
            elif cmd["op"] == "extend":
                run([cmd["prefix"]], 1)
                wall, outs = run([cmd["prefix"] + cmd["new"]], 1)
                answer({"wall_s": wall, **core(outs)})
            elif cmd["op"] == "decode":
                n = int(cmd["steps"])
                run(cmd["prompts"], 1)
                w1, o1 = run(cmd["prompts"], 1)
                wn, on = run(cmd["prompts"], n + 1)
                answer({"wall_s": (wn - w1) / n, "wall_1_s": w1, "wall_n_s": wn, **core(on, n),
                        "first": core(o1)})
            elif cmd["op"] == "trace":
                walls, cached = [], []
                for ids in cmd["prompts"]:
                    wall, outs = run([ids], 1)
                    walls.append(wall)
                    cached.append(int(outs[0].num_cached_tokens or 0))
                answer({"wall_s": walls, "cached_tokens": cached})
            else:
                answer({"error": f"unknown op {cmd['op']!r}"})
        except Exception as exc:  # report and go on
            answer({"error": f"{type(exc).__name__}: {exc}"})
    del llm


def answer(obj: dict) -> None:
    RESULTS.write(json.dumps(obj) + "\n")
    RESULTS.flush()


if __name__ == "__main__":
    main()
