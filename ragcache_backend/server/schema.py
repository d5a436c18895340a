"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests accept every field the ``openai`` client and the LangChain / LlamaIndex OpenAI wrappers
send; a field of an unsupported feature is accepted only at its default ("off") value, and
:meth:`ChatCompletionRequest.unsupported` names the first one that is not. Unknown fields are
refused (``extra="forbid"``). ragcache's own extensions: ``documents``, ``reuse``, ``cache_salt``
in requests; the ``ragcache`` object in responses.

vLLM's extensions are honoured so that a client written for vLLM (our adapters' ``base_url=``
mode among them) works unchanged: the sampling fields ``top_k``, ``min_p``,
``repetition_penalty``; ``structured_outputs`` (``json``, ``json_object``, ``regex``, ``choice``,
``grammar``: a Lark grammar); ``return_token_ids`` (the generated token ids in
``choices[].token_ids``; streamed, all of them in the chunk that carries ``finish_reason``, where
vLLM sends each chunk's own); ``kv_transfer_params`` (a KV connector's per-request parameters:
accepted and ignored, as this server's cache is built in). Accepted and ignored because they
change nothing here: ``request_id``, ``priority`` (no priority scheduling; every request is
first come, first served), ``spaces_between_special_tokens`` (special tokens are never in the
text), ``chat_template_kwargs`` (the supported models' templates take none). Accepted only at
their defaults: ``skip_special_tokens`` (true), ``min_tokens`` (0), ``ignore_eos`` (false),
``include_stop_str_in_output`` (false), ``add_generation_prompt`` (true), ``echo`` (false),
``prompt_logprobs`` (none).

Streaming differences (documented, as for ``token_ids``): ``logprobs`` of a streamed answer come
in the chunk that carries ``finish_reason``; a streamed answer with ``tools`` (``tool_choice``
other than ``none``) is sent whole in that chunk, as content or as ``tool_calls``, since whether
the model wrote a call is known only at the end. A forced tool call (``tool_choice``
``required`` or a function) is one call unless ``parallel_tool_calls`` is true (OpenAI's default
is true; a small model allowed more keeps writing calls until ``max_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragcache_backend.engine.request import GenerationResult
from ragcache_backend.model.sampling import MAX_LOGPROBS, SEED_MAX, SEED_MIN
from ragcache_backend.prompts.builder import MAX_SALT_CHARS  # the longest salt a segment accepts

#: The most choices (``n``) one request may ask for.
MAX_CHOICES = 16

__all__ = [
    "ChatChoice", "ChatCompletion", "ChatCompletionChunk", "ChatCompletionRequest", "ChatLogprobs",
    "ChatMessage", "ChunkChoice", "CompletionChoice", "CompletionChunk", "CompletionLogprobs",
    "CompletionRequest", "CompletionResponse", "DeltaMessage", "DetokenizeRequest", "DetokenizeResponse",
    "Embedding", "EmbeddingRequest", "EmbeddingResponse", "EmbeddingUsage", "ErrorBody", "ErrorResponse",
    "ExplicitDocument", "FunctionCall", "HealthResponse", "MAX_CHOICES", "ModelCard", "ModelList",
    "PromptTokensDetails", "RAGCacheInfo", "ResponseMessage", "StreamOptions", "TextPart", "TokenLogprob",
    "TokenizeRequest", "TokenizeResponse", "ToolCallDelta", "ToolCallOut", "TopTokenLogprob", "Usage",
]


def _utf8_only(value: Any) -> None:
    """Raise ValueError on a string UTF-8 cannot encode (a lone UTF-16 surrogate, which JSON's
    ``\\ud800`` escapes can carry), anywhere in ``value`` (dicts, lists, keys included)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text must be valid Unicode: a lone surrogate at character {exc.start}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _utf8_only(key)
            _utf8_only(item)
    elif isinstance(value, list):
        for item in value:
            _utf8_only(item)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Request(_Strict):
    """A request body: every string in it (nested objects included, checked once here) must be
    text the tokenizer can take (a 400, not a crash inside)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _utf8_only(data)
        return data


class _Open(BaseModel):
    """A sub-object whose unknown keys are ignored (clients add vendor keys to these)."""

    model_config = ConfigDict(extra="ignore")


# ---- requests ---------------------------------------------------------------------------------------
class ExplicitDocument(_Strict):
    """A document passed in the request body: ``id`` (default: the content hash) and its text."""

    id: str | None = Field(None, min_length=1, max_length=256)
    text: str = Field(..., min_length=1)


class StreamOptions(_Open):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` (and no choices)."""

    include_usage: bool | None = False
    include_obfuscation: bool | None = None


class TextPart(_Open):
    """One part of a message's content list; only ``type == "text"`` is accepted (checked later)."""

    type: str
    text: str | None = None


class ChatMessage(_Open):
    """One chat message. Roles: system, developer (as system), user, assistant, tool."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None


class _GenerationFields(_Request):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # ragcache extensions
    documents: list[str | ExplicitDocument] | None = None
    reuse: Literal["exact", "chunk", "auto"] | None = None
    cache_salt: str | None = Field(None, max_length=MAX_SALT_CHARS)
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    structured_outputs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    request_id: str | None = None
    priority: int | None = None
    spaces_between_special_tokens: bool | None = None
    skip_special_tokens: bool | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None

    def _common_unsupported(self) -> tuple[str, str] | None:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            return "stop", "at most 4 stop sequences"
        defaults = {"skip_special_tokens": True, "min_tokens": 0, "ignore_eos": False,
                    "include_stop_str_in_output": False, "prompt_logprobs": None}
        for name, default in defaults.items():
            value = getattr(self, name)
            if value is not None and value != default:
                return name, f"{name} is only accepted at its default ({default})"
        return None

    @property
    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with token-id keys.

        Raises:
            ValueError: a key that is not a token id (the service answers 400)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            bias[int(key)] = value
        return bias

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty strings dropped)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM extensions (chat only)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    echo: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, message)`` of the first field set to a value this server cannot honour."""
        common = self._common_unsupported()
        if common:
            return common
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.functions or self.function_call not in (None, "none", "auto"):
            return ("functions" if self.functions else "function_call"), \
                "the legacy functions API is not supported; use tools and tool_choice"
        if self.response_format and self.tools and self.tool_choice not in (None, "none"):
            return "response_format", "response_format and tools cannot both constrain one answer"
        if self.response_format and self.structured_outputs:
            return "structured_outputs", "give either response_format or structured_outputs"
        if self.add_generation_prompt is False:
            return "add_generation_prompt", "add_generation_prompt is only accepted at its default (true)"
        if self.echo:
            return "echo", "echo is not supported"
        if self.modalities and set(self.modalities) != {"text"}:
            return "modalities", "only the text modality is supported"
        for name in ("audio", "prediction", "web_search_options"):
            if getattr(self, name):
                return name, f"{name} is not supported"
        if self.reasoning_effort:
            return "reasoning_effort", "reasoning_effort is not supported"
        return None

    @property
    def token_limit(self) -> tuple[str, int | None]:
        """``(field name, value)`` of the generation limit: ``max_completion_tokens`` wins."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(_GenerationFields):
    """``POST /v1/completions`` (one text prompt; token-id prompts are refused)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, message)`` of the first field set to a value this server cannot honour."""
        common = self._common_unsupported()
        if common:
            return common
        if isinstance(self.prompt, list) and (len(self.prompt) != 1 or not isinstance(self.prompt[0], str)):
            return "prompt", "prompt must be one string (token ids and batches are not supported)"
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1, self.n):
            return "best_of", "best_of must equal n (the answers are not ranked)"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return None

    @property
    def token_limit(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    @property
    def prompt_text(self) -> str:
        """The prompt as one string (after :meth:`unsupported` passed)."""
        return self.prompt if isinstance(self.prompt, str) else str(self.prompt[0])


# ---- responses --------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    """Token counts; ``prompt_tokens_details.cached_tokens`` = prompt tokens served from the cache."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, results: Sequence[GenerationResult]) -> Usage:
        """The counts of one request's choices: its prompt once, every choice's completion."""
        completion = sum(len(r.token_ids) for r in results)
        return cls(prompt_tokens=results[0].prompt_tokens, completion_tokens=completion,
                   total_tokens=results[0].prompt_tokens + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=results[0].cached_tokens))


class RAGCacheInfo(BaseModel):
    """The ``ragcache`` extension object: what the cache did for this request.

    Attributes:
        cached_tokens: prompt tokens whose KV was reused (chunk_cached_tokens included).
        computed_tokens: prompt tokens run through the model (recomputed_tokens included).
        recomputed_tokens: tokens of reused chunks recomputed (chunk modes).
        chunk_cached_tokens: tokens served from chunk caches at another position (chunk modes).
        device_hits, host_hits, disk_hits: reused nodes found in each tier (disk: 0 until the disk
            tier reports per-request hits).
        documents: ids of the recognised documents, in prompt order.
        reuse: the reuse mode the request ran in.
        ttft_s: seconds from submission to the first token.
    """

    cached_tokens: int
    computed_tokens: int
    recomputed_tokens: int
    chunk_cached_tokens: int
    device_hits: int
    host_hits: int
    disk_hits: int
    documents: list[str]
    reuse: str
    ttft_s: float

    @classmethod
    def of(cls, result: GenerationResult) -> RAGCacheInfo:
        return cls(cached_tokens=result.cached_tokens, computed_tokens=result.computed_tokens,
                   recomputed_tokens=result.recomputed_tokens, chunk_cached_tokens=result.chunk_cached_tokens,
                   device_hits=result.device_hits, host_hits=result.host_hits,
                   disk_hits=int(getattr(result, "disk_hits", 0) or 0), documents=list(result.documents),
                   reuse=result.reuse, ttft_s=result.ttft_s)


class TopTokenLogprob(BaseModel):
    """An alternative token of chat ``logprobs``: its text, natural-log probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopTokenLogprob):
    """A generated token of chat ``logprobs``, with the ``top_logprobs`` most likely alternatives."""

    top_logprobs: list[TopTokenLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """``logprobs`` of ``/v1/completions`` (the legacy shape)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCallOut):
    index: int


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's extension)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    ragcache: RAGCacheInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids: every generated id, in the finishing chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    ragcache: RAGCacheInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids (streamed: in the finishing chunk)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    ragcache: RAGCacheInfo


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    ragcache: RAGCacheInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragcache"
    max_model_len: int | None = None  # the context window in tokens (vLLM's field name)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    """``GET /health``: ``status`` is ``ok``; ``starting`` while the model loads and ``draining``
    while shutting down (both HTTP 503)."""

    status: Literal["ok", "starting", "draining"]
    model: str
    in_flight: int
    waiting: int
    running: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody



# ---- token and embedding utilities ------------------------------------------------------------------
class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's): a ``prompt`` as is, or chat ``messages`` through the chat template
    (with the assistant turn opened), as generation would see them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``: the retrieval embedder's vectors (L2-normalised float32)."""

    input: str | list[str] = Field(..., min_length=1)
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
