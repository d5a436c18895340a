"""Prompts and helpers copied from the frameworks' own RAG tutorials (shared by the tests)."""

from __future__ import annotations

#: LangChain's RAG quick start prompt (hub "rlm/rag-prompt"): one human message, question first.
RLM_RAG_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question. If you don't know the answer, just say that you don't know. Use three "
    "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"
)

#: LangChain's "custom RAG prompt" from the same tutorial: a plain PromptTemplate, context first.
CUSTOM_RAG_PROMPT = (
    "Use the following pieces of context to answer the question at the end.\n"
    "If you don't know the answer, just say that you don't know, don't try to make up an answer.\n"
    "Use three sentences maximum and keep the answer as concise as possible.\n"
    'Always say "thanks for asking!" at the end of the answer.\n\n'
    "{context}\n\nQuestion: {question}\n\nHelpful Answer:"
)


def format_docs(docs) -> str:
    """The tutorial's ``format_docs``."""
    return "\n\n".join(doc.page_content for doc in docs)
