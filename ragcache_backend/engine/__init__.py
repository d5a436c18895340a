"""The engine: request lifecycle, scheduler and the one step loop every caller drives.

``from ragcache_backend.engine import RAGCacheEngine`` keeps working (the names load lazily).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "RAGCacheEngine": "ragcache_backend.engine.engine",
    "GenerationResult": "ragcache_backend.engine.request",
    "StreamChunk": "ragcache_backend.engine.request",
    "ChunkReuse": "ragcache_backend.engine.request",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'ragcache_backend.engine' has no attribute {name!r}")
