"""The parameters every ragcache model adapter takes (LangChain and LlamaIndex alike).

:class:`RAGCacheParams` is a pydantic mixin: ``ChatRAGCache(RAGCacheParams, BaseChatModel)``,
``RAGCacheLLM(RAGCacheParams, CustomLLM)``... It holds the standard sampling knobs, ``timeout``
and ``max_retries``, and turns a segmented prompt plus per-call overrides into a
:class:`~ragcache_integrations._runtime.Generation`, or, given ``base_url``, chat turns or a
text prompt into a :class:`~ragcache_integrations._server.ServerGeneration` sent to an
OpenAI-compatible server (``ragcache serve``, or vLLM with our KV connector).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.grammar import Grammar
from ragcache_backend.model.loader import DEFAULT_MODEL_NAME
from ragcache_backend.prompts.builder import Segment
from ragcache_backend.prompts.recognition import ChatTurn, DocumentRecognizer, PromptSegmenter, SegmentedPrompt
from ragcache_backend.prompts.tools import Tool, parse_tool_choice, parse_tools, tool_grammar, with_tools
from ragcache_backend.model.sampling import SamplingParams
from ragcache_integrations._runtime import Generation, default_engine, engine_for, known_documents, segmenter
from ragcache_integrations._server import ServerClient, ServerDocument, ServerError, ServerGeneration, server_client
from ragcache_integrations._speculation import speculation_board

__all__ = ["CALL_OVERRIDES", "CompletionParams", "RAGCacheParams"]

#: Keyword arguments a single call may pass to override the instance's settings.
CALL_OVERRIDES = frozenset({"temperature", "max_tokens", "top_p", "seed", "use_cache", "timeout", "model", "reuse",
                            "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                            "logit_bias"})


class RAGCacheParams(BaseModel):
    """Engine, sampling and reliability settings of a ragcache model adapter."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())

    engine: RAGCacheEngine | None = Field(
        default=None, exclude=True,
        description="the engine that runs requests; None = the process-wide default engine "
                    "(SmolLM2-135M-Instruct), built on first use")
    model: str | None = Field(
        default=None,
        description="the model to run when no engine is given: a .gguf file, a Hugging Face folder or a packaged "
                    "model's name (SmolLM2-135M-Instruct); one engine per model per process, shared by adapters; "
                    "None = the default model")
    model_name: str | None = Field(
        default=None, description="model name reported in responses; None = the engine's model")
    temperature: float = Field(default=0.0, ge=0.0, description="sampling temperature; 0 = greedy")
    max_tokens: int = Field(default=256, ge=1, description="most tokens to generate per call")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling mass; 1 = off")
    seed: int | None = Field(default=None, description="sampler seed (used when temperature > 0)")
    top_k: int = Field(default=0, ge=-1, description="sample among the k most likely tokens; 0 or -1 = off")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0,
                         description="drop tokens below min_p times the most likely one's probability; 0 = off")
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, description="divide (positive) or multiply (negative) the logits of tokens already "
                                         "in the prompt or the answer; 1 = off, 1.1-1.3 stops most loops")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                    description="subtracted from the logit of every token the answer holds")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                     description="subtracted once per occurrence in the answer")
    logit_bias: dict[int, float] | None = Field(default=None, description="token id -> bias in [-100, 100]")
    stop: list[str] | None = Field(
        default=None, description="strings that end generation; the matched string is not returned")
    timeout: float | None = Field(
        default=None, gt=0,
        description="seconds per attempt, after which the request is cancelled at its next decode "
                    "step; None = no limit")
    max_retries: int = Field(
        default=2, ge=0,
        description="further attempts after a timed-out attempt; input errors and prompts that "
                    "can never fit the device KV arena are never retried (a momentarily full arena "
                    "is no error: the request waits for room)")
    use_cache: bool | None = Field(
        default=None,
        description="None = the engine's setting; False = recompute every prompt (the baseline)")
    reuse: Literal["exact", "chunk", "auto"] | None = Field(
        default=None,
        description="None = the engine's setting; exact: reuse only exact prefixes (answers equal those "
                    "without the cache); auto: also reuse known documents anywhere in the prompt from "
                    "chunk caches (Cache-Craft; approximate, guarded); chunk: documents from chunk caches only")
    recognizer: DocumentRecognizer | None = Field(
        default=None, exclude=True,
        description="the known documents to recognise in prompts; None = the process-wide one, "
                    "which watches every store our retrievers and engines use")
    base_url: str | None = Field(
        default=None,
        description="send generation to this OpenAI-compatible server instead of an embedded engine: "
                    "ragcache serve (documents found in the prompt are sent with it) or vLLM with "
                    "RAGCacheConnector, e.g. http://127.0.0.1:8000/v1; None = the embedded engine")
    api_key: SecretStr | None = Field(
        default=None, exclude=True,
        description="the server's bearer key (base_url mode); None = $RAGCACHE_API_KEY, else none")

    @model_validator(mode="after")
    def _one_backend(self):
        if self.base_url is not None and self.engine is not None:
            raise ValueError("give either engine= (embedded) or base_url= (a server), not both")
        if self.model is not None and (self.engine is not None or self.base_url is not None):
            raise ValueError("model= picks the embedded engine's model; with engine= or base_url= the model is theirs")
        return self

    def server(self) -> ServerClient | None:
        """The server generation goes to (``base_url``), or None for the embedded engine."""
        if self.base_url is None:
            return None
        key = self.api_key.get_secret_value() if self.api_key else os.environ.get("RAGCACHE_API_KEY") or "EMPTY"
        return server_client(self.base_url, key, max_retries=self.max_retries)

    def resolved_engine(self) -> RAGCacheEngine:
        """The engine (the default one is built on first use).

        Raises InvalidRequestError in ``base_url`` mode (there is no local engine)."""
        if self.base_url is not None:
            raise InvalidRequestError(f"this adapter sends generation to {self.base_url}; it has no local engine")
        if self.engine is not None:
            return self.engine
        return engine_for(self.model) if self.model is not None else default_engine()

    def target(self) -> RAGCacheEngine | ServerClient:
        """Where requests run: the ``base_url`` server's client, else the engine (speculative
        pipelining reads its pool: ``waiting_requests`` against ``max_prefill_bs``)."""
        return self.server() or self.resolved_engine()

    def reported_model_name(self) -> str:
        """``model_name``, else the engine's model name (without building the default engine), or
        in ``base_url`` mode the server's (asked once)."""
        if self.model_name:
            return self.model_name
        server = self.server()
        if server is not None:
            return server.info().model
        if self.engine is None and self.model is not None:
            return self.resolved_engine().model_name
        return self.engine.model_name if self.engine is not None else DEFAULT_MODEL_NAME

    def context_window(self) -> int:
        """The model's context in tokens: the engine's, or the server's ``max_model_len``.

        Raises ServerError when the server is unreachable or does not say."""
        server = self.server()
        if server is None:
            return self.resolved_engine().loaded.context_window
        window = server.info().context_window
        if window is None:
            raise ServerError(f"{self.base_url} does not give its context window (max_model_len)")
        return window

    def prompt_segmenter(self, overrides: Mapping[str, Any] | None = None) -> PromptSegmenter:
        """Cuts prompts for the engine's tokenizer at the documents ``recognizer`` knows; in a chunk
        reuse mode (this call's, else the instance's, else the engine's) documents are tokenised on
        their own, so that their KV can be reused at any position."""
        engine = self.resolved_engine()
        mode = (overrides or {}).get("reuse", self.reuse) or engine.config.reuse
        return segmenter(engine, self.recognizer, documents_alone=mode != "exact")

    def chat_generation(self, turns: Sequence[ChatTurn], stop: Sequence[str] | None = None,
                        overrides: Mapping[str, Any] | None = None, *,
                        grammar: Grammar | None = None) -> Generation | ServerGeneration:
        """A ready request for chat ``turns`` (see :meth:`generation`); ``grammar`` constrains the
        answer (tool calls, structured output).

        When the turns hold the documents one of our retrievers just returned and the query it
        searched for, their shape is learned, so that retriever's next search can speculate on
        this prompt with its candidates (:mod:`ragcache_integrations._speculation`).
        """
        over = dict(overrides or {})
        if self.base_url is not None:
            def make(chat: Sequence[ChatTurn]) -> Generation | ServerGeneration:
                return self.server_generation(tuple(chat), "", stop, over, grammar=grammar)
        else:
            def make(chat: Sequence[ChatTurn]) -> Generation | ServerGeneration:
                return self.generation(self.prompt_segmenter(over).chat(chat).segments, stop, over, grammar=grammar)

        generation = make(turns)
        speculation_board().learn(turns, self.recognizer or known_documents(), make, generation.target)
        return generation

    def tool_chat_generation(self, turns: Sequence[ChatTurn], stop: Sequence[str] | None = None,
                             overrides: Mapping[str, Any] | None = None, *, tools: Sequence[Mapping[str, Any]] = (),
                             tool_choice: str | Mapping[str, Any] | None = None,
                             parallel_tool_calls: bool | None = None,
                             response_format: Mapping[str, Any] | None = None,
                             ) -> tuple[Generation | ServerGeneration, tuple[Tool, ...]]:
        """A ready request for chat ``turns`` that offers ``tools`` (OpenAI function format), and
        the tools whose calls are to be parsed out of its answer (empty when none are offered or
        ``tool_choice`` is ``none``). A forced choice (``required``, a function) constrains the
        answer to well-formed calls (:func:`~ragcache_backend.prompts.tools.tool_grammar`): one,
        or one or more when ``parallel_tool_calls`` is True. Otherwise OpenAI's
        ``response_format`` (``json_object``, ``json_schema``) holds the answer to its shape.

        Raises:
            ToolError: a tool that is not a valid function definition, a choice naming no tool.
            GrammarError: a malformed ``response_format``.
        """
        parsed = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, parsed)
        shape = Grammar.response_format(response_format) if response_format is not None else None
        if not parsed or choice.mode == "none":
            return self.chat_generation(turns, stop, overrides, grammar=shape), ()
        grammar = tool_grammar(parsed, choice, parallel=parallel_tool_calls is True) or shape
        return self.chat_generation(with_tools(turns, parsed), stop, overrides, grammar=grammar), parsed

    def server_generation(self, turns: Sequence[ChatTurn], prompt: str, stop: Sequence[str] | None = None,
                          overrides: Mapping[str, Any] | None = None, *,
                          grammar: Grammar | None = None) -> ServerGeneration:
        """A ready request for the ``base_url`` server: ``turns`` through its chat template, or
        when there are none, ``prompt`` completed as raw text; the known documents inside are sent
        along (to ``ragcache serve``).

        Raises InvalidRequestError as :meth:`generation`, and for ``use_cache=False`` (a server
        cannot be told to skip its cache per request).
        """
        server = self.server()
        assert server is not None, "server_generation needs base_url"
        over = dict(overrides or {})
        sampling = self._sampling(stop, over, grammar)
        if over.get("use_cache", self.use_cache) is False:
            raise InvalidRequestError("use_cache=False needs the embedded engine; a server always uses its cache")
        recognizer = self.recognizer or known_documents()
        documents: dict[str, ServerDocument] = {}
        for text in [t.content for t in turns] if turns else [prompt]:
            for span in recognizer.find(text):
                documents.setdefault(span.doc_id, ServerDocument(span.doc_id, text[span.start:span.end]))
        reuse = over.get("reuse", self.reuse)
        self._check_reuse(reuse)
        return ServerGeneration(server, "chat" if turns else "completion", tuple(turns), prompt,
                                tuple(documents.values()), sampling, reuse=reuse,
                                timeout=over.get("timeout", self.timeout), max_retries=self.max_retries)

    def generation(self, segments: Sequence[Segment], stop: Sequence[str] | None = None,
                   overrides: Mapping[str, Any] | None = None, *, grammar: Grammar | None = None) -> Generation:
        """A ready request: instance settings, then ``stop`` and per-call ``overrides``; ``grammar``
        constrains the answer.

        Raises InvalidRequestError for an unknown override, or a ``model`` other than this one.
        """
        over = dict(overrides or {})
        sampling = self._sampling(stop, over, grammar)
        reuse = over.get("reuse", self.reuse)
        self._check_reuse(reuse)
        return Generation(self.resolved_engine(), tuple(segments), sampling,
                          use_cache=over.get("use_cache", self.use_cache),
                          timeout=over.get("timeout", self.timeout), max_retries=self.max_retries, reuse=reuse)

    def _sampling(self, stop: Sequence[str] | None, over: Mapping[str, Any],
                  grammar: Grammar | None = None) -> SamplingParams:
        """Sampling from the instance's settings, ``stop`` and per-call ``over``-rides.

        Raises InvalidRequestError for an unknown override, or a ``model`` other than this one.
        """
        unknown = set(over) - CALL_OVERRIDES
        if unknown:
            raise InvalidRequestError(f"unsupported call arguments {sorted(unknown)}; "
                                      f"supported: {sorted(CALL_OVERRIDES)}")
        model = over.get("model")
        if model is not None and model != self.reported_model_name():
            raise InvalidRequestError(f"this adapter serves {self.reported_model_name()!r}, not {model!r}")
        return SamplingParams(
            max_tokens=over.get("max_tokens", self.max_tokens),
            temperature=over.get("temperature", self.temperature),
            top_p=over.get("top_p", self.top_p),
            stop=tuple(stop if stop is not None else self.stop or ()),
            seed=over.get("seed", self.seed),
            top_k=over.get("top_k", self.top_k),
            min_p=over.get("min_p", self.min_p),
            repetition_penalty=over.get("repetition_penalty", self.repetition_penalty),
            presence_penalty=over.get("presence_penalty", self.presence_penalty),
            frequency_penalty=over.get("frequency_penalty", self.frequency_penalty),
            logit_bias=over.get("logit_bias", self.logit_bias) or (),
            grammar=grammar,
        )

    @staticmethod
    def _check_reuse(reuse: object) -> None:
        if reuse not in (None, "exact", "chunk", "auto"):
            raise InvalidRequestError(f"reuse must be 'exact', 'chunk' or 'auto', got {reuse!r}")


