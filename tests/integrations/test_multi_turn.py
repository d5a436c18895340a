"""Multi-turn chats through the adapters reuse their earlier turns (issue 20, block nodes).

A LangChain chat with history (``RunnableWithMessageHistory``, LangChain's own memory wrapper) and a
LlamaIndex chat engine (``SimpleChatEngine`` with its chat memory), both unchanged but for our chat
model, on the real default model. Each turn's prompt is the earlier turns plus a new message and
contains no document: before block nodes it reused nothing; now every full block of the earlier
prompt is read from the cache (``cache_read`` / ``cached_tokens``), and the earlier answer's blocks
too when its text tokenises back to the same tokens.
"""

from __future__ import annotations

import pytest
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables.history import RunnableWithMessageHistory
from llama_index.core.chat_engine import SimpleChatEngine

from ragcache_integrations.langchain import ChatRAGCache
from ragcache_integrations.llamaindex import CacheUsageRecorder, RAGCacheLLM

pytestmark = pytest.mark.model
TURNS = ("What is a Python list?", "And how is it different from a tuple?", "Which one should I use as a dict key?")
MAX_TOKENS = 24


def blocks_of(engine, tokens: int) -> int:
    """Tokens in the full blocks of ``tokens`` tokens."""
    return tokens // engine.block_tokens * engine.block_tokens


def test_langchain_history_reuses_earlier_turns(engine) -> None:
    engine.reset_cache()
    prompt = ChatPromptTemplate.from_messages(
        [("system", "You are a concise Python tutor."), MessagesPlaceholder("history"), ("human", "{question}")])
    histories: dict[str, InMemoryChatMessageHistory] = {}
    chat = RunnableWithMessageHistory(prompt | ChatRAGCache(engine=engine, max_tokens=MAX_TOKENS),
                                      lambda sid: histories.setdefault(sid, InMemoryChatMessageHistory()),
                                      input_messages_key="question", history_messages_key="history")
    config = {"configurable": {"session_id": "s1"}}
    usages = [chat.invoke({"question": q}, config=config).usage_metadata for q in TURNS]
    reads = [u["input_token_details"]["cache_read"] for u in usages]
    print("\nLangChain history: prompt tokens", [u["input_tokens"] for u in usages], "cache_read", reads)
    assert reads[0] == 0
    for before, now, read in zip(usages, usages[1:], reads[1:]):
        # at least every full block of the earlier prompt (its last token is always computed)
        assert read >= blocks_of(engine, before["input_tokens"] - 1) > 0
        assert read < now["input_tokens"]
    assert len(histories["s1"].messages) == 2 * len(TURNS)
    # another session with the same system prompt shares only that prefix's blocks
    other = chat.invoke({"question": "What is a set?"}, config={"configurable": {"session_id": "s2"}}).usage_metadata
    assert 0 < other["input_token_details"]["cache_read"] < usages[0]["input_tokens"]


def test_llamaindex_chat_engine_reuses_earlier_turns(engine) -> None:
    engine.reset_cache()
    recorder = CacheUsageRecorder.attach()
    try:
        chat_engine = SimpleChatEngine.from_defaults(llm=RAGCacheLLM(engine=engine, max_tokens=MAX_TOKENS),
                                                     system_prompt="You are a concise Python tutor.")
        answers = [chat_engine.chat(q).response for q in TURNS]
    finally:
        recorder.detach()
    usage = [r["usage"] for r in recorder.records]
    reads = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    print("\nLlamaIndex chat engine: prompt tokens", [u["prompt_tokens"] for u in usage], "cached", reads)
    assert len(usage) == len(TURNS) and all(answers)
    assert reads[0] == 0
    for before, now, read in zip(usage, usage[1:], reads[1:]):
        assert read >= blocks_of(engine, before["prompt_tokens"] - 1) > 0
        assert read < now["prompt_tokens"]
