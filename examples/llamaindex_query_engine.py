"""A LlamaIndex query engine over the Python documentation, served by ragcache.

Two ways, both with document-level KV reuse:

* ``RAGCacheQueryEngine`` over ``RAGCacheRetriever`` (ragcache's own Faiss index; the default);
* ``--vector-index``: an ordinary ``VectorStoreIndex`` built from our documents and
  ``index.as_query_engine(llm=RAGCacheLLM())`` (embeds the corpus in memory: use it with a small
  corpus such as the FAQ).

    python examples/llamaindex_query_engine.py
    python examples/llamaindex_query_engine.py --vector-index --corpus /usr/share/doc/python3.11/html/_sources/faq

Each question is asked twice; the second time the documents come from the cache.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.base.base_query_engine import BaseQueryEngine  # noqa: E402

from ragcache_backend.demo.datasets import faq_questions, python_docs_dir  # noqa: E402
from ragcache_backend.retrieval.docstore import DocumentStore  # noqa: E402
from ragcache_integrations import default_store  # noqa: E402
from ragcache_integrations.llamaindex import (  # noqa: E402
    CacheUsageRecorder,
    RAGCacheEmbedding,
    RAGCacheLLM,
    RAGCacheQueryEngine,
    RAGCacheRetriever,
    to_llama_documents,
)


def ragcache_query_engine(store: DocumentStore, llm: RAGCacheLLM, k: int) -> RAGCacheQueryEngine:
    """Retrieval from our Faiss index, the answer from the cached documents."""
    return RAGCacheQueryEngine(retriever=RAGCacheRetriever(store, k=k), llm=llm)


def vector_index_query_engine(store: DocumentStore, llm: RAGCacheLLM, k: int) -> BaseQueryEngine:
    """An ordinary LlamaIndex VectorStoreIndex over our documents, with our LLM."""
    index = VectorStoreIndex.from_documents(to_llama_documents(store.documents),
                                            embed_model=RAGCacheEmbedding(embedder=store.embedder))
    return index.as_query_engine(llm=llm, similarity_top_k=k)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("questions", nargs="*", help="questions (default: 3 from the Python FAQ)")
    parser.add_argument("--corpus", type=Path, default=None, help="corpus folder (default: the Python docs)")
    parser.add_argument("--k", type=int, default=3, help="documents per question")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--vector-index", action="store_true", help="use VectorStoreIndex.as_query_engine")
    args = parser.parse_args(argv)
    store = default_store(args.corpus or python_docs_dir())
    build = vector_index_query_engine if args.vector_index else ragcache_query_engine
    engine = build(store, RAGCacheLLM(max_tokens=args.max_tokens), args.k)
    usage = CacheUsageRecorder.attach()  # what each LLM call reused, via LlamaIndex instrumentation
    for question in args.questions or faq_questions()[:3]:
        print(f"Q: {question}")
        for attempt in ("first", "second"):
            response = engine.query(question)
            raw = usage.records[-1]
            print(f"  {attempt}: TTFT {raw['ttft_s']:.2f} s, cached "
                  f"{raw['usage']['prompt_tokens_details']['cached_tokens']}/{raw['usage']['prompt_tokens']} tokens")
        print(f"A: {response}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
