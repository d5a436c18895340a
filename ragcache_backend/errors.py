"""Typed errors raised by ragcache.

Every failure a user can cause (bad question, bad model path, bad corpus, budgets too small,
corrupt files) surfaces as a subclass of :class:`RAGCacheError` with a message that says what to
change. The CLI turns these into a one-line message and a non-zero exit code; nothing deeper in
the stack should leak a raw traceback for such input.
"""

from __future__ import annotations


class RAGCacheError(Exception):
    """Base class of every error ragcache raises on purpose."""


class InvalidRequestError(RAGCacheError, ValueError):
    """A request is malformed (empty question, bad sampling parameters, bad segments)."""


class EmptyQueryError(InvalidRequestError):
    """The question is empty or whitespace only."""


class ContextWindowError(InvalidRequestError):
    """The prompt (plus the tokens to generate) does not fit the model's context window."""


class ModelLoadError(RAGCacheError):
    """The model path is missing, not a Llama-family checkpoint, or fails to load."""


class CorpusError(RAGCacheError):
    """The corpus folder is missing, empty, or holds no readable documents."""


class CacheBudgetError(RAGCacheError):
    """A tier's byte budget is too small for what was asked (e.g. one document's KV)."""


class CorruptFileError(RAGCacheError):
    """A persisted file (profile, index, document store, KV file) fails its checksum or schema."""


class ConfigError(RAGCacheError, ValueError):
    """Settings that cannot be used as given (e.g. a KL target with no calibration for the model)."""


class UnknownPolicyError(RAGCacheError, ValueError):
    """A replacement policy name is not registered."""


class RequestCancelledError(RAGCacheError):
    """The request was cancelled before it finished."""


class RetrievalError(RAGCacheError):
    """The vector search failed or ran past its deadline (a pipelined request fails with it and
    its speculative work is freed)."""
