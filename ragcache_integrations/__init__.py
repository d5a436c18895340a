"""Framework adapters for ragcache (SPEC §3): :mod:`ragcache_integrations.langchain`,
:mod:`ragcache_integrations.llamaindex` and :mod:`ragcache_integrations.vllm` (a KV connector).

Shared here: the process-wide default engine and stores, the recognizer of known documents, and
the errors the adapters add to :mod:`ragcache_backend.errors`. They are imported on first use, so
that importing :mod:`ragcache_integrations.vllm` inside vLLM's processes does not load our engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ragcache_integrations._runtime import (
        TRANSIENT_ERRORS,
        GenerationTimeoutError,
        UnsupportedContentError,
        default_engine,
        default_store,
        known_documents,
    )
    from ragcache_integrations._server import ServerError

__all__ = ["TRANSIENT_ERRORS", "GenerationTimeoutError", "ServerError", "UnsupportedContentError", "default_engine",
           "default_store", "known_documents"]


def __getattr__(name: str) -> Any:
    if name == "ServerError":  # raised by the adapters' base_url= mode
        return importlib.import_module("ragcache_integrations._server").ServerError
    if name in __all__:
        return getattr(importlib.import_module("ragcache_integrations._runtime"), name)
    raise AttributeError(f"module 'ragcache_integrations' has no attribute {name!r}")
