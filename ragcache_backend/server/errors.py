"""OpenAI-shaped API errors: :class:`APIError` and the mapping of engine errors to HTTP statuses."""

from __future__ import annotations

from ragcache_backend.engine.engine import EngineClosedError
from ragcache_backend.errors import (
    CacheBudgetError,
    ContextWindowError,
    InvalidRequestError,
    RAGCacheError,
    RequestCancelledError,
)
from ragcache_backend.server.schema import ErrorBody, ErrorResponse

__all__ = ["APIError", "from_engine_error"]


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status``.

    Args:
        status: HTTP status (4xx: the client's fault; 5xx: the server's).
        message: what went wrong and what to change.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``,
            ``server_error``...).
        param: the request field at fault, if any.
        code: a machine-readable code (``context_length_exceeded``, ``model_not_found``...).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))

    @property
    def message(self) -> str:
        return self.body.error.message


def from_engine_error(exc: BaseException) -> APIError:
    """The API error for an exception the engine raised (unknown exceptions: 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextWindowError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, CacheBudgetError):
        return APIError(400, f"{exc} (the prompt is larger than the server's KV cache can ever hold)",
                        code="context_length_exceeded")
    if isinstance(exc, EngineClosedError):
        return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    if isinstance(exc, RequestCancelledError):
        return APIError(503, "the request was cancelled (the server is shutting down)", type="server_error",
                        code="cancelled")
    if isinstance(exc, RAGCacheError):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
