"""A LangChain LCEL RAG chain over the Python documentation, served by ragcache.

The chain is LangChain's quick-start RAG chain; only the model (``ChatRAGCache``) and the
retriever (``RAGCacheRetriever``) are ragcache's. Each question is asked twice: the second time
the retrieved documents' KV comes from the cache (``cache_read``) and the first token is faster.

    python examples/langchain_lcel_rag.py                        # 3 FAQ questions, whole Python docs
    python examples/langchain_lcel_rag.py --corpus /usr/share/doc/python3.11/html/_sources/faq \\
        "How do I make a Python script executable on Unix?"

The first run indexes the corpus (the whole documentation takes a few minutes on 2 CPU cores;
the index is saved under ~/.cache/ragcache and reused).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import Runnable, RunnablePassthrough  # noqa: E402

from ragcache_backend.demo.datasets import faq_questions, python_docs_dir  # noqa: E402
from ragcache_integrations.langchain import ChatRAGCache, RAGCacheRetriever  # noqa: E402

PROMPT = ChatPromptTemplate.from_messages([("human", (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question. If you don't know the answer, just say that you don't know. Use three "
    "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"
))])


def format_docs(docs) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


def build_chain(llm, retriever) -> Runnable:
    """The quick-start chain, ending in the model's AIMessage (add ``| StrOutputParser()`` for text)."""
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("questions", nargs="*", help="questions (default: 3 from the Python FAQ)")
    parser.add_argument("--corpus", type=Path, default=None, help="corpus folder (default: the Python docs)")
    parser.add_argument("--k", type=int, default=3, help="documents per question")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    args = parser.parse_args(argv)
    chain = build_chain(ChatRAGCache(max_tokens=args.max_tokens),
                        RAGCacheRetriever(corpus_dir=args.corpus or python_docs_dir(), k=args.k))
    for question in args.questions or faq_questions()[:3]:
        print(f"Q: {question}")
        for attempt in ("first", "second"):
            message = chain.invoke(question)
            usage = message.usage_metadata
            print(f"  {attempt}: TTFT {message.response_metadata['ttft_s']:.2f} s, cache_read "
                  f"{usage['input_token_details']['cache_read']}/{usage['input_tokens']} tokens")
        print(f"A: {message.content}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
