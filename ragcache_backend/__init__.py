"""ragcache backend: document-level KV caching for retrieval-augmented generation (RAGCache).

Heavy modules (torch, transformers, faiss) load on first use of the names below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "DocumentStore",
    "EngineConfig",
    "GenerationResult",
    "RAGCacheEngine",
    "SamplingParams",
    "StreamChunk",
    "build_index",
]
__version__ = "0.1.0"

_WHERE = {
    "DocumentStore": "ragcache_backend.retrieval.docstore",
    "EngineConfig": "ragcache_backend.config",
    "GenerationResult": "ragcache_backend.engine.request",
    "RAGCacheEngine": "ragcache_backend.engine.engine",
    "SamplingParams": "ragcache_backend.model.sampling",
    "StreamChunk": "ragcache_backend.engine.request",
    "build_index": "ragcache_backend.retrieval.docstore",
}

if TYPE_CHECKING:
    from ragcache_backend.config import EngineConfig
    from ragcache_backend.retrieval.docstore import DocumentStore
    from ragcache_backend.engine.engine import GenerationResult, RAGCacheEngine, StreamChunk
    from ragcache_backend.model.sampling import SamplingParams
    from ragcache_backend.retrieval.docstore import build_index


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'ragcache_backend' has no attribute {name!r}")
