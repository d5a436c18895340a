"""LangChain's standard test suites for ChatRAGCache and RAGCacheRetriever (langchain-tests).

The unit suite builds models without loading anything (the default engine is lazy). The
integration suites run on the session's shared engine (real SmolLM2) and FAQ store, with
``max_tokens=128`` (a forced tool call or a structured answer needs room) and
``frequency_penalty=1.0`` (greedy SmolLM2 otherwise repeats itself inside JSON strings until the
limit). Tool calling and structured output run (``bind_tools``; ``with_structured_output``
through it, and JSON mode). Capabilities the model truly lacks are turned off through the suites' documented
properties: image/audio/PDF input (defaults: off) and model override (one engine serves one
model); the agent loop, where the model must choose on its own to call a tool, is an expected
failure for a 135M model (see the mark).
"""

from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from ragcache_integrations.langchain import ChatRAGCache, RAGCacheRetriever


class TestChatRAGCacheUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatRAGCache]:
        return ChatRAGCache

    @property
    def chat_model_params(self) -> dict:
        return {"temperature": 0.0}  # the suite adds max_tokens, stop, timeout, max_retries itself

    @property
    def supports_model_override(self) -> bool:
        return False


@pytest.mark.model
class TestChatRAGCacheIntegration(ChatModelIntegrationTests):
    shared_engine = None

    @pytest.fixture(autouse=True)
    def _use_shared_engine(self, engine) -> None:
        type(self).shared_engine = engine

    @property
    def chat_model_class(self) -> type[ChatRAGCache]:
        return ChatRAGCache

    @property
    def chat_model_params(self) -> dict:
        return {"engine": self.shared_engine, "max_tokens": 128, "frequency_penalty": 1.0}

    @property
    def supports_model_override(self) -> bool:
        return False

    @pytest.mark.xfail(reason="tool_choice auto: SmolLM2-135M answers in text and does not choose to call the "
                              "tool; forced calls (tool_choice any/required/a name) pass test_tool_calling",
                       strict=False)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)  # as the suite's own
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        """A prompt holding an FAQ document, sent twice: the second call reads it from the cache."""
        document = self.shared_engine.store.documents[0].text
        model = self.chat_model_class(**self.chat_model_params)
        prompt = f"Context:\n\n{document}\n\nQuestion: what is this about?"
        model.invoke(prompt)
        if stream:
            full = None
            for chunk in model.stream(prompt):
                full = chunk if full is None else full + chunk
            message = full
        else:
            message = model.invoke(prompt)
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0
        return message


@pytest.mark.model
class TestRAGCacheRetrieverIntegration(RetrieversIntegrationTests):
    store = None

    @pytest.fixture(autouse=True)
    def _use_faq_store(self, faq_store) -> None:
        type(self).store = faq_store

    @property
    def retriever_constructor(self) -> type[RAGCacheRetriever]:
        return RAGCacheRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"store": self.store, "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "How do I make a Python script executable on Unix?"
