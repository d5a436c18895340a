"""``ragcache serve``: an OpenAI-compatible HTTP server over one :class:`RAGCacheEngine`.

Modules: :mod:`.settings` (what the server is told: flags, ``RAGCACHE_*`` environment, config
file), :mod:`.schema` (request and response bodies), :mod:`.errors` (OpenAI-shaped errors),
:mod:`.prompting` (chat messages and explicit documents to engine segments), :mod:`.metrics`
(Prometheus), :mod:`.service` (one request's life on the engine), :mod:`.app` (the FastAPI app
and the uvicorn runner with graceful drain).

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client, pydantic-settings).
"""

from __future__ import annotations

__all__ = ["ServerSettings", "create_app", "load_settings", "serve"]


def __getattr__(name: str):
    if name in ("ServerSettings", "load_settings"):
        from ragcache_backend.server import settings

        return getattr(settings, name)
    if name in ("create_app", "serve"):
        from ragcache_backend.server import app

        return getattr(app, name)
    raise AttributeError(name)
