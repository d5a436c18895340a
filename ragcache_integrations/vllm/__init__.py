"""ragcache as vLLM's KV cache: :class:`RAGCacheConnector`, a vLLM v1 KV connector (``docs/vllm.md``).

vLLM imports this module in its API server, engine and worker processes, so it stays cheap: the
connector (and vLLM itself) is imported when vLLM asks for ``RAGCacheConnector``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RAGCacheConnector", "SUPPORTED_VLLM"]

SUPPORTED_VLLM: tuple[str, ...] = ("0.32",)
"""vLLM major.minor versions the connector is tested with; another version is refused at start."""


def __getattr__(name: str) -> Any:
    if name == "RAGCacheConnector":
        from ragcache_integrations.vllm.connector import RAGCacheConnector

        return RAGCacheConnector
    raise AttributeError(f"module 'ragcache_integrations.vllm' has no attribute {name!r}")
