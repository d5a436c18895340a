"""The float32 attention kernel alone (``rc32_paged_attention``: prompt rows and decode rows), this
tree's against an earlier revision's, interleaved in one process: time, GFLOPS and whether the
outputs are the same bits.

    .venv/bin/python benchmarks/prompt_attention.py --base 0c538b4 [--repeats 9] [--json OUT]

Both versions' ``kernels_f32.c`` are compiled here with the flags the package builds them with and
called through ctypes on the same inputs: one layer of the default model's shape (SmolLM2-135M: 9
query heads, 3 KV heads, head size 64), contexts in shuffled 16-slot blocks of an arena as the
engine lays them out, 2 threads. Cases: cold prompts of 1,000 and 2,000 tokens, 512 new tokens over
1,536 cached, a burst-like mixed step (prompts of 915, 788 and 343 tokens and two decode rows
over 1,000), and steps over all 30 layers, each layer its own arena, so that their KV comes from
memory as in a real step: 30 new tokens over 1,024 cached, a mixed step (two prompts of 280 over 535
cached, two decode rows over 1,000), and decode steps (1 generated token over 600, 1,024 or 1,900
keys, 8 over 1,900, 900 or 300). FLOPs counted are the causal ones (4 * head size * query heads per
query-key pair).
Each round times both versions one after the other, in alternating order; median (min) reported.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from forward_vs_vllm import machine  # noqa: E402

from ragcache_backend.model.kernels import native  # noqa: E402

SOURCE = "ragcache_backend/model/kernels/csrc/kernels_f32.c"
HEADERS = tuple(f"ragcache_backend/model/kernels/csrc/{h.name}" for h in native.HEADERS)  # headers the kernels include


def revision_text(rev: str | None, path: str) -> str | None:
    """``path`` at git revision ``rev`` (None: the working tree), or None where it does not exist."""
    if rev is None:
        return (ROOT / path).read_text() if (ROOT / path).exists() else None
    got = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return got.stdout if got.returncode == 0 else None


def build(rev: str | None, out: Path) -> ctypes.CDLL:
    """Compile ``kernels_f32.c`` (with the headers it includes) of git revision ``rev`` (None: the
    working tree) into ``out``, in a folder of its own, and bind ``rc32_paged_attention``."""
    folder = out.with_suffix("")
    folder.mkdir()
    for path in (SOURCE, *HEADERS):
        text = revision_text(rev, path)
        if text is None and path == SOURCE:
            raise SystemExit(f"{path} does not exist at {rev or 'the working tree'}")
        if text is not None:
            (folder / Path(path).name).write_text(text)
    src = folder / Path(SOURCE).name
    subprocess.run(["cc", *native.BUILD_FLAGS, "-o", str(out), str(src)], check=True)
    lib = ctypes.CDLL(str(out))
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn = lib.rc32_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32, ptr, ctypes.c_int]
    return lib


class Step:
    """One forward step's attention inputs: sequences of ``(cached, new, decode)`` over a shared arena."""

    def __init__(self, seqs: list[tuple[int, int, bool]], hq: int, hkv: int, d: int, gen: torch.Generator,
                 layers: int = 1):
        total = sum(c + n for c, n, _ in seqs)
        nblocks = -(-total // 16) + len(seqs)
        # one arena per layer: a step's layers read KV no cache holds (decode steps are bound by that)
        self.ks = [torch.randn(nblocks * 16, hkv, d, generator=gen) for _ in range(layers)]
        self.vs = [torch.randn(nblocks * 16, hkv, d, generator=gen) for _ in range(layers)]
        order = torch.randperm(nblocks, generator=gen).tolist()
        contexts = []
        for cached, new, _ in seqs:
            s = cached + new
            n = -(-s // 16)
            take, order = order[:n], order[n:]  # each sequence its own blocks
            contexts.append(torch.tensor([b * 16 + i for b in take for i in range(16)][:s], dtype=torch.int64))
        self.slots = torch.cat(contexts)
        self.ctx_off = torch.tensor([0, *(c + n for c, n, _ in seqs)], dtype=torch.int64).cumsum(0)
        self.q_off = torch.tensor([0, *(n for _, n, _ in seqs)], dtype=torch.int64).cumsum(0)
        self.decode = torch.tensor([dec for *_, dec in seqs], dtype=torch.uint8)
        self.q = torch.randn(int(self.q_off[-1]), hq, d, generator=gen)
        self.shape = (len(seqs), hq, hkv, d)
        self.flops = layers * sum(4 * d * hq * (c + t + 1) for c, n, _ in seqs for t in range(n))

    def run(self, lib: ctypes.CDLL, out: torch.Tensor, threads: int) -> None:
        b, hq, hkv, d = self.shape
        for k, v in zip(self.ks, self.vs):  # every layer writes the same out: the last layer's is compared
            rc = lib.rc32_paged_attention(self.q.data_ptr(), self.q.stride(0), k.data_ptr(), v.data_ptr(),
                                          self.slots.data_ptr(), self.ctx_off.data_ptr(), self.q_off.data_ptr(),
                                          self.decode.data_ptr(), None, b, hq, hkv, d, d ** -0.5, out.data_ptr(), threads)
            if rc != 0:
                raise RuntimeError(f"rc32_paged_attention returned {rc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose kernels_f32.c is the baseline")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build(args.base, Path(tmp) / "base.so"), "new": build(None, Path(tmp) / "new.so")}
        gen = torch.Generator().manual_seed(0)
        shape = (args.heads, args.kv_heads, args.head_dim)
        cases = {
            "cold 1000": Step([(0, 1000, False)], *shape, gen),
            "cold 2000": Step([(0, 2000, False)], *shape, gen),
            "512 over 1,536 cached": Step([(1536, 512, False)], *shape, gen),
            "mixed: 915 + 788 + 343 + 2 decodes": Step([(0, 915, False), (0, 788, False), (0, 343, False),
                                                         (999, 1, True), (999, 1, True)], *shape, gen),
            # every layer of the model (30): the KV is read from memory, as in a real step
            "30 over 1,024 cached, 30 layers": Step([(1024, 30, False)], *shape, gen, layers=30),
            "mixed: 2 x 280 over 535 + 2 decodes, 30 layers": Step([(535, 280, False), (535, 280, False), (999, 1, True),
                                                                    (999, 1, True)], *shape, gen, layers=30),
            "decode: 1 over 600, 30 layers": Step([(599, 1, True)], *shape, gen, layers=30),
            "decode: 1 over 1,024, 30 layers": Step([(1023, 1, True)], *shape, gen, layers=30),
            "decode: 1 over 1,900, 30 layers": Step([(1899, 1, True)], *shape, gen, layers=30),
            "decode: 8 over 1,900, 30 layers": Step([(1899, 1, True)] * 8, *shape, gen, layers=30),
            "decode: 8 over 300, 30 layers": Step([(299, 1, True)] * 8, *shape, gen, layers=30),
            "decode: 8 over 900, 30 layers": Step([(899, 1, True)] * 8, *shape, gen, layers=30),
        }
        times: dict[str, dict[str, list[float]]] = {name: {"base": [], "new": []} for name in cases}
        same: dict[str, bool] = {}
        for rnd in range(args.repeats + 1):  # round 0 warms up
            for name, step in cases.items():
                outs = {}
                for side in ("base", "new") if rnd % 2 else ("new", "base"):
                    out = torch.empty_like(step.q)
                    t = time.perf_counter()
                    step.run(libs[side], out, args.threads)
                    dt = time.perf_counter() - t
                    outs[side] = out
                    if rnd:
                        times[name][side].append(dt)
                same[name] = same.get(name, True) and torch.equal(outs["base"], outs["new"])
    m = machine()
    print(f"{m['cpu']} ({m['isa']}), {args.threads} threads, float32, Hq {args.heads} Hkv {args.kv_heads} D {args.head_dim}; "
          f"base {args.base} vs this tree; median (min) of {args.repeats} interleaved rounds; {m['date']}")
    print(f"{'case':48s} {'base ms':>16s} {'new ms':>16s} {'GFLOPS base/new':>16s} {'new/base':>9s} {'same bits':>9s}")
    report = {}
    for name, t in times.items():
        b, n = statistics.median(t["base"]), statistics.median(t["new"])
        flops = cases[name].flops
        report[name] = {"base_ms": b * 1e3, "new_ms": n * 1e3, "base_min_ms": min(t["base"]) * 1e3,
                        "new_min_ms": min(t["new"]) * 1e3, "ratio": n / b, "gflops_base": flops / b / 1e9,
                        "gflops_new": flops / n / 1e9, "flops": flops, "same_bits": same[name]}
        print(f"{name:48s} {b * 1e3:7.1f} ({min(t['base']) * 1e3:6.1f}) {n * 1e3:7.1f} ({min(t['new']) * 1e3:6.1f}) "
              f"{flops / b / 1e9:7.1f}/{flops / n / 1e9:<7.1f} {n / b:9.3f} {str(same[name]):>9s}")
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "base": args.base, "repeats": args.repeats,
                                         "threads": args.threads, "cases": report}, indent=1))


if __name__ == "__main__":
    main()
