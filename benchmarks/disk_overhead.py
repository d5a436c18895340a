"""What the disk tier costs on a miss and gives on a restart, side by side in one run.

Two engines share one loaded model: one with the disk tier, one without. Each real RAG request
(a Python FAQ question and its top-k documents from the Python docs) runs on both, in alternating
order, under a fresh ``cache_salt`` so that it is a miss for both: the ratio of their TTFT and
end-to-end time is the disk tier's overhead on a miss (the copy to host memory after the step, and
the writer thread's checksum, serialisation and fsync competing for the same cores). Then a new
engine opens the same folder (a restart) and answers every request again: its TTFT comes from
the disk tier; once more, and it comes from device memory.

    .venv/bin/python benchmarks/disk_overhead.py --requests 12 --json out.json
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmark_report import write_report  # benchmarks/ is on sys.path when a script runs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from ragcache_backend.bench.workload import question_pool
    from ragcache_backend.config import MiB, EngineConfig
    from ragcache_backend.engine.engine import RAGCacheEngine
    from ragcache_backend.model.loader import load_model
    from ragcache_backend.model.sampling import SamplingParams
    from ragcache_integrations import default_store

    store = default_store()
    pool = question_pool(store, k=args.k)[: args.requests]
    requests = [(q.text, [store.get(d) for d in q.doc_ids]) for q in pool]
    loaded = load_model(dtype=args.dtype)
    folder = Path(tempfile.mkdtemp(prefix="ragcache-disk-overhead-"))
    atexit.register(shutil.rmtree, folder, True)  # its KV files are gone when the run ends, as it ends
    base = dict(dtype=args.dtype, device_budget_bytes=256 * MiB, host_budget_bytes=512 * MiB)
    on = RAGCacheEngine(EngineConfig(disk_dir=folder, **base), loaded=loaded)
    off = RAGCacheEngine(EngineConfig(**base), loaded=loaded, profile=on.profile)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    on.generate("warm-up", [], sampling, cache_salt="warm")
    off.generate("warm-up", [], sampling, cache_salt="warm")

    rows = []
    for i, (question, docs) in enumerate(requests):
        row = {"question": question[:60]}
        for engine, name in ((on, "disk"), (off, "no_disk")) if i % 2 == 0 else ((off, "no_disk"), (on, "disk")):
            r = engine.generate(question, docs, sampling, cache_salt=f"miss-{i}")
            assert r.cached_tokens == 0
            row[f"miss_ttft_{name}_s"], row[f"miss_total_{name}_s"] = r.ttft_s, r.total_s
            row["prompt_tokens"] = r.prompt_tokens
        rows.append(row)
    t0 = time.perf_counter()
    on.close()  # writes what is still queued
    flush_s = time.perf_counter() - t0
    disk_stats = on.cache.disk.stats
    off.close()

    restarted = RAGCacheEngine(EngineConfig(disk_dir=folder, **base), loaded=loaded, profile=on.profile)
    for i, (question, docs) in enumerate(requests):
        r = restarted.generate(question, docs, sampling, cache_salt=f"miss-{i}")
        rows[i]["disk_hit_ttft_s"], rows[i]["disk_hits"], rows[i]["disk_cached"] = r.ttft_s, r.disk_hits, r.cached_tokens
        r = restarted.generate(question, docs, sampling, cache_salt=f"miss-{i}")
        rows[i]["memory_hit_ttft_s"] = r.ttft_s
    read = restarted.cache.disk.stats
    restarted.close()

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "command": " ".join(sys.argv), "dtype": args.dtype, "requests": len(rows),
        "mean_prompt_tokens": mean("prompt_tokens"),
        "miss_ttft_disk_s": mean("miss_ttft_disk_s"), "miss_ttft_no_disk_s": mean("miss_ttft_no_disk_s"),
        "miss_ttft_ratio_disk_over_no_disk": mean("miss_ttft_disk_s") / mean("miss_ttft_no_disk_s"),
        "miss_total_ratio_disk_over_no_disk": mean("miss_total_disk_s") / mean("miss_total_no_disk_s"),
        "restart_disk_hit_ttft_s": mean("disk_hit_ttft_s"), "memory_hit_ttft_s": mean("memory_hit_ttft_s"),
        "miss_over_disk_hit_ttft": mean("miss_ttft_no_disk_s") / mean("disk_hit_ttft_s"),
        "files_written": disk_stats.writes, "write_s_total": disk_stats.write_s, "flush_at_close_s": flush_s,
        "files_read": read.loaded, "read_s_total": read.read_s, "disk_bytes": sum(p.stat().st_size for p in folder.rglob("*.kv.safetensors")),
        "rows": rows,
    }
    write_report(report, args.json)


if __name__ == "__main__":
    main()
