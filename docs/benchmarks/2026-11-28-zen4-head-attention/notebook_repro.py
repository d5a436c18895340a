import os, sys, contextlib
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from pathlib import Path
from ragcache_backend.model.kernels import native, linear
variant = sys.argv[1]
if variant == "oldhead":
    linear.PICKED_ROWS_MAX.clear()
ctx = native.using_library(native.build_library(Path("/tmp/k_head"))) if variant == "oldattn" else contextlib.nullcontext()
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from ragcache_backend.demo.datasets import faq_questions, python_docs_dir
from ragcache_integrations.langchain import ChatRAGCache, RAGCacheRetriever
with ctx:
    retriever = RAGCacheRetriever(corpus_dir=python_docs_dir() / "faq", k=2)
    llm = ChatRAGCache(max_tokens=32)
    prompt = ChatPromptTemplate.from_messages([("human", (
        "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
        "to answer the question. If you don't know the answer, just say that you don't know. Use three "
        "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"))])
    def format_docs(docs): return "\n\n".join(doc.page_content for doc in docs)
    context = {"context": retriever | format_docs, "question": RunnablePassthrough()}
    message_chain = context | prompt | llm
    baseline_chain = context | prompt | llm.model_copy(update={"use_cache": False})
    for q in faq_questions()[:4]:
        off = baseline_chain.invoke(q)
        first, second = message_chain.invoke(q), message_chain.invoke(q)
        print(variant, off.content == first.content, first.content == second.content)
        if not off.content == first.content == second.content:
            print("  off   ", repr(off.content)); print("  first ", repr(first.content)); print("  second", repr(second.content))
