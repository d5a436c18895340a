"""The ordinary LCEL RAG chain with our model and retriever swapped in, and the bad inputs.

The chain is the one of LangChain's RAG quick start, unchanged but for ``ChatRAGCache`` and
``RAGCacheRetriever``: real FAQ questions run twice; the second pass must read the documents'
KV from the cache and give the same answers as a cache-off run.
"""

from __future__ import annotations

import pytest
from langchain_core.callbacks import BaseCallbackHandler, get_usage_metadata_callback
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from ragcache_backend.retrieval.documents import Document
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.prompts.recognition import DocumentRecognizer
from ragcache_integrations import GenerationTimeoutError, UnsupportedContentError
from ragcache_integrations.langchain import ChatRAGCache, RAGCacheLLM, RAGCacheRetriever
from ragcache_integrations.langchain.chat_models import to_chat_turns
from tests.integrations.rag_prompts import CUSTOM_RAG_PROMPT, RLM_RAG_PROMPT, format_docs

pytestmark = pytest.mark.model
QUESTIONS = 2
MAX_TOKENS = 12


def rag_chain(retriever, llm):
    """LangChain's quick-start chain, verbatim (prompt = hub "rlm/rag-prompt")."""
    prompt = ChatPromptTemplate.from_messages([("human", RLM_RAG_PROMPT)])
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | llm
        | StrOutputParser()
    )


def run_with_usage(chain, question: str) -> tuple[str, dict]:
    with get_usage_metadata_callback() as callback:
        answer = chain.invoke(question)
    (usage,) = callback.usage_metadata.values()
    return answer, usage


def test_lcel_rag_chain_reuses_document_kv(engine, faq_store, faq_questions) -> None:
    engine.reset_cache()
    retriever = RAGCacheRetriever(store=faq_store, k=2)
    questions = faq_questions[:QUESTIONS]
    baseline = rag_chain(retriever, ChatRAGCache(engine=engine, max_tokens=MAX_TOKENS, use_cache=False))
    cached = rag_chain(retriever, ChatRAGCache(engine=engine, max_tokens=MAX_TOKENS))
    expected = [run_with_usage(baseline, q) for q in questions]
    passes = [[run_with_usage(cached, q) for q in questions] for _ in range(2)]
    print("\nLCEL cache_read per question: pass 1",
          [u["input_token_details"]["cache_read"] for _, u in passes[0]], "pass 2",
          [(u["input_token_details"]["cache_read"], u["input_tokens"]) for _, u in passes[1]])
    assert all(u["input_token_details"]["cache_read"] == 0 for _, u in expected)
    for (answer, usage), (reference, _) in zip(passes[1], expected):
        assert usage["input_token_details"]["cache_read"] > 0.9 * usage["input_tokens"]
        assert answer == reference
    assert [a for a, _ in passes[0]] == [a for a, _ in expected]


class UsageCollector(BaseCallbackHandler):
    def __init__(self) -> None:
        self.usage: list[dict] = []

    def on_llm_end(self, response, **kwargs) -> None:
        if response.llm_output:  # streamed runs have none
            self.usage.append(response.llm_output["token_usage"])


