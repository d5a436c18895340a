"""Which signal should the quality guard act on? Offline, from ``chunk_mmlu.py``'s records.

    .venv/bin/python benchmarks/guard_signals.py RUN.json [RUN2.json ...]

``chunk_mmlu.py --json`` keeps, for its "guard signal only" rule (the default rule with the guard
measuring and never acting), every reused chunk's record (``GenerationResult.chunk_reuse``: the
K/V deviation of its recomputed tokens and the attention the prompt's last token gave it) beside
the request's first-token KL against full prefill. Per file this prints, over the requests that
reused a chunk, the Spearman correlation with the KL of the largest per-chunk value of each
candidate signal (the deviation alone: the guard until 2026-11-27; deviation x attention: the
guard since), how many requests each flags at its threshold, and, for a guard that flagged the
``k`` requests with the largest signal and recomputed them exactly (an upper bound on what the
real second pass does), the mean KL of the worst 5% of requests and how many of them it caught.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chunk_eval import spearman  # noqa: E402

RULE = "Cache-Craft CFO, alpha 1, guard signal only"
SIGNALS = {
    "deviation (0.2)": (lambda c: c["deviation"] or 0.0, 0.2),
    "deviation x attention (0.012)": (lambda c: (c["deviation"] or 0.0) * (c["attention"] or 0.0), 0.012),
}


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        data = json.loads(Path(path).read_text())
        rows = [r["rules"][RULE] for r in data["records"] if r["rules"][RULE]["chunk_hits"]]
        kl = [x["kl"] for x in rows]
        n = len(rows)
        worst = sorted(range(n), key=lambda i: -kl[i])[: max(1, round(0.05 * n))]
        print(f"{path}: {n} requests with chunk hits, worst 5% = {len(worst)} requests, their mean KL "
              f"{sum(kl[i] for i in worst) / len(worst):.4f}")
        for name, (per_chunk, threshold) in SIGNALS.items():
            sig = [max((per_chunk(c) for c in x["chunks"]), default=0.0) for x in rows]
            line = (f"  {name:30s} Spearman {spearman(sig, kl):5.2f}; over its threshold: "
                    f"{sum(v > threshold for v in sig)} requests")
            for k in (round(0.1 * n), round(0.2 * n)):
                top = set(sorted(range(n), key=lambda i: -sig[i])[:k])
                after = sorted((0.0 if i in top else kl[i] for i in range(n)), reverse=True)[: len(worst)]
                line += (f"; top {k} recomputed: worst-5% KL {sum(after) / len(after):.4f}, "
                         f"{len(top & set(worst))} of {len(worst)} caught")
            print(line)


if __name__ == "__main__":
    main()
