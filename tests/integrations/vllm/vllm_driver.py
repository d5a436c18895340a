"""Runs inside the vLLM venv (``benchmarks/.venv-vllm``), started by ``test_vllm_connector.py``: one
real vLLM engine (``vllm.LLM``: EngineCore and worker in their own processes, as ``vllm serve``),
with or without ``RAGCacheConnector``, answers a list of prompts one after the other (greedy) and
(or, for an item with ``abort_after_steps``, aborts it after that many engine steps, which the
engine core may be in the middle of: loads and saves race with the abort) and writes what it saw as JSON: each answer's token ids, prompt tokens, cached prompt tokens (vLLM's
own prefix cache plus ours), and the connector's Prometheus counters.

Not a test module (no ``test_`` prefix): pytest does not collect it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of {prompt, salt, abort_after_steps}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--connector", action="store_true")
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-bytes", type=int, default=128 << 20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    kw = {}
    if args.connector:
        kw["kv_transfer_config"] = {"kv_connector": "RAGCacheConnector",
                                    "kv_connector_module_path": "ragcache_integrations.vllm",
                                    "kv_role": "kv_both", "kv_connector_extra_config": json.loads(args.extra)}
    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=1024,
              enable_prefix_caching=True, kv_cache_memory_bytes=args.kv_bytes, seed=0,
              disable_log_stats=False, enforce_eager=True, **kw)  # eager: no ~75 s torch.compile per start
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    results = []
    for i, item in enumerate(json.load(open(args.prompts))):
        prompt = {"prompt": item["prompt"]}
        if item.get("salt"):
            prompt["cache_salt"] = item["salt"]
        if "abort_after_steps" in item:  # aborted after that many engine steps (0: as soon as it is sent)
            engine = llm.llm_engine
            rid = engine.add_request(f"aborted-{i}", prompt, sp)
            for _ in range(item["abort_after_steps"]):
                engine.step()
            engine.abort_request([rid])
            while engine.has_unfinished_requests():
                engine.step()
            results.append({"aborted": True})
            continue
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        results.append({"token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text,
                        "prompt_tokens": len(out.prompt_token_ids), "cached": out.num_cached_tokens})
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:ragcache_") or m.name in ("vllm:external_prefix_cache_hits",
                                                            "vllm:prompt_tokens_cached"):
            metrics[m.name] = metrics.get(m.name, 0) + getattr(m, "value", 0)
    json.dump({"results": results, "metrics": metrics}, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
