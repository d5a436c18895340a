"""Statistics, report and plots of ``ragcache bench`` (RAGCache §7 metrics; SPEC §5).

Pure functions over the benchmark's JSON-able results: TTFT percentiles, throughput, hit rates,
throughput at a TTFT SLO, the paired hit/miss comparison, the Markdown summary and PNG plots.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

__all__ = ["compact_records", "paired_by_hit", "percentile", "plot", "render_report", "slo_throughput", "summarize"]

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    idx = min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))
    return xs[idx]


def summarize(records: list[dict], makespan: float) -> dict:
    """TTFT statistics, throughput, hit rates and scheduling overhead of one run."""
    ok = [r for r in records if r.get("error") is None]
    ttft = [r["ttft_s"] for r in ok]
    out = {
        "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "throughput_rps": len(ok) / makespan if makespan > 0 else float("nan"),
        "makespan_s": makespan,
    }
    prompt = sum(r.get("prompt_tokens", 0) for r in ok)
    if prompt:
        out["token_hit_rate"] = sum(r.get("cached_tokens", 0) for r in ok) / prompt
    if ok and "device_hits" in ok[0]:
        # share of the cacheable nodes on request paths found on each tier (older results
        # counted only document segments in the denominator: "doc_segments")
        nodes = sum(r.get("cache_nodes", r.get("doc_segments", 0)) for r in ok)
        out["device_hit_rate"] = sum(r["device_hits"] for r in ok) / max(1, nodes)
        out["host_hit_rate"] = sum(r["host_hits"] for r in ok) / max(1, nodes)
        out["sched_overhead_ms"] = 1e3 * statistics.fmean(r["sched_s"] for r in ok)
        out["kv_copy_ms"] = 1e3 * statistics.fmean(r.get("kv_copy_s", 0.0) for r in ok)
    errors = sorted({r["error"] for r in records if r.get("error")})
    if errors:
        out["error_kinds"] = errors[:5]
    return out


def _table(rows: list[tuple], headers: tuple) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def _fmt(x, nd=3) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def compact_records(records: list[dict]) -> list[dict]:
    """Per-request figures kept in results.json (for the paired analysis)."""
    keys = ("ttft_s", "prompt_tokens", "cached_tokens", "error")
    return [{k: r[k] for k in keys if k in r} for r in records]


def paired_by_hit(results: dict) -> dict:
    """Mean TTFT of every system on the *same* requests, split by how much of the prompt ragcache
    served from its cache (>= 75%: "hit"; < 25%: "miss"), at each rate. Separates what the engine
    does with a cached prefix from how often the trace lets it hit."""
    recs = results.get("records", {})
    ours = recs.get("ragcache", {})
    out: dict = {}
    for rate, rc in ours.items():
        classes: dict[str, list[int]] = {"hit": [], "partial": [], "miss": []}
        for i, r in enumerate(rc):
            if "ttft_s" not in r or not r.get("prompt_tokens"):
                continue
            frac = r.get("cached_tokens", 0) / r["prompt_tokens"]
            classes["hit" if frac >= 0.75 else "miss" if frac < 0.25 else "partial"].append(i)
        row: dict = {}
        for name, by_rate in recs.items():
            other = by_rate.get(rate)
            if not other or len(other) != len(rc):
                continue
            for cls, idx in classes.items():
                vals = [other[i]["ttft_s"] for i in idx if "ttft_s" in other[i]]
                if vals:
                    row.setdefault(cls, {"requests": len(idx)})[name] = statistics.fmean(vals)
        out[rate] = row
    return out


def slo_throughput(results: dict) -> dict:
    """Throughput at an SLO of 5x the cache-off engine's mean TTFT at the lowest rate: the largest
    measured throughput among the rates whose mean TTFT meets the SLO."""
    rates = [str(r) for r in results["rates"]]
    base = results["systems"].get("no-cache", {}).get(rates[0], {}).get("ttft_mean_s")
    if base is None:
        return {}
    slo = 5 * base
    out = {"slo_s": slo, "throughput_rps": {}}
    for name, runs in results["systems"].items():
        if "error" in runs:
            continue
        good = [runs[r]["throughput_rps"] for r in rates if r in runs and runs[r]["ttft_mean_s"] <= slo]
        out["throughput_rps"][name] = max(good) if good else 0.0
    return out


def render_report(results: dict) -> str:
    """The Markdown summary printed by ``ragcache bench`` and written to ``OUT/summary.md``."""
    rates = [str(r) for r in results["rates"]]
    rows = []
    for name, runs in results["systems"].items():
        if "error" in runs:
            rows.append((name, "-", "error", "", "", "", "", "", runs["error"][:120]))
            continue
        for r in rates:
            s = runs.get(r)
            if not s:
                continue
            rows.append((name, r, _fmt(s["ttft_mean_s"]), _fmt(s["ttft_p50_s"]), _fmt(s["ttft_p99_s"]),
                         _fmt(s["throughput_rps"], 2), _fmt(s.get("token_hit_rate"), 2),
                         f"{_fmt(s.get('device_hit_rate'), 2)}/{_fmt(s.get('host_hit_rate'), 2)}"
                         if "device_hit_rate" in s else "-",
                         _fmt(s.get("sched_overhead_ms"), 3) if "sched_overhead_ms" in s else
                         (f"{s['errors']} errors" if s.get("errors") else "")))
    head = ("system", "rate", "TTFT mean s", "p50", "p99", "thr req/s", "token hit", "dev/host node hit",
            "sched ms/req | notes")
    lines = [f"model {results['model']} ({results['dtype']}), {results['threads']} threads, device tier "
             f"{results['device_mib']} MiB, host tier {results['host_mib']} MiB, max_tokens {results['max_tokens']}, "
             f"mean prompt {results['prompt_tokens_mean']:.0f} tokens",
             f"skew: {results['workload']['skew']}", "", _table(rows, head), ""]
    low = rates[0]
    sys_ = results["systems"]
    rc = sys_.get("ragcache", {}).get(low, {}).get("ttft_mean_s")
    for other in sys_:
        if other == "ragcache" or "error" in sys_[other]:
            continue
        o = sys_[other].get(low, {}).get("ttft_mean_s")
        if rc and o:
            lines.append(f"mean TTFT at {low} req/s: {other} / ragcache = {o / rc:.2f}x")
    slo = results.get("slo")
    if slo:
        lines.append(f"SLO {slo['slo_s']:.3f} s: throughput " +
                     ", ".join(f"{k} {v:.2f}" for k, v in slo["throughput_rps"].items()))
        base = slo["throughput_rps"].get("no-cache")
        if base:
            lines.append(f"throughput at SLO: ragcache / no-cache = {slo['throughput_rps'].get('ragcache', 0) / base:.2f}x")
    for rate, row in (results.get("paired") or {}).items():
        for cls, vals in row.items():
            base = vals.get("ragcache")
            others = ", ".join(f"{k} {v:.3f} s ({v / base:.1f}x)" for k, v in vals.items()
                               if k not in ("ragcache", "requests") and base)
            if base:
                lines.append(f"paired @ {rate} req/s, {vals['requests']} '{cls}' requests: ragcache {base:.3f} s; {others}")
    pa = results.get("policy_ablation")
    if pa:
        lines += ["", f"policy ablation at {pa['rate']} req/s: token hit rate / mean TTFT s"]
        rows = [(h, *(f"{_fmt(p[pol]['token_hit_rate'], 3)} / {_fmt(p[pol]['ttft_mean_s'])}"
                      for pol in ("pgdsf", "gdsf", "lru", "lfu"))) for h, p in pa["runs"].items()]
        lines.append(_table(rows, ("host MiB", "PGDSF", "GDSF", "LRU", "LFU")))
    ps = results.get("policy_sim")
    if ps:
        for trace, t in ps["traces"].items():
            lines += ["", f"policy replay, {trace} trace ({ps['requests']} requests, {t['distinct_documents']} documents, "
                      f"device {ps['device_mib']:.0f} MiB): token hit rate (node hit rate)"]
            rows = [(h, *(f"{row[pol]['token_hit_rate']:.3f} ({row[pol]['node_hit_rate']:.3f})"
                          for pol in ("pgdsf", "gdsf", "lru", "lfu"))) for h, row in t["hosts_mib"].items()]
            lines.append(_table(rows, ("host MiB", "PGDSF", "GDSF", "LRU", "LFU")))
    ra = results.get("reorder_ablation")
    if ra and "fifo" in ra:
        lines += ["", f"reordering ablation at {ra['rate']} req/s: mean TTFT reorder "
                  f"{_fmt(ra['reorder']['ttft_mean_s'])} s vs FIFO {_fmt(ra['fifo']['ttft_mean_s'])} s, "
                  f"p99 {_fmt(ra['reorder']['ttft_p99_s'])} vs {_fmt(ra['fifo']['ttft_p99_s'])}, "
                  f"token hit {_fmt(ra['reorder'].get('token_hit_rate'))} vs {_fmt(ra['fifo'].get('token_hit_rate'))}"]
    return "\n".join(lines)


def plot(results: dict, out: Path) -> None:
    """Write ``ttft_vs_rate.png``, ``policy_ablation.png`` and ``policy_replay.png`` under ``out``
    (needs matplotlib; the caller treats a failure as optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [str(r) for r in results["rates"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, runs in results["systems"].items():
        if "error" in runs:
            continue
        xs = [float(r) for r in rates if r in runs]
        for ax, key in zip(axes, ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s")):
            ax.plot(xs, [runs[r][key] for r in rates if r in runs], marker="o", label=name)
    for ax, title in zip(axes, ("mean TTFT", "p50 TTFT", "p99 TTFT")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_rate.png", dpi=110)
    plt.close(fig)
    pa = results.get("policy_ablation")
    if pa:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        hosts = list(pa["runs"])
        for pol in ("pgdsf", "gdsf", "lru", "lfu"):
            axes[0].plot(hosts, [pa["runs"][h][pol]["token_hit_rate"] for h in hosts], marker="o", label=pol)
            axes[1].plot(hosts, [pa["runs"][h][pol]["ttft_mean_s"] for h in hosts], marker="o", label=pol)
        axes[0].set_title("token hit rate")
        axes[1].set_title("mean TTFT (s)")
        for ax in axes:
            ax.set_xlabel("host tier (MiB)")
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(out / "policy_ablation.png", dpi=110)
        plt.close(fig)
    ps = results.get("policy_sim")
    if ps:
        fig, axes = plt.subplots(1, len(ps["traces"]), figsize=(5 * len(ps["traces"]), 4), squeeze=False)
        for ax, (trace, t) in zip(axes[0], ps["traces"].items()):
            hosts = list(t["hosts_mib"])
            for pol in ("pgdsf", "gdsf", "lru", "lfu"):
                ax.plot([int(h) for h in hosts], [t["hosts_mib"][h][pol]["token_hit_rate"] for h in hosts],
                        marker="o", label=pol)
            ax.set_title(f"policy replay, {trace} popularity")
            ax.set_xlabel("host tier (MiB)")
            ax.set_ylabel("token hit rate")
            ax.grid(alpha=0.3)
        axes[0][0].legend()
        fig.tight_layout()
        fig.savefig(out / "policy_replay.png", dpi=110)
        plt.close(fig)
