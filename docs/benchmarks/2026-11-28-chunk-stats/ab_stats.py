"""The chunk mode's per-layer measurements on a bf16 arena, the new kernels against the route before
them, interleaved per round (scratch script of 2026-11-28; run from the repository root):

    .venv/bin/python docs/benchmarks/2026-11-28-chunk-stats/ab_stats.py

* segment mass: ``chunk_stats.segment_mass`` on bf16 queries and arena (AVX512-BF16 kernel) against
  what the code did before: the context's keys gathered and converted to float32, the queries
  converted, then the float32 kernel (the same public function called on those float32 tensors);
* K/V deviation: ``chunk_stats.kv_deviation`` against the torch form (float32 copies, cat, norms).
Shapes: SmolLM2-135M (3 KV heads of 64), one row (the guard's last row, every layer), 441 and
1,800 rows (statistics of a chunk request's computed rows, 6 layers).
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from ragcache_backend.model.kernels import chunk_stats  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
H, D = 3, 64
kc = torch.randn(16384, H, D).bfloat16()
vc = torch.randn(16384, H, D).bfloat16()


def old_mass(q, slots, pos, offs):
    return chunk_stats.segment_mass(q.float(), kc.index_select(0, slots).float(), torch.arange(slots.numel()), pos, offs, 0.125)


def new_mass(q, slots, pos, offs):
    return chunk_stats.segment_mass(q, kc, slots, pos, offs, 0.125)


def old_dev(slots, ok, ov):
    new = torch.cat((kc.index_select(0, slots).float().flatten(1), vc.index_select(0, slots).float().flatten(1)), 1)
    old = torch.cat((ok.float().flatten(1), ov.float().flatten(1)), 1)
    ref = old.norm(dim=1)
    return torch.where(ref > 0, (new - old).norm(dim=1) / ref.clamp_min(1e-6), torch.zeros_like(ref))


def new_dev(slots, ok, ov):
    return chunk_stats.kv_deviation(kc, vc, slots, ok, ov)


def timed(fn, args, n):
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - t) / n * 1e3


for T, S in ((1, 1041), (1, 2100), (441, 1041), (1800, 2100)):
    slots = torch.randperm(16384)[:S]
    q = torch.randn(T, 9, D).bfloat16()[:, ::3]
    pos = torch.arange(S - T, S)
    offs = torch.tensor([0, 29, 300, 700, S - 64, S])
    a, b = old_mass(q, slots, pos, offs), new_mass(q, slots, pos, offs)
    n = 300 if T == 1 else 10
    res = {"old": [], "new": []}
    for r in range(7):
        for k in (("old", "new") if r % 2 else ("new", "old")):
            res[k].append(timed(old_mass if k == "old" else new_mass, (q, slots, pos, offs), n))
    print(f"segment mass T={T:5d} S={S}: before {statistics.median(res['old']):.3f} ms, now {statistics.median(res['new']):.3f} ms "
          f"({statistics.median(res['new']) / statistics.median(res['old']):.2f}x), max |diff| {(a - b).abs().max().item():.1e}")
for T in (118, 441, 1800):
    slots = torch.randperm(16384)[:T]
    ok = (kc.index_select(0, slots).float() + 0.1 * torch.randn(T, H, D)).bfloat16()
    ov = (vc.index_select(0, slots).float() + 0.1 * torch.randn(T, H, D)).bfloat16()
    a, b = old_dev(slots, ok, ov), new_dev(slots, ok, ov)
    res = {"old": [], "new": []}
    for r in range(7):
        for k in (("old", "new") if r % 2 else ("new", "old")):
            res[k].append(timed(old_dev if k == "old" else new_dev, (slots, ok, ov), 100))
    print(f"K/V deviation T={T:5d}: before {statistics.median(res['old']):.3f} ms, now {statistics.median(res['new']):.3f} ms "
          f"({statistics.median(res['new']) / statistics.median(res['old']):.2f}x), max rel diff {((a - b).abs() / a).max().item():.1e}")
