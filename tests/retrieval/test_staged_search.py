"""Staged (pipelined) vector search on every index kind: the last stage equals one plain search.

RAGCache §5.3 / SPEC "Dynamic speculative pipelining": IVF by slices of the probe list, HNSW by
groups of shards, flat by id ranges. Random vectors (many queries) and real text (the Python FAQ
with the real embedder).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import faiss
import numpy as np
import pytest

from ragcache_backend.errors import CorruptFileError, InvalidRequestError
from ragcache_backend.retrieval.docstore import DocumentStore, IndexKind
from ragcache_backend.retrieval.documents import Document, content_id
from ragcache_backend.retrieval.embedder import Embedder

N, DIM = 3000, 384


def _random_corpus() -> tuple[list[Document], np.ndarray]:
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((N, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return [Document(content_id(f"doc {i}"), f"doc {i}", "synthetic", "t") for i in range(N)], vectors


def _random_store(kind: str, embedder: Embedder) -> DocumentStore:
    docs, vectors = _random_corpus()
    return DocumentStore.build(docs, embedder, kind=kind, vectors=vectors, nprobe=12, hnsw_shards=6, progress=False)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


@pytest.fixture(scope="module", params=["flat", "ivf", "hnsw"])
def random_store(request, embedder) -> DocumentStore:
    return _random_store(request.param, embedder)


@pytest.fixture(scope="module")
def queries() -> np.ndarray:
    q = np.random.default_rng(11).standard_normal((200, DIM)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def test_staged_search_equals_plain_search_for_many_random_queries(random_store, queries):
    for i, q in enumerate(queries):
        k = (1, 3, 5, 10)[i % 4]
        plain = random_store.search_vector(q, k)
        for num_stages in (1, 4, 7):
            stages = list(random_store.search_vector_stages(q, k, num_stages))
            assert stages[-1] == plain  # ids, order and scores


def test_stage_counts(random_store, queries):
    expected = {IndexKind.FLAT: 4, IndexKind.IVF: 4, IndexKind.HNSW: 4}[random_store.index_kind]
    assert len(list(random_store.search_vector_stages(queries[0], 3, 4))) == expected
    many = len(list(random_store.search_vector_stages(queries[0], 3, 10_000)))
    assert many == {IndexKind.FLAT: N, IndexKind.IVF: 12, IndexKind.HNSW: 6}[random_store.index_kind]


def test_k_larger_than_the_index(embedder):
    docs = [Document(content_id(t), t, "s", "t") for t in ("alpha beta", "gamma delta", "epsilon zeta")]
    for kind in ("flat", "hnsw"):
        store = DocumentStore.build(docs, embedder, kind=kind, progress=False)
        stages = list(store.search_stages("alpha", 50, 3))
        assert len(stages[-1]) == 3 and stages[-1] == store.search("alpha", 50)


def test_ivf_nprobe_is_per_search_never_the_shared_index(embedder, queries):
    docs, vectors = _random_corpus()
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(DIM), DIM, 50, faiss.METRIC_INNER_PRODUCT)
    index.train(vectors)
    index.add(vectors)
    index.nprobe = 3
    store = DocumentStore(docs, index, embedder, nprobe=12)
    wide = store.with_nprobe(store.nlist)
    assert wide.nprobe == 50 and store.nprobe == 12
    exact = _random_store("flat", embedder)
    for q in queries[:20]:
        # all lists probed = exhaustive search: equals the flat index (scores to float rounding)
        got, want = wide.search_vector(q, 5), exact.search_vector(q, 5)
        assert [h.document.doc_id for h in got] == [h.document.doc_id for h in want]
        assert list(wide.search_vector_stages(q, 5, 8))[-1] == got
    list(store.search_vector_stages(queries[0], 5, 4))
    assert index.nprobe == 3  # searches passed their own nprobe; the shared index is unchanged
    with pytest.raises(InvalidRequestError):
        store.with_nprobe(0)
    with pytest.raises(InvalidRequestError):
        exact.with_nprobe(3)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_staged_search_equals_plain_search_on_real_questions(kind, embedder, faq_store):
    from ragcache_backend.demo.datasets import faq_questions

    store = DocumentStore.build(faq_store.documents, embedder, kind=kind, nprobe=4, hnsw_shards=4, progress=False)
    for question in faq_questions()[:40]:
        assert list(store.search_stages(question, 4, 4))[-1] == store.search(question, 4)


def test_async_stages_equal_sync_stages(random_store):
    async def collect():
        return [hits async for hits in random_store.asearch_stages("any words at all", 5, 3)]

    assert asyncio.run(collect()) == list(random_store.search_stages("any words at all", 5, 3))


def test_hnsw_round_trip_and_corruption(embedder, queries, tmp_path: Path):
    store = _random_store("hnsw", embedder)
    store.save(tmp_path / "s")
    loaded = DocumentStore.load(tmp_path / "s", embedder=embedder)
    assert loaded.index_kind is IndexKind.HNSW
    for q in queries[:20]:
        assert loaded.search_vector(q, 5) == store.search_vector(q, 5)
    # a manifest whose shard sizes do not add up is refused, even with valid checksums
    import json

    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["hnsw_shards"][0] += 1
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError):
        DocumentStore.load(tmp_path / "s", embedder=embedder)


def test_unknown_kind_and_wrong_vectors(embedder):
    docs = [Document(content_id("x y"), "x y", "s", "t")]
    with pytest.raises(InvalidRequestError):
        DocumentStore.build(docs, embedder, kind="lsh", progress=False)
    with pytest.raises(InvalidRequestError):
        DocumentStore.build(docs, embedder, vectors=np.zeros((2, DIM), np.float32), progress=False)
    assert faiss.IndexHNSWFlat  # the Faiss build has HNSW


def test_nprobe_setter_is_checked_and_per_store(embedder, queries):
    store = _random_store("ivf", embedder)
    view = store.with_nprobe(30)
    view.nprobe = 40
    assert view.nprobe == 40 and store.nprobe == 12
    assert list(view.search_vector_stages(queries[0], 5, 4))[-1] == view.search_vector(queries[0], 5)
    for bad in (0, store.nlist + 1, 2.5, True):
        with pytest.raises(InvalidRequestError):
            view.nprobe = bad
    with pytest.raises(InvalidRequestError):
        _random_store("hnsw", embedder).nprobe = 4
