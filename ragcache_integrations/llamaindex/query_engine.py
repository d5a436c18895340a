"""``RAGCacheQueryEngine``: retrieve, then answer with cached document KV (LlamaIndex).

The prompt is LlamaIndex's own chat QA template (the one ``index.as_query_engine()`` uses with a
chat model): the retrieved nodes' text goes into ``{context_str}`` before the query, so the
template text and the documents form the cached prefix and only the query is computed. The
response's ``metadata`` reports what the cache served.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import Response
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import MetadataMode, NodeWithScore
from pydantic import Field

from ragcache_integrations.llamaindex.llms import RAGCacheLLM
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
        return Response(response=answer, source_nodes=nodes, metadata=metadata)

    def custom_query(self, query_str: str) -> Response:
        nodes = self.retriever.retrieve(query_str)
        reply = self.llm.chat(self._messages(query_str, nodes))
        return self._response(reply.message.content, reply.raw, nodes)

    async def acustom_query(self, query_str: str) -> Response:
        nodes = await self.retriever.aretrieve(query_str)
        reply = await self.llm.achat(self._messages(query_str, nodes))
        return self._response(reply.message.content, reply.raw, nodes)
