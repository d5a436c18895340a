"""The public API of the adapter packages (and of the recognition module) is pinned."""

from __future__ import annotations

import ragcache_backend.prompts.recognition
import ragcache_integrations
import ragcache_integrations.langchain
import ragcache_integrations.llamaindex


def test_public_api_is_pinned() -> None:
    assert ragcache_integrations.__all__ == [
        "TRANSIENT_ERRORS", "GenerationTimeoutError", "ServerError", "UnsupportedContentError", "default_engine",
        "default_store", "known_documents",
    ]
    assert ragcache_integrations.langchain.__all__ == ["ChatRAGCache", "RAGCacheLLM", "RAGCacheRetriever",
                                                       "RetrievedDocumentLearner", "install_document_learner"]
    assert ragcache_integrations.llamaindex.__all__ == [
        "CacheUsageRecorder", "RAGCacheEmbedding", "RAGCacheLLM", "RAGCacheQueryEngine", "RAGCacheRetriever",
        "RetrievedNodeLearner", "install_node_learner", "to_llama_documents",
    ]
    assert ragcache_backend.prompts.recognition.__all__ == [
        "ANCHOR_CHARS", "ChatTurn", "DocumentRecognizer", "PromptSegmenter", "RecognizedSpan", "SegmentedPrompt",
    ]
    for module in (ragcache_integrations, ragcache_integrations.langchain, ragcache_integrations.llamaindex,
                   ragcache_backend.prompts.recognition):
        assert all(hasattr(module, name) for name in module.__all__)


def test_every_adapter_parameter_is_described() -> None:
    from ragcache_integrations.langchain import ChatRAGCache, RAGCacheLLM, RAGCacheRetriever
    from ragcache_integrations.llamaindex import CacheUsageRecorder, RAGCacheEmbedding, RAGCacheQueryEngine
    from ragcache_integrations.llamaindex import RAGCacheLLM as LlamaLLM

    own = {
        ChatRAGCache: ["engine", "model_name", "temperature", "max_tokens", "top_p", "seed", "stop", "timeout",
                       "max_retries", "use_cache", "reuse", "recognizer", "streaming", "base_url", "api_key"],
        RAGCacheLLM: ["engine", "max_tokens", "chat_template", "streaming"],
        RAGCacheRetriever: ["store", "corpus_dir", "k"],
        LlamaLLM: ["engine", "max_tokens", "timeout", "chat_template"],
        RAGCacheEmbedding: ["model_name", "embedder"],
        RAGCacheQueryEngine: ["retriever", "llm", "qa_prompt"],
        CacheUsageRecorder: ["records"],
    }
    for cls, fields in own.items():
        for name in fields:
            assert cls.model_fields[name].description, f"{cls.__name__}.{name} has no description"
