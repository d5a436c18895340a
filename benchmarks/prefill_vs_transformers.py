"""Cold prefill speed: our forward pass vs transformers' own forward, same model, same tokens.

Usage: python benchmarks/prefill_vs_transformers.py [--tokens 1024] [--threads 2] [--repeats 5]

For each dtype (fp32, bf16) it times a cold prefill of ``--tokens`` random tokens through
``ModelRunner.forward`` (writing KV into the paged arena, logits of the last token) and through
``model(input_ids, logits_to_keep=1)`` (what ``generate`` runs for prefill), interleaved, and
prints the best time of each and the ratio ours / transformers. Also the full-logits forward
(``model(input_ids)``) for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from ragcache_backend.model.loader import load_model
from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(dtype=dtype)
        blocks = -(-args.tokens // 16)
        runner = ModelRunner(loaded, num_device_blocks=blocks, block_size=16)
        toks = torch.randint(0, loaded.model.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
        item = ForwardInput(tuple(toks.tolist()), (), (KVRun(tuple(range(blocks)), 0, args.tokens),))
        ids = toks[None]
        ours, hf, hf_all = [], [], []
        with torch.inference_mode():
            runner.forward([item]), loaded.model(ids, logits_to_keep=1)  # warm-up
            for _ in range(args.repeats):
                t = time.perf_counter(); runner.forward([item]); ours.append(time.perf_counter() - t)
                t = time.perf_counter(); loaded.model(ids, logits_to_keep=1); hf.append(time.perf_counter() - t)
                t = time.perf_counter(); loaded.model(ids); hf_all.append(time.perf_counter() - t)
        row = {"dtype": dtype, "tokens": args.tokens, "threads": args.threads, "ours_s": min(ours),
               "transformers_s": min(hf), "transformers_all_logits_s": min(hf_all), "ratio": min(ours) / min(hf)}
        rows.append(row)
        print(f"{dtype:9s} {args.tokens} tokens, {args.threads} threads: ours {row['ours_s']:.3f} s, "
              f"transformers {row['transformers_s']:.3f} s (all logits {row['transformers_all_logits_s']:.3f} s), "
              f"ratio ours/transformers {row['ratio']:.2f}x")
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=2)


if __name__ == "__main__":
    main()
