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
]
__version__ = "0.1.0"

_WHERE = {
    "DocumentStore": "ragcache_backend.docstore",
    "EngineConfig": "ragcache_backend.config",
    "GenerationResult": "ragcache_backend.engine",
    "RAGCacheEngine": "ragcache_backend.engine",
    "SamplingParams": "ragcache_backend.sampling",
    "StreamChunk": "ragcache_backend.engine",
}

if TYPE_CHECKING:
    from ragcache_backend.config import EngineConfig
    from ragcache_backend.docstore import DocumentStore
    from ragcache_backend.engine import GenerationResult, RAGCacheEngine, StreamChunk
    from ragcache_backend.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'ragcache_backend' has no attribute {name!r}")