def test_text_llm_chain_reuses_document_kv_across_questions(engine, faq_store, faq_questions) -> None:
    """The tutorial's custom (context-first) PromptTemplate with RAGCacheLLM: documents are
    served from the cache as soon as another question retrieves them."""
    engine.reset_cache()
    retriever = RAGCacheRetriever(store=faq_store, k=1)
    docs = retriever.invoke(faq_questions[0])
    context = RunnableLambda(lambda _q: docs) | format_docs  # the same document for both questions
    prompt = PromptTemplate.from_template(CUSTOM_RAG_PROMPT)
    collector = UsageCollector()
    llm = RAGCacheLLM(engine=engine, max_tokens=MAX_TOKENS, callbacks=[collector])
    chain = {"context": context, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
    answers = [chain.invoke(q) for q in faq_questions[:2]]
    off = {"context": context, "question": RunnablePassthrough()} | prompt | llm.model_copy(
        update={"use_cache": False, "callbacks": None}) | StrOutputParser()
    assert collector.usage[0]["cache_read"] == 0
    assert collector.usage[1]["cache_read"] > 100  # template text + document, a different question
    assert answers[1] == off.invoke(faq_questions[1])
    assert "".join(llm.stream(prompt.format(context=format_docs(docs), question=faq_questions[1]))) == answers[1]


# ---- bad input --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_docs(faq_store) -> list[Document]:
    """Two short real FAQ documents (cheap prompts)."""
    docs = sorted((d for d in faq_store.documents if 250 <= len(d.text) <= 500), key=lambda d: d.doc_id)
    return docs[:2]


def ask(engine, content, *, recognizer=None, use_cache=True) -> AIMessage:
    llm = ChatRAGCache(engine=engine, max_tokens=6, use_cache=use_cache, recognizer=recognizer)
    return llm.invoke([HumanMessage(content)])


def served_correctly(engine, content, recognizer=None) -> AIMessage:
    """Cache on (twice, so the second reads what the first stored) equals cache off."""
    reference = ask(engine, content, recognizer=recognizer, use_cache=False)
    first = ask(engine, content, recognizer=recognizer)
    second = ask(engine, content, recognizer=recognizer)
    assert first.content == second.content == reference.content
    return second


def test_edited_document_is_computed_not_reused(engine, short_docs) -> None:
    doc = short_docs[0]
    words = doc.text.split(" ")
    words[len(words) // 2] += "x"
    edited = " ".join(words)
    content = f"Context:\n{edited}\n\nQuestion: what is this about?"
    reference = ask(engine, content, use_cache=False)
    first = ask(engine, content)
    assert first.content == reference.content
    assert first.response_metadata["documents"] == []
    # the original's KV is never used: at most the template's blocks before the document (block nodes)
    read = first.usage_metadata["input_token_details"]["cache_read"]
    assert read % engine.block_tokens == 0 and read <= 2 * engine.block_tokens
    again = ask(engine, content)  # an exact repeat of the edited prompt is reused whole (all but one token)
    assert again.content == reference.content
    assert again.usage_metadata["input_token_details"]["cache_read"] == again.usage_metadata["input_tokens"] - 1


def test_repeated_document_is_served(engine, short_docs) -> None:
    doc = short_docs[0]
    message = served_correctly(engine, f"Context:\n{doc.text}\n\n{doc.text}\n\nQuestion: what is this about?")
    assert message.response_metadata["documents"] == [doc.doc_id, doc.doc_id]
    assert message.usage_metadata["input_token_details"]["cache_read"] > 2 * len(doc.text) // 6


def test_overlapping_documents_are_served(engine, short_docs) -> None:
    """Chunks with an overlap (as a splitter with chunk_overlap makes them)."""
    text = short_docs[0].text + "\n\n" + short_docs[1].text
    cut = len(short_docs[0].text)
    first = Document.from_text(text[: cut + 100], source="s", title="first chunk")
    second = Document.from_text(text[cut - 100:], source="s", title="second chunk")
    recognizer = DocumentRecognizer([first, second])
    both = served_correctly(engine, f"{first.text}\n\n{second.text}\n\nWhat is this about?", recognizer)
    assert both.response_metadata["documents"] == [first.doc_id, second.doc_id]
    merged = served_correctly(engine, f"{text}\n\nWhat is this about?", recognizer)  # they overlap here
    longer = first if len(first.text.strip()) >= len(second.text.strip()) else second  # tie: leftmost
    assert merged.response_metadata["documents"] == [longer.doc_id]


def test_empty_retrieval_is_served(engine) -> None:
    no_docs = RunnableLambda(lambda _q: [])
    chain = rag_chain(no_docs, ChatRAGCache(engine=engine, max_tokens=6))
    off = rag_chain(no_docs, ChatRAGCache(engine=engine, max_tokens=6, use_cache=False))
    answer, usage = run_with_usage(chain, "What is Python?")
    assert answer == off.invoke("What is Python?")
    read = usage["input_token_details"]["cache_read"]  # no document: at most the template's blocks seen before
    assert read % engine.block_tokens == 0 and read < usage["input_tokens"] // 2


def test_text_blocks_are_served_and_other_content_refused(engine, short_docs) -> None:
    doc = short_docs[1]
    blocks = [{"type": "text", "text": f"Context:\n{doc.text}\n\n"}, {"type": "text", "text": "Summarise it."}]
    as_blocks = ask(engine, blocks)
    assert as_blocks.content == ask(engine, f"Context:\n{doc.text}\n\nSummarise it.").content
    assert as_blocks.response_metadata["documents"] == [doc.doc_id]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(UnsupportedContentError, match="image_url"):
        ask(engine, [{"type": "text", "text": "Describe this."}, image])
    # tool calls in the history are rendered as the model writes them (the Hermes format)
    tool_call = AIMessage("", tool_calls=[{"name": "f", "args": {"x": 1}, "id": "1", "type": "tool_call"}])
    turns = to_chat_turns([HumanMessage("hi"), tool_call, ToolMessage("42", tool_call_id="1")])
    assert [t.role for t in turns] == ["user", "assistant", "user"]
    assert turns[1].content == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert turns[2].content == "<tool_response>\n42\n</tool_response>"


def test_call_arguments_are_checked(engine) -> None:
    llm = ChatRAGCache(engine=engine, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="unsupported call arguments"):
        llm.invoke("hi", best_of=3)
    with pytest.raises(InvalidRequestError, match="serves"):
        llm.invoke("hi", model="gpt-4o")
    assert llm.invoke("hi", model=engine.model_name, max_tokens=2).usage_metadata["output_tokens"] <= 2


def test_timeout_cancels_and_is_typed(engine) -> None:
    llm = ChatRAGCache(engine=engine, max_tokens=64, timeout=0.001, max_retries=1)
    with pytest.raises(GenerationTimeoutError):
        llm.invoke("Tell me a long story about a dragon.")
    with pytest.raises(GenerationTimeoutError):
        list(llm.stream("Tell me a long story about a dragon."))
    assert ChatRAGCache(engine=engine, max_tokens=2, timeout=600).invoke("hi").content


def test_retriever_streams_candidates_and_checks_arguments(faq_store) -> None:
    retriever = RAGCacheRetriever(store=faq_store, k=3)
    question = "How do I make a Python script executable on Unix?"
    stages = list(retriever.stream_candidates(question, num_stages=3))
    final = retriever.invoke(question)
    assert len(stages) == 3 and [d.id for d in stages[-1]] == [d.id for d in final]
    assert all(d.page_content == faq_store.get(d.id).text for d in final)
    with pytest.raises(InvalidRequestError, match="unsupported retriever arguments"):
        retriever.invoke(question, top_k=2)


def test_model_picks_the_embedded_engine_one_per_model(tiny_model, tmp_path, monkeypatch) -> None:
    """``model=`` (a folder, a .gguf or a packaged name) gives adapters the process-wide engine of
    that model, one per model file, shared by LangChain and LlamaIndex alike."""
    from pydantic import ValidationError

    from ragcache_backend.errors import ModelLoadError
    from ragcache_integrations._runtime import engine_for
    from ragcache_integrations.llamaindex import RAGCacheLLM as LlamaLLM

    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path / "home"))  # the tiny model's prefill profile goes there
    folder = tmp_path / "tiny-llama"
    tiny_model.model.save_pretrained(folder)
    tiny_model.tokenizer.save_pretrained(folder)
    chat, llama = ChatRAGCache(model=str(folder), max_tokens=3), LlamaLLM(model=str(folder), max_tokens=3)
    assert chat.resolved_engine() is llama.resolved_engine() is engine_for(str(folder))
    assert chat.reported_model_name() == "tiny-llama" and chat.invoke("hi").usage_metadata["output_tokens"] <= 3
    with pytest.raises(ModelLoadError, match="packaged model"):
        ChatRAGCache(model=str(tmp_path / "missing")).invoke("hi")
    with pytest.raises(ValidationError, match="model="):
        ChatRAGCache(model=str(folder), base_url="http://127.0.0.1:9/v1")
    engine_for(str(folder)).close()
