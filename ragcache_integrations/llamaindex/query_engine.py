"""``RAGCacheQueryEngine``: retrieve, then answer with cached document KV (LlamaIndex).

The prompt is LlamaIndex's own chat QA template (the one ``index.as_query_engine()`` uses with a
chat model): the retrieved nodes' text goes into ``{context_str}`` before the query, so the
template text and the documents form the cached prefix and only the query is computed. The
response's ``metadata`` reports what the cache served.

With our :class:`RAGCacheRetriever` the query engine pipelines retrieval and generation (RAGCache
§5.3, Algorithm 2): the search runs in stages, and while it runs the engine generates
speculatively on the candidates (the prompt this query engine would build from them), restarting
when they change and only while the engine is idle enough; the answer is always the final nodes'
one. ``metadata`` then also reports ``search_s``, ``unoverlapped_search_s``,
``speculative_requests``, ``wasted_tokens`` and ``speculation_kept``.
"""

from __future__ import annotations

import threading
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import Response
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import MetadataMode, NodeWithScore
from pydantic import Field

from ragcache_backend.engine.pipelining import SpeculativePipeline, run_cancellable
from ragcache_backend.engine.request import GenerationResult
from ragcache_integrations.llamaindex.llms import RAGCacheLLM, raw_usage
from ragcache_integrations.llamaindex.retrievers import RAGCacheRetriever

__all__ = ["RAGCacheQueryEngine"]


class RAGCacheQueryEngine(CustomQueryEngine):
    """Retrieval-augmented answers with document-level KV reuse.

    Example:
        ```python
        engine = RAGCacheQueryEngine(retriever=RAGCacheRetriever(k=3), llm=RAGCacheLLM(max_tokens=64))
        response = engine.query("How do I sort a list?")
        response.metadata["cached_tokens"]
        ```
    """

    retriever: BaseRetriever = Field(
        default_factory=RAGCacheRetriever,
        description="where the context comes from; default: RAGCacheRetriever over the Python docs")
    llm: RAGCacheLLM = Field(default_factory=RAGCacheLLM, description="the model (default engine)")
    qa_prompt: BasePromptTemplate = Field(
        default=CHAT_TEXT_QA_PROMPT,
        description="chat prompt with {context_str} and {query_str}; LlamaIndex's default QA prompt")
    pipelined: bool = Field(
        default=True,
        description="with a RAGCacheRetriever: overlap its staged search with speculative generation "
                    "(RAGCache §5.3); False = search, then generate")

    def _messages(self, query_str: str, nodes: list[NodeWithScore]) -> list:
        context = "\n\n".join(n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes)
        return self.qa_prompt.format_messages(context_str=context, query_str=query_str)

    @staticmethod
    def _response(answer: str, raw: dict[str, Any], nodes: list[NodeWithScore]) -> Response:
        usage = raw["usage"]
        metadata = {
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "ttft_s": raw["ttft_s"],
            "documents": raw["documents"],
            "model": raw["model"],
        }
        metadata.update({k: raw[k] for k in _PIPELINE_FIELDS if k in raw})
        return Response(response=answer, source_nodes=nodes, metadata=metadata)

    def custom_query(self, query_str: str) -> Response:
        if self.pipelined and isinstance(self.retriever, RAGCacheRetriever):
            return self._pipelined(query_str)
        nodes = self.retriever.retrieve(query_str)
        reply = self.llm.chat(self._messages(query_str, nodes))
        return self._response(reply.message.content, reply.raw, nodes)

    async def acustom_query(self, query_str: str) -> Response:
        if self.pipelined and isinstance(self.retriever, RAGCacheRetriever):
            cancel = threading.Event()
            return await run_cancellable(lambda: self._pipelined(query_str, cancel), cancel)
        nodes = await self.retriever.aretrieve(query_str)
        reply = await self.llm.achat(self._messages(query_str, nodes))
        return self._response(reply.message.content, reply.raw, nodes)

    def _pipelined(self, query_str: str, cancel: threading.Event | None = None) -> Response:
        """Algorithm 2 over the retriever's staged search; the answer is the final nodes' one."""
        target = self.llm.target()
        cancel = cancel or threading.Event()

        def submit(nodes, on_text):
            return self.llm.chat_request(self._messages(query_str, list(nodes))).submit(on_text)

        pipeline = SpeculativePipeline(target, submit, key=lambda n: n.node.node_id,
                                       max_prefill_bs=target.max_prefill_bs, cancel=cancel)
        outcome = pipeline.speculate(self.retriever.stream_candidates(query_str))
        nodes = list(outcome.documents)
        if outcome.handle is not None:
            result = outcome.finish(cancel=cancel)
        else:
            result = outcome.report(self.llm.chat_request(self._messages(query_str, nodes)).run(cancel=cancel))
        return self._response(result.answer, _raw(result), nodes)


_PIPELINE_FIELDS = ("search_s", "unoverlapped_search_s", "speculative_requests", "wasted_tokens", "speculation_kept")


def _raw(result: GenerationResult) -> dict[str, Any]:
    """``raw_usage`` plus the pipelining figures of a pipelined answer."""
    return {**raw_usage(result), **{k: getattr(result, k) for k in _PIPELINE_FIELDS}}
