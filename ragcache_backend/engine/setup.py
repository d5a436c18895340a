"""Building an engine's parts from its configuration: model, KV arena, prefill profile, tiers, scheduler.

Done once, before the step loop exists: load the model (:func:`~ragcache_backend.model.loader.load_model`),
size the device arena from the device budget, load or measure the prefill profile PGDSF prices
nodes with (RAGCache §5.1, measured once per model, dtype, device, CPU, kernels and thread count),
build the cache over the arena (device and host tiers, and the disk tier when configured), and
configure the scheduler. :class:`EngineParts` carries the result to
:class:`~ragcache_backend.engine.core.EngineCore`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from ragcache_backend.cache.disk import DiskStore
from ragcache_backend.cache.remote import RemoteStore
from ragcache_backend.cache.profile import DEFAULT_ALPHAS, DEFAULT_BETAS, PrefillProfile, measure_profile
from ragcache_backend.cache.tiers import TieredCache, shared_pool_blocks
from ragcache_backend.config import EngineConfig, ragcache_home
from ragcache_backend.engine.scheduler import Scheduler, SchedulerConfig
from ragcache_backend.errors import CacheBudgetError, ModelLoadError
from ragcache_backend.model.grammar import GrammarCompiler
from ragcache_backend.model.loader import LoadedModel, load_model
from ragcache_backend.model.runner import ModelRunner, kv_bytes_per_token
from ragcache_backend.prompts.builder import PromptBuilder

log = logging.getLogger(__name__)

#: The prefill profiles shipped for the default model in float32 and in bfloat16 (see :func:`reference_profile`).
REFERENCE_PROFILE = Path(__file__).with_name("reference_profile.json")
REFERENCE_PROFILE_BF16 = Path(__file__).with_name("reference_profile_bf16.json")

__all__ = ["REFERENCE_PROFILE", "REFERENCE_PROFILE_BF16", "EngineParts", "build_parts", "reference_profile", "stop_token_ids"]


@dataclass(slots=True)
class EngineParts:
    """Everything the step loop drives, built from one :class:`EngineConfig`.

    Attributes:
        config: the configuration they were built from.
        loaded: the model and tokenizer.
        runner: the forward pass over the paged KV arena (``runner.arena``).
        cache: the knowledge-tree cache over the arena's blocks, host memory and the disk tier.
        profile: the prefill profile PGDSF prices nodes with (None: another policy, or no cache).
        prompts: segments the prompts (system prompt, documents, question).
        scheduler: continuous batching and cache-aware reordering (RAGCache §5.2).
        stop_ids: token ids that end generation.
        grammars: compiles the requests' grammars (constrained decoding) against the tokenizer.
    """

    config: EngineConfig
    loaded: LoadedModel
    runner: ModelRunner
    cache: TieredCache
    profile: PrefillProfile | None
    prompts: PromptBuilder
    scheduler: Scheduler
    stop_ids: frozenset[int]
    grammars: GrammarCompiler


def build_parts(config: EngineConfig, *, loaded: LoadedModel | None = None, profile: PrefillProfile | None = None,
                scheduler: SchedulerConfig | None = None) -> EngineParts:
    """Build an engine's parts (see the module docstring).

    Raises:
        ModelLoadError: the model cannot be loaded.
        CacheBudgetError: the device budget holds less than one block, or too few to profile.
        CorruptFileError: the saved profile fails its checksum (delete it to re-measure).
    """
    cfg = config
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    loaded = loaded or load_model(cfg.model, dtype=cfg.load_dtype(), device=cfg.device)
    block_bytes = kv_bytes_per_token(loaded) * cfg.block_size
    num_blocks = cfg.device_budget_bytes // block_bytes
    if num_blocks < 1:
        raise CacheBudgetError(f"device budget {cfg.device_budget_bytes} B is below one KV block ({block_bytes} B)")
    # on a CPU the host tier lives in the arena's own memory: moves between the tiers copy nothing
    shared = cfg.host_in_arena and loaded.device.type == "cpu" and cfg.host_budget_bytes > 0 and cfg.enable_cache
    arena_blocks = shared_pool_blocks(num_blocks, cfg.host_budget_bytes, block_bytes) if shared else num_blocks
    runner = ModelRunner(loaded, num_device_blocks=arena_blocks, block_size=cfg.block_size, committed_blocks=num_blocks)
    if profile is None and cfg.policy == "pgdsf" and cfg.enable_cache:
        profile = load_or_measure_profile(cfg, loaded, runner, num_blocks)
    cache = TieredCache(
        num_blocks, cfg.block_size, cfg.host_budget_bytes, runner.arena,
        policy=cfg.policy if profile is not None or cfg.policy != "pgdsf" else "gdsf", profile=profile, shared_pool=shared)
    if cfg.disk_dir is not None and cfg.enable_cache and cfg.disk_budget_bytes > 0:
        cache.attach_disk(DiskStore(cfg.disk_dir, loaded.fingerprint, runner.kv_layout, loaded.dtype,
                                    cfg.disk_budget_bytes, policy=cache.policy_name))
    if cfg.remote_url and cfg.enable_cache:
        cache.attach_remote(RemoteStore(cfg.remote_url, loaded.fingerprint, runner.kv_layout, loaded.dtype))
    cache.configure_variants(fingerprint=f"{loaded.fingerprint}/{loaded.dtype}",
                             per_chunk=cfg.chunk_variants_per_chunk, total=cfg.chunk_max_variants)
    runner.sample_stat_layers(cfg.chunk_stat_layers)
    sched = Scheduler(scheduler or SchedulerConfig(max_batch_size=cfg.max_batch_size, max_batch_tokens=cfg.max_batch_tokens,
                                                   reorder=cfg.reorder, window=cfg.reorder_window))
    stop_ids = stop_token_ids(loaded)
    return EngineParts(cfg, loaded, runner, cache, profile, PromptBuilder(loaded.tokenizer, cfg.system_prompt), sched,
                       stop_ids, GrammarCompiler(loaded.tokenizer, stop_ids, len(loaded.tokenizer)))


def reference_profile(model: str | os.PathLike[str] | None, dtype: str, device: str | None) -> PrefillProfile | None:
    """The prefill profile shipped for the default model (SmolLM2-135M-Instruct) on the CPU, when
    ``model`` is that model and ``dtype`` (a name, or ``"auto"``:
    :func:`~ragcache_backend.model.loader.choose_dtype`) is float32 or bfloat16; None otherwise (the
    engine then measures this machine's profile, ~45 s on 2 cores, once). Measured by
    ``benchmarks/reference_profile.py`` with the engine's own procedure: float32 with 1 thread on a
    shared 2-core AMD EPYC without AVX-512 (the minimum of 2 rounds; 2-thread timings there were
    dominated by the other jobs' load), bfloat16 on the native kernels with 2 threads on a 2-core
    AMD EPYC Zen 5 with AVX512-BF16.

    PGDSF uses the profile only to rank tree nodes for eviction (cost per token of recomputing a
    node); a profile measured on another CPU differs from this one's mostly by a common factor,
    which leaves that ranking unchanged, and the demo's working set fits its device tier (nothing
    is evicted), so its figures do not depend on it. :func:`load_or_measure_profile` uses it where
    no profile was measured on this machine yet, so ``ragcache serve``, ``ask`` and ``demo`` start
    in seconds; other models measure theirs once (``cfg.profile_path`` names a file to use instead).

    Raises CorruptFileError when the shipped file fails its checksum.
    """
    from ragcache_backend.model.loader import choose_dtype, default_model_path, resolve_model

    if device not in (None, "cpu"):
        return None
    import torch

    if device is None and torch.cuda.is_available():
        return None
    try:
        if resolve_model(model).resolve() != default_model_path().resolve():
            return None
        chosen = choose_dtype(dtype, model, "cpu").dtype
    except ModelLoadError:  # no such model or dtype: the engine reports it when it loads
        return None
    shipped = {torch.float32: REFERENCE_PROFILE, torch.bfloat16: REFERENCE_PROFILE_BF16}.get(chosen)
    return None if shipped is None else PrefillProfile.load(shipped)


def load_or_measure_profile(cfg: EngineConfig, loaded: LoadedModel, runner: ModelRunner,
                            device_blocks: int | None = None) -> PrefillProfile:
    """The prefill profile from ``cfg.profile_path`` (or the per-machine file under
    ``ragcache_home()/profiles``), measured on ``runner`` and saved when absent (~15 s for the
    default model). The arena's first blocks (at most ``device_blocks``, the device tier's; None:
    the whole arena) are used as scratch: call before any request runs."""
    threads = torch.get_num_threads()
    # the cost of a prefill depends on the machine and on which kernels run it: both name the file
    path = cfg.profile_path or (
        ragcache_home() / "profiles"
        / f"{loaded.fingerprint}-{loaded.device.type}-{_machine_tag()}-{runner.kernel_tag}-t{threads}.json"
    )
    if path.exists():
        return PrefillProfile.load(path)
    if cfg.profile_path is None:
        dtype = str(loaded.dtype).removeprefix("torch.")
        shipped = reference_profile(cfg.model, dtype, cfg.device)
        if shipped is not None:  # PGDSF only ranks nodes with it: no 45 s measurement before serving
            log.info("prefill profile: the one shipped for the default model in %s; none measured on this machine",
                     dtype)
            return shipped
    cap = (device_blocks or runner.num_device_blocks) * runner.block_size
    scale = min(1.0, cap / (DEFAULT_ALPHAS[-1] + DEFAULT_BETAS[-1]))
    alphas = sorted({int(a * scale) for a in DEFAULT_ALPHAS})
    betas = sorted({max(1, int(b * scale)) for b in DEFAULT_BETAS})
    if len(alphas) < 2 or len(betas) < 2:
        raise CacheBudgetError(f"device tier of {cap} tokens is too small to profile prefill cost")
    log.info("measuring the prefill profile once (saved to %s)", path)
    runner.time_prefill(0, betas[0])  # warm-up
    profile = measure_profile(runner.time_prefill, alphas, betas, repeats=3,
                              model_fingerprint=loaded.fingerprint, dtype=str(loaded.dtype), threads=threads)
    profile.save(path)
    return profile


def stop_token_ids(loaded: LoadedModel) -> frozenset[int]:
    """The model's end-of-sequence ids (config, generation config, tokenizer) and the chat templates'
    end-of-turn tokens it knows."""
    tok, ids = loaded.tokenizer, set()
    for source in (loaded.model.config, getattr(loaded.model, "generation_config", None), tok):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple, set)) else [eos] if eos is not None else [])
    vocab = tok.get_vocab()
    ids.update(vocab[t] for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>") if t in vocab)
    return frozenset(int(i) for i in ids)


def _machine_tag() -> str:
    """A short hash of the CPU model name and feature flags (``/proc/cpuinfo``; the platform string
    elsewhere): VMs show generic names (``Intel(R) Xeon(R) Processor``) for CPUs with and without
    AMX, whose prefill costs differ ~1.4x in bf16."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    return hashlib.sha256(f"{name}|{flags}".encode()).hexdigest()[:8]
