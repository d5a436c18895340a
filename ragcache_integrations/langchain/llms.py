"""``RAGCacheLLM``: a LangChain text-completion model with transparent document-level KV reuse.

For plain-text chains (``PromptTemplate | RAGCacheLLM() | StrOutputParser()``). Each prompt is
sent as one user message in the model's chat template (right for instruct models; set
``chat_template=False`` to complete the raw text); known documents inside it are served from the
knowledge tree. Usage, with ``cache_read``, is in each generation's ``generation_info`` and in
``LLMResult.llm_output["token_usage"]`` (summed over the prompts).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation as LCGeneration
from langchain_core.outputs import GenerationChunk, LLMResult
from pydantic import Field

from ragcache_backend.engine.engine import GenerationResult, StreamChunk
from ragcache_integrations._params import CompletionParams
from ragcache_integrations._runtime import Generation
from ragcache_integrations._server import ServerGeneration
from ragcache_integrations.langchain.chat_models import response_metadata, usage_metadata

__all__ = ["RAGCacheLLM"]


class RAGCacheLLM(CompletionParams, BaseLLM):
    """LangChain LLM (string in, string out) over a :class:`~ragcache_backend.engine.engine.RAGCacheEngine`."""

    streaming: bool = Field(default=False, description="stream tokens even from invoke() (callbacks see them)")

    @property
    def _llm_type(self) -> str:
        return "ragcache"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.reported_model_name(), "temperature": self.temperature,
                "max_tokens": self.max_tokens, "chat_template": self.chat_template}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "ragcache"
        params["ls_model_name"] = kwargs.get("model") or self.reported_model_name()
        return params

    def _prepare(self, prompt: str, stop: list[str] | None, kwargs: dict) -> Generation | ServerGeneration:
        return self.completion_generation(prompt, stop, kwargs)

    def _info(self, result: GenerationResult) -> dict[str, Any]:
        return {**response_metadata(result, self.reported_model_name()), "usage_metadata": usage_metadata(result)}

    def _result(self, results: list[GenerationResult]) -> LLMResult:
        usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "cache_read": 0}
        for r in results:
            one = usage_metadata(r)
            for key in ("input_tokens", "output_tokens", "total_tokens"):
                usage[key] += one[key]
            usage["cache_read"] += r.cached_tokens
        return LLMResult(
            generations=[[LCGeneration(text=r.answer, generation_info=self._info(r))] for r in results],
            llm_output={"token_usage": usage, "model_name": self.reported_model_name()},
        )

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        return self._result([self._prepare(p, stop, kwargs).run() for p in prompts])

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        return self._result([await self._prepare(p, stop, kwargs).arun() for p in prompts])

    def _chunk(self, chunk: StreamChunk) -> GenerationChunk:
        info = self._info(chunk.result) if chunk.result is not None else None
        return GenerationChunk(text=chunk.text, generation_info=info)

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        for chunk in self._prepare(prompt, stop, kwargs).stream():
            out = self._chunk(chunk)
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=out)
            yield out

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        async for chunk in self._prepare(prompt, stop, kwargs).astream():
            out = self._chunk(chunk)
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=out)
            yield out
