"""Framework adapters for ragcache (SPEC §3): :mod:`ragcache_integrations.langchain` and
:mod:`ragcache_integrations.llamaindex`.

Shared here: the process-wide default engine and stores, the recognizer of known documents, and
the errors the adapters add to :mod:`ragcache_backend.errors`.
"""

from ragcache_integrations._runtime import (
    TRANSIENT_ERRORS,
    GenerationTimeoutError,
    UnsupportedContentError,
    default_engine,
    default_store,
    known_documents,
)

__all__ = ["TRANSIENT_ERRORS", "GenerationTimeoutError", "UnsupportedContentError", "default_engine",
           "default_store", "known_documents"]
