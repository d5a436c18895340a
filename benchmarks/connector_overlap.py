"""The vLLM connector's worker on a GPU: do its layer-by-layer copies hide behind the forward pass?

vLLM calls the connector's worker around each forward pass: ``start_load_kv`` before it,
``wait_for_layer_load`` before each layer's attention, ``save_kv_layer`` after each layer's
attention, ``wait_for_save`` after it. This script drives :class:`ConnectorWorker` exactly so,
around a stand-in forward pass on the GPU: per layer the projections and MLP GEMMs of a
Llama-shaped layer over the step's new tokens and causal attention of those tokens over the cached
blocks the connector loaded plus their own (``scaled_dot_product_attention``), for a prompt whose
first ``--cached-tokens`` come from the host tier (a vLLM miss, our hit) and whose last
``--new-tokens`` are computed and saved to the host tier. vLLM itself does not run here: no CUDA
build of vLLM reaches the lent GPU machine; what is timed is the connector's copies against the
same GPU work vLLM's forward pass would queue.

Cases, interleaved repeat by repeat (median of ``--repeats`` each, wall time from the first call
to the end of the step, ``torch.cuda.synchronize``):

- ``resident``: the forward pass alone, the cached blocks already in vLLM's KV (a vLLM prefix-cache
  hit): the floor;
- ``load``: ``start_load_kv`` + the forward pass waiting per layer (this worker);
- ``load, base``: the same with the worker module of ``--base-file`` (the code before the change:
  loads copied synchronously before the forward pass; ``wait_layer`` absent, so not called);
- ``save`` / ``save, base``: the forward pass of a cold prompt with each layer's new blocks saved
  to the host tier (``save_kv_layer`` per layer, ``wait_for_save`` at the end);
- ``compute all``: the forward pass over the whole prompt (what a miss costs without the cache).

Run on the GPU machine (``benchmarks/gpu_check.sh`` does, with ``--base-file`` when it is given
one): ``python benchmarks/connector_overlap.py --shape llama3-8b --json out.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ragcache_integrations.vllm.layout import BlockLayout  # noqa: E402
from ragcache_integrations.vllm.plan import BlockLoad, BlockSave, StepPlan  # noqa: E402
from ragcache_integrations.vllm.worker import ConnectorWorker  # noqa: E402

DEVICE = "cuda"  # --device cpu: a smoke run of the script's logic (its times mean nothing)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama-family model's shape (the forward pass's GEMM sizes and the KV per token)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_size: int


SHAPES = {
    "llama3-8b": Shape(32, 4096, 14336, 32, 8, 128),
    "smollm2-135m": Shape(30, 576, 1536, 9, 3, 64),
}


class Forward:
    """A stand-in for one Llama forward pass over ``new`` tokens attending to ``cached`` earlier ones
    held in paged KV blocks (random weights; the GPU work and its shapes are a real layer's)."""

    def __init__(self, shape: Shape, kv: list[torch.Tensor], block_size: int, dtype: torch.dtype) -> None:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        h, i, s = shape.hidden, shape.intermediate, shape.head_size
        qkv = (shape.heads + 2 * shape.kv_heads) * s

        def w(a: int, b: int) -> torch.Tensor:
            return torch.randn(a, b, generator=g, device=DEVICE, dtype=dtype) * a ** -0.5

        self.w_qkv, self.w_o, self.w_up, self.w_down = w(h, qkv), w(shape.heads * s, h), w(h, 2 * i), w(i, h)
        self.shape, self.kv, self.block_size = shape, kv, block_size

    def run(self, x: torch.Tensor, block_ids: torch.Tensor, cached: int, before_layer=None, after_layer=None) -> torch.Tensor:
        """``x``: ``[new, hidden]``; ``block_ids``: the request's blocks (cached ones first) on the device."""
        sh, bs = self.shape, self.block_size
        new = x.shape[0]
        mask = causal_lower_right(new, cached + new)  # causal, the new tokens last (flash / efficient kernels)
        new_ids = block_ids[cached // bs:]
        rep = sh.heads // sh.kv_heads
        for layer in range(sh.layers):
            q, k, v = (x @ self.w_qkv).split([sh.heads * sh.head_size, sh.kv_heads * sh.head_size,
                                              sh.kv_heads * sh.head_size], dim=-1)
            if before_layer is not None:
                before_layer(layer)  # vLLM: wait_for_layer_load, inside the layer's attention
            kv = self.kv[layer]  # [blocks, kv_heads, bs, 2*hs] (the connector's packed layout)
            fresh = torch.cat([k, v], dim=-1).view(-1, bs, sh.kv_heads, 2 * sh.head_size).transpose(1, 2)
            kv.index_copy_(0, new_ids, fresh)  # the new tokens' K and V into their blocks
            if after_layer is not None:
                after_layer(layer)  # vLLM: save_kv_layer, after the layer's attention wrote its KV
            seq = kv.index_select(0, block_ids).transpose(0, 1).reshape(sh.kv_heads, -1, 2 * sh.head_size)
            keys, values = seq.split(sh.head_size, dim=-1)  # [kv_heads, cached + new, hs]: paged reads
            qh = q.view(new, sh.heads, sh.head_size).transpose(0, 1)
            o = F.scaled_dot_product_attention(qh.unsqueeze(0), keys.repeat_interleave(rep, 0).unsqueeze(0),
                                               values.repeat_interleave(rep, 0).unsqueeze(0), attn_mask=mask)
            x = x + o[0].transpose(0, 1).reshape(new, -1) @ self.w_o
            gate, up = (x @ self.w_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.w_down
        return x


def load_worker_class(path: str | None):
    if path is None:
        return ConnectorWorker
    spec = importlib.util.spec_from_file_location("base_worker", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module.ConnectorWorker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cached-tokens", type=int, default=4096, help="tokens loaded from the host tier (whole blocks)")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens the step computes (whole blocks)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--base-file", default=None, help="worker.py of the code to compare against")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("connector_overlap.py needs a GPU")
    shape, bs, dtype = SHAPES[args.shape], args.block_size, getattr(torch, args.dtype)
    n_cached, n_new = args.cached_tokens // bs, args.new_tokens // bs
    n_blocks = n_cached + n_new
    kv = [torch.zeros(2 * n_blocks + 1, shape.kv_heads, bs, 2 * shape.head_size, device=DEVICE, dtype=dtype)
          for _ in range(shape.layers)]
    names = {f"model.layers.{i}.self_attn": t for i, t in enumerate(kv)}
    layout = BlockLayout.detect(kv[0], bs, kv_heads=shape.kv_heads, head_size=shape.head_size)
    block_bytes = kv[0][0].nbytes * shape.layers
    fwd = Forward(shape, kv, bs, dtype)
    ids = torch.arange(n_blocks, device=DEVICE)  # the request's blocks: cached ones, then new ones
    x = torch.randn(args.new_tokens, shape.hidden, device=DEVICE, dtype=dtype)
    x_all = torch.randn(args.cached_tokens + args.new_tokens, shape.hidden, device=DEVICE, dtype=dtype)

    def toks(j: int) -> tuple[int, ...]:
        return tuple(range(j * bs, (j + 1) * bs))

    saves_cached = [BlockSave(f"b{j}", "", f"s{j}", toks(j), j, True, False, 1.0, "r", slot=j) for j in range(n_cached)]
    loads = [BlockLoad(f"b{j}", toks(j), j, "host", "r", slot=j) for j in range(n_cached)]
    saves_new = [BlockSave(f"n{j}", "", f"t{j}", toks(j), n_cached + j, True, False, 1.0, "r", slot=n_cached + j)
                 for j in range(n_new)]
    workers = {}
    for t in kv:
        t[:n_cached].normal_()
    for label, path in [("", None)] + ([(", base", args.base_file)] if args.base_file else []):
        worker = load_worker_class(path)(bs, None, host_slots=n_blocks)
        worker.register(names, layout)
        worker.save(StepPlan(saves=saves_cached))  # the host tier holds the cached blocks
        workers[label] = worker
    cached_kv = [t[:n_cached].cpu() for t in kv]
    sync()

    def step(case: str) -> float:
        sync()
        t0 = time.perf_counter()
        if case == "resident":
            fwd.run(x, ids, args.cached_tokens)
        elif case == "compute all":
            fwd.run(x_all, ids, 0)
        elif case.startswith("load"):
            worker = workers[case[4:]]
            worker.load(StepPlan(loads=loads))
            wait = getattr(worker, "wait_layer", None)
            fwd.run(x, ids, args.cached_tokens, before_layer=wait)
            worker.save(StepPlan())
        else:  # save
            worker = workers[case[4:]]
            plan = StepPlan(saves=saves_new)
            fwd.run(x, ids, args.cached_tokens,
                    after_layer=lambda i: worker.save_layer(plan, f"model.layers.{i}.self_attn"))
            worker.save(plan)
        sync()
        return time.perf_counter() - t0

    cases = ["resident", "compute all", "load", "save"] + (["load, base", "save, base"] if args.base_file else [])
    times: dict[str, list[float]] = {c: [] for c in cases}
    for c in cases:  # warm-up: kernels, pinned-memory pools
        step(c)
        step(c)
    exact = {}
    for label, worker in workers.items():  # each worker's load puts back exactly the blocks it saved
        for t in kv:
            t.zero_()
        worker.load(StepPlan(loads=loads))
        worker.save(StepPlan())  # waits for every layer's copies
        exact[label or "this"] = all(torch.equal(kv[i][:n_cached].cpu(), cached_kv[i]) for i in range(shape.layers))
    for _ in range(args.repeats):
        for c in cases:
            times[c].append(step(c))
    med = {c: statistics.median(v) * 1e3 for c, v in times.items()}
    # the copies alone, for the bandwidth they reach
    load_only = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        workers[""].load(StepPlan(loads=loads))
        workers[""].wait_loads()
        sync()
        load_only.append(time.perf_counter() - t0)
    out = {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)", "torch": torch.__version__, "shape": args.shape, "dtype": args.dtype,
        "block_size": bs, "cached_tokens": args.cached_tokens, "new_tokens": args.new_tokens,
        "loaded_mib": n_cached * block_bytes / 2**20, "saved_mib": n_new * block_bytes / 2**20,
        "median_ms": med, "load_alone_ms": statistics.median(load_only) * 1e3,
        "load_gbps": n_cached * block_bytes / statistics.median(load_only) / 1e9,
        "loaded_blocks_exact": exact, "repeats": args.repeats,
    }
    per_layer = (shape.hidden * (shape.heads + 2 * shape.kv_heads) * shape.head_size + shape.heads * shape.head_size
                 * shape.hidden + 3 * shape.hidden * shape.intermediate)
    flops = 2 * args.new_tokens * per_layer * shape.layers  # the GEMMs; attention adds a little
    out["resident_gemm_tflops"] = flops / (med["resident"] / 1e3) / 1e12
    out["load_cost_ms"] = med["load"] - med["resident"]
    out["save_cost_ms"] = med["save"] - med["resident"]
    if args.base_file:
        out["load_cost_base_ms"] = med["load, base"] - med["resident"]
        out["save_cost_base_ms"] = med["save, base"] - med["resident"]
        out["load_step_vs_base"] = med["load"] / med["load, base"]
        out["save_step_vs_base"] = med["save"] / med["save, base"]
    out["load_step_vs_compute_all"] = med["load"] / med["compute all"]
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if not all(exact.values()):
        sys.exit("the host tier's blocks differ from what the forward pass wrote")


if __name__ == "__main__":
    main()
