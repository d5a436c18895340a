"""The parameters every ragcache model adapter takes (LangChain and LlamaIndex alike).

:class:`RAGCacheParams` is a pydantic mixin: ``ChatRAGCache(RAGCacheParams, BaseChatModel)``,
``RAGCacheLLM(RAGCacheParams, CustomLLM)``... It holds the standard sampling knobs, ``timeout``
and ``max_retries``, and turns a segmented prompt plus per-call overrides into a
:class:`~ragcache_integrations._runtime.Generation`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.loader import DEFAULT_MODEL_NAME
from ragcache_backend.prompts.builder import Segment
from ragcache_backend.prompts.recognition import ChatTurn, DocumentRecognizer, PromptSegmenter, SegmentedPrompt
from ragcache_backend.model.sampling import SamplingParams
from ragcache_integrations._runtime import Generation, default_engine, known_documents, segmenter
from ragcache_integrations._speculation import speculation_board

__all__ = ["CALL_OVERRIDES", "CompletionParams", "RAGCacheParams"]

#: Keyword arguments a single call may pass to override the instance's settings.
CALL_OVERRIDES = frozenset({"temperature", "max_tokens", "top_p", "seed", "use_cache", "timeout", "model", "reuse"})


class RAGCacheParams(BaseModel):
    """Engine, sampling and reliability settings of a ragcache model adapter."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())

    engine: RAGCacheEngine | None = Field(
        default=None, exclude=True,
        description="the engine that runs requests; None = the process-wide default engine "
                    "(SmolLM2-135M-Instruct), built on first use")
    model_name: str | None = Field(
        default=None, description="model name reported in responses; None = the engine's model")
    temperature: float = Field(default=0.0, ge=0.0, description="sampling temperature; 0 = greedy")
    max_tokens: int = Field(default=256, ge=1, description="most tokens to generate per call")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling mass; 1 = off")
    seed: int | None = Field(default=None, description="sampler seed (used when temperature > 0)")
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

    def resolved_engine(self) -> RAGCacheEngine:
        """The engine (the default one is built on first use)."""
        return self.engine if self.engine is not None else default_engine()

    def reported_model_name(self) -> str:
        """``model_name``, else the engine's model name (without building the default engine)."""
        if self.model_name:
            return self.model_name
        return self.engine.model_name if self.engine is not None else DEFAULT_MODEL_NAME

    def prompt_segmenter(self, overrides: Mapping[str, Any] | None = None) -> PromptSegmenter:
        """Cuts prompts for the engine's tokenizer at the documents ``recognizer`` knows; in a chunk
        reuse mode (this call's, else the instance's, else the engine's) documents are tokenised on
        their own, so that their KV can be reused at any position."""
        engine = self.resolved_engine()
        mode = (overrides or {}).get("reuse", self.reuse) or engine.config.reuse
        return segmenter(engine, self.recognizer, documents_alone=mode != "exact")

    def chat_generation(self, turns: Sequence[ChatTurn], stop: Sequence[str] | None = None,
                        overrides: Mapping[str, Any] | None = None) -> Generation:
        """A ready request for chat ``turns`` (see :meth:`generation`).

        When the turns hold the documents one of our retrievers just returned and the query it
        searched for, their shape is learned, so that retriever's next search can speculate on
        this prompt with its candidates (:mod:`ragcache_integrations._speculation`).
        """
        over = dict(overrides or {})

        def make(chat: Sequence[ChatTurn]) -> Generation:
            return self.generation(self.prompt_segmenter(over).chat(chat).segments, stop, over)

        generation = make(turns)
        speculation_board().learn(turns, self.recognizer or known_documents(), make, generation.engine)
        return generation

    def generation(self, segments: Sequence[Segment], stop: Sequence[str] | None = None,
                   overrides: Mapping[str, Any] | None = None) -> Generation:
        """A ready request: instance settings, then ``stop`` and per-call ``overrides``.

        Raises InvalidRequestError for an unknown override, or a ``model`` other than this one.
        """
        over = dict(overrides or {})
        unknown = set(over) - CALL_OVERRIDES
        if unknown:
            raise InvalidRequestError(f"unsupported call arguments {sorted(unknown)}; "
                                      f"supported: {sorted(CALL_OVERRIDES)}")
        model = over.pop("model", None)
        if model is not None and model != self.reported_model_name():
            raise InvalidRequestError(f"this adapter serves {self.reported_model_name()!r}, not {model!r}")
        stops = tuple(stop if stop is not None else self.stop or ())
        sampling = SamplingParams(
            max_tokens=over.get("max_tokens", self.max_tokens),
            temperature=over.get("temperature", self.temperature),
            top_p=over.get("top_p", self.top_p),
            stop=stops,
            seed=over.get("seed", self.seed),
        )
        reuse = over.get("reuse", self.reuse)
        if reuse not in (None, "exact", "chunk", "auto"):
            raise InvalidRequestError(f"reuse must be 'exact', 'chunk' or 'auto', got {reuse!r}")
        return Generation(self.resolved_engine(), tuple(segments), sampling,
                          use_cache=over.get("use_cache", self.use_cache),
                          timeout=over.get("timeout", self.timeout), max_retries=self.max_retries, reuse=reuse)


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
