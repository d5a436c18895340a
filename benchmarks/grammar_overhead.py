"""What constrained decoding costs requests that do not use it, in one process, interleaved.

    .venv/bin/python benchmarks/grammar_overhead.py [--rounds 8] [--json OUT]

The default engine (SmolLM2-135M, the CPU's fastest path). Each round runs two batches in
alternating order, each of five concurrent greedy requests, ``max_tokens=48``:

* **plain**: five requests without a grammar;
* **mixed**: the same four plain requests plus one whose answer is held to a JSON Schema (the
  grammar's mask is computed on the step thread, between forward passes).

The fifth request has the same prompt in both batches and generates as many tokens: the grammar
request's length is measured once (greedy, so it is fixed) and the plain fifth gets that
``max_tokens``, so both batches shrink from five sequences to four at the same step and do the
same forward work; both fifth requests' token counts are checked equal every round.

Reported: the four plain requests' mean time per output token (``(total_s - ttft_s) /
(tokens - 1)``) in the mixed batch over the plain batch (paired by round; mean ratio and its
95% interval), and the sampler alone on one logits row: ``choose_token`` without any option vs
``torch.argmax`` (what sampling cost before), in microseconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ragcache_backend import RAGCacheEngine, SamplingParams
from ragcache_backend.config import EngineConfig
from ragcache_backend.model.grammar import Grammar
from ragcache_backend.model.sampling import choose_token

QUESTIONS = ["Why can a tuple be a dictionary key?", "How do I read a file line by line?",
             "What does the global statement do?", "How do I copy a list?"]
SCHEMA = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40},
                                           "difficulty": {"enum": ["easy", "medium", "hard"]}},
          "required": ["topic", "difficulty"], "additionalProperties": False}
FIFTH = "Describe the question 'how do I sort a dictionary by value' as JSON."


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    return f"{name}; {'AVX512-BF16' if 'avx512_bf16' in flags else 'AVX2 only' if 'avx2' in flags else 'no AVX2'}"


def per_token(result) -> float:
    return (result.total_s - result.ttft_s) / max(1, len(result.token_ids) - 1)


def batch(engine: RAGCacheEngine, grammar: bool, fifth_tokens: int) -> tuple[list[float], int]:
    """Five concurrent requests; the four plain ones' seconds per output token, and the fifth's tokens."""
    plain = SamplingParams(max_tokens=48)
    fifth = (SamplingParams(max_tokens=48, grammar=Grammar.json_schema(SCHEMA)) if grammar
             else SamplingParams(max_tokens=fifth_tokens))
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(engine.generate, q, [], plain) for q in QUESTIONS]
        futures.append(pool.submit(engine.generate, FIFTH, [], fifth))
        results = [f.result() for f in futures]
    if grammar:
        json.loads(results[-1].answer)  # the constrained answer is valid JSON
    return [per_token(r) for r in results[:4]], len(results[-1].token_ids)


def sampler_us(repeats: int = 2000) -> tuple[float, float]:
    logits = torch.randn(49152)
    params = SamplingParams()
    for fn in (lambda: choose_token(logits, params, None), lambda: int(torch.argmax(logits).item())):
        fn()
    times = []
    for fn in (lambda: choose_token(logits, params, None), lambda: int(torch.argmax(logits).item())):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        times.append((time.perf_counter() - t0) / repeats * 1e6)
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = RAGCacheEngine(EngineConfig())
    _, n = batch(engine, True, 0)  # warm-up (kernels, the grammar library's tokenizer) and the grammar answer's length
    batch(engine, False, n)
    ratios, plain_ms, mixed_ms = [], [], []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {}
        for g in order:
            times, fifth = batch(engine, g, n)
            if fifth != n:
                raise SystemExit(f"the fifth request generated {fifth} tokens, not {n}: the batches differ")
            got[g] = statistics.mean(times)
        ratios.append(got[True] / got[False])
        plain_ms.append(got[False] * 1e3)
        mixed_ms.append(got[True] * 1e3)
        print(f"round {r}: plain {got[False] * 1e3:.1f} ms/token, mixed {got[True] * 1e3:.1f} ms/token, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    engine.close()
    ours, argmax = sampler_us()
    mean, sd = statistics.mean(ratios), statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    half = 1.96 * sd / len(ratios) ** 0.5
    report = {"cpu": cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": args.rounds,
              "plain_ms_per_token": statistics.median(plain_ms), "mixed_ms_per_token": statistics.median(mixed_ms),
              "fifth_request_tokens": n, "ratio_mean": mean, "ratio_ci95": [mean - half, mean + half],
              "choose_token_us": ours, "argmax_us": argmax, "python": platform.python_version()}
    print(f"\nCPU: {report['cpu']}; {report['date']}")
    print(f"plain requests beside a grammar request / beside a plain one: {mean:.3f}x "
          f"(95% CI {mean - half:.3f}-{mean + half:.3f}, {args.rounds} rounds)")
    print(f"sampler, no options: choose_token {ours:.1f} us vs argmax {argmax:.1f} us per token")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
