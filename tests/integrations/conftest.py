"""Fixtures of the adapter tests: one engine on the real default model over the Python FAQ, shared
by the whole session (loading the model and building the index happen once), and the FAQ
questions used as real user input.

The engine's knowledge tree is shared too: a test that needs a cold cache calls
``engine.reset_cache()`` first; a cache-off baseline uses ``use_cache=False`` on the same engine.
"""

from __future__ import annotations

import pytest

from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine

MiB = 1024 * 1024


@pytest.fixture(scope="session")
def engine(real_model, fixed_profile, faq_store) -> RAGCacheEngine:
    """The shared engine (256 MiB device tier, ~5,800 tokens of KV; host tier 512 MiB)."""
    config = EngineConfig(device_budget_bytes=256 * MiB, host_budget_bytes=512 * MiB)
    return RAGCacheEngine(config, loaded=real_model, profile=fixed_profile, store=faq_store)


@pytest.fixture(scope="session")
def faq_questions(faq_dir) -> list[str]:
    """Real questions: the FAQ's own question headings."""
    from ragcache_backend.demo.datasets import faq_questions

    return faq_questions(faq_dir.parent)


@pytest.fixture(autouse=True)
def _no_speculation_across_tests():
    """Each test starts with no learned prompt frame and leaves no posted speculative generation."""
    from ragcache_integrations._speculation import speculation_board

    speculation_board().forget()
    yield
    speculation_board().forget()
