"""LangChain's ``abatch`` and LlamaIndex's async calls run on the engine's one step loop: concurrent
requests share forward steps, and batching changes no token (random tiny Llama, fp32, greedy)."""

from __future__ import annotations

import asyncio

from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_integrations.langchain import ChatRAGCache
from ragcache_integrations.llamaindex import RAGCacheLLM

QUESTIONS = ["What is a list?", "How do I open a file?", "Why use a tuple?", "What does yield do?"]


def _engine(tiny_model, fixed_profile) -> RAGCacheEngine:
    cfg = EngineConfig(device_budget_bytes=4 << 20, host_budget_bytes=0, threads=1, max_batch_size=8)
    return RAGCacheEngine(cfg, loaded=tiny_model, profile=fixed_profile)


def test_langchain_abatch_shares_forward_steps(tiny_model, fixed_profile):
    alone = _engine(tiny_model, fixed_profile)
    one_by_one = [ChatRAGCache(engine=alone, max_tokens=6).invoke(q).content for q in QUESTIONS]
    steps_alone = alone.stats.steps
    batched = _engine(tiny_model, fixed_profile)
    results = asyncio.run(ChatRAGCache(engine=batched, max_tokens=6).abatch(QUESTIONS))
    assert [r.content for r in results] == one_by_one
    assert batched.stats.finished == len(QUESTIONS)
    assert batched.stats.steps < steps_alone  # the four requests shared forward steps


def test_llamaindex_concurrent_acomplete_shares_forward_steps(tiny_model, fixed_profile):
    engine = _engine(tiny_model, fixed_profile)
    llm = RAGCacheLLM(engine=engine, max_tokens=6)
    alone = [llm.complete(q).text for q in QUESTIONS]
    steps_alone = engine.stats.steps

    async def together():
        return await asyncio.gather(*(llm.acomplete(q) for q in QUESTIONS))

    results = asyncio.run(together())
    assert [r.text for r in results] == alone
    assert engine.stats.steps - steps_alone < steps_alone