class CompletionParams(RAGCacheParams):
    """:class:`RAGCacheParams` of adapters that also take plain-text prompts (completion APIs)."""

    chat_template: bool = Field(
        default=True,
        description="send a text prompt as one user message in the model's chat template (instruct "
                    "models); False = complete the raw text")

    def segment_completion(self, prompt: str, overrides: Mapping[str, Any] | None = None) -> SegmentedPrompt:
        """A text prompt cut for the engine (wrapped in the chat template unless ``chat_template`` is off)."""
        cutter = self.prompt_segmenter(overrides)
        return cutter.chat([ChatTurn("user", prompt)]) if self.chat_template else cutter.raw(prompt)

    def completion_generation(self, prompt: str, stop: Sequence[str] | None = None,
                              overrides: Mapping[str, Any] | None = None) -> Generation | ServerGeneration:
        """A ready request for a text prompt: on the embedded engine (:meth:`segment_completion`),
        or on the ``base_url`` server (one user message through its chat template, or the raw
        text to its completions endpoint when ``chat_template`` is off)."""
        if self.base_url is not None:
            turns = (ChatTurn("user", prompt),) if self.chat_template else ()
            return self.server_generation(turns, prompt, stop, overrides)
        return self.generation(self.segment_completion(prompt, overrides).segments, stop, overrides)
