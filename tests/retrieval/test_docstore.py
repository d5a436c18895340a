from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ragcache_backend.retrieval.docstore import (
    DocumentStore,
    IndexKind,
    build_index,
    corpus_fingerprint,
    default_store_dir,
)
from ragcache_backend.retrieval.documents import Document
from ragcache_backend.retrieval.embedder import Embedder
from ragcache_backend.errors import CorpusError, CorruptFileError, EmptyQueryError, InvalidRequestError

TOPICS = {
    "sorting": "To sort a list in place call list.sort(); sorted() returns a new sorted list. "
               "Pass key= to order by a computed value and reverse=True for descending order.",
    "files": "Open a file with open(path, 'r') inside a with statement so it is closed; "
             "read() returns the whole content and readline() one line at a time.",
    "regex": "The re module provides regular expressions: re.search finds a pattern anywhere "
             "in a string and re.sub replaces every match with a replacement text.",
    "threads": "The threading module runs functions concurrently in threads; use a Lock to "
               "protect shared state and join() to wait for a thread to finish.",
    "http": "urllib.request.urlopen fetches a web page over HTTP; the response object has "
            "read() for the body and a status attribute with the HTTP status code.",
    "decimal": "The decimal module gives exact decimal arithmetic for money, avoiding the "
               "binary floating point rounding errors of float such as 0.1 + 0.2.",
}
ADJECTIVES = ["red", "quiet", "ancient", "rapid", "hollow", "bright", "frozen", "gentle", "heavy", "wild"]
NOUNS = ["river", "engine", "violin", "glacier", "market", "falcon", "lantern", "orchard", "tower", "comet"]
PLACES = ["harbour", "desert", "library", "station", "valley", "island"]


def _doc(text: str, title: str = "t") -> Document:
    return Document.from_text(text, source=f"{title}.txt", title=title)


def _synthetic(n: int) -> list[Document]:
    return [_doc(f"Note {i}: the {ADJECTIVES[i % 10]} {NOUNS[i // 10 % 10]} was seen near the "
                 f"{PLACES[i % 6]} on day {i % 29}.", f"n{i}") for i in range(n)]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(device="cpu")


@pytest.fixture(scope="module")
def store(embedder: Embedder) -> DocumentStore:
    return DocumentStore.build([_doc(text, title) for title, text in TOPICS.items()], embedder,
                               progress=False)


@pytest.fixture(scope="module")
def ivf_store(embedder: Embedder) -> DocumentStore:
    return DocumentStore.build(_synthetic(300), embedder, progress=False, ivf_min_docs=100)


@pytest.fixture(scope="module")
def saved(store: DocumentStore, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved")
    store.save(directory, corpus_fingerprint="abc")
    return directory


def _ids(results: list) -> list[str]:
    return [r.document.doc_id for r in results]


def test_embedder_vectors_are_normalised_float32(embedder: Embedder) -> None:
    vectors = embedder.embed(["one text", "another text"])
    assert vectors.shape == (2, embedder.dim) == (2, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, 384)
    assert embedder.embed_query("one text").shape == (384,)
    with pytest.raises(EmptyQueryError):
        embedder.embed_query("  \n")


@pytest.mark.parametrize(("query", "title"), [
    ("How can I put the items of a sequence in ascending order?", "sorting"),
    ("pattern matching and substitution in strings", "regex"),
    ("download the contents of a URL", "http"),
    ("why is 0.1 plus 0.2 not exactly 0.3 and how do I compute currency amounts", "decimal"),
])
def test_relevant_document_ranks_first(store: DocumentStore, query: str, title: str) -> None:
    results = store.search(query, 3)
    assert results[0].document.title == title
    assert [r.rank for r in results] == [0, 1, 2]
    assert results[0].score > results[1].score >= results[2].score


def test_lookup_and_container_protocol(store: DocumentStore) -> None:
    assert len(store) == len(TOPICS) and store.index_kind is IndexKind.FLAT and store.nprobe is None
    first = store.documents[0]
    assert first.title == "sorting" and first.doc_id in store and store.get(first.doc_id) == first
    assert "0000000000000000" not in store
    with pytest.raises(KeyError):
        store.get("0000000000000000")


def test_k_is_clamped_and_validated(store: DocumentStore) -> None:
    assert len(store.search("threads", 100)) == len(TOPICS)
    for bad_k in (0, -1, True, 1.5):
        with pytest.raises(InvalidRequestError):
            store.search("threads", bad_k)  # type: ignore[arg-type]
    for blank in ("", "   \t"):
        with pytest.raises(EmptyQueryError):
            store.search(blank, 2)
        with pytest.raises(EmptyQueryError):
            store.search_stages(blank, 2, 2)
    with pytest.raises(InvalidRequestError):
        store.search_stages("threads", 2, 0)


def test_build_needs_documents(embedder: Embedder) -> None:
    with pytest.raises(CorpusError):
        DocumentStore.build([], embedder, progress=False)


def test_flat_staged_search_ends_with_plain_search(store: DocumentStore) -> None:
    for num_stages, expected in ((1, 1), (3, 3), (100, len(TOPICS))):
        stages = list(store.search_stages("reading a text file line by line", 3, num_stages))
        assert len(stages) == expected
        assert stages[-1] == store.search("reading a text file line by line", 3)


def test_ivf_index_parameters(ivf_store: DocumentStore) -> None:
    nlist = round(4 * math.sqrt(300))
    assert ivf_store.index_kind is IndexKind.IVF and len(ivf_store) == 300
    assert ivf_store.nprobe == math.ceil(nlist / 8)


@pytest.mark.parametrize("query", ["a frozen glacier by the harbour", "Note 17", "bright comet day 3"])
def test_ivf_staged_search_ends_with_plain_search(ivf_store: DocumentStore, query: str) -> None:
    nprobe = ivf_store.nprobe
    assert nprobe is not None
    stages = list(ivf_store.search_stages(query, 5, 4))
    assert len(stages) == 4
    assert stages[-1] == ivf_store.search(query, 5)
    kth_scores = [s[-1].score for s in stages if len(s) == 5]
    assert kth_scores == sorted(kth_scores)  # the k-th best only improves stage after stage
    assert len(list(ivf_store.search_stages(query, 5, 1000))) == nprobe


def test_save_load_round_trip(store: DocumentStore, saved: Path, embedder: Embedder) -> None:
    assert {p.name for p in saved.iterdir()} == {"manifest.json", "documents.jsonl", "index.faiss"}
    loaded = DocumentStore.load(saved, embedder=embedder)
    assert loaded.documents == store.documents and loaded.corpus_fingerprint == "abc"
    for query in ("sort numbers", "locks and concurrency"):
        assert loaded.search(query, 4) == store.search(query, 4)
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["count"] == len(TOPICS) and manifest["dim"] == 384
    assert manifest["index_kind"] == "flat" and manifest["nprobe"] is None
    assert set(manifest["files"]) == {"documents.jsonl", "index.faiss"}


def test_ivf_round_trip(ivf_store: DocumentStore, tmp_path: Path, embedder: Embedder) -> None:
    ivf_store.save(tmp_path)
    loaded = DocumentStore.load(tmp_path, embedder=embedder)
    assert loaded.index_kind is IndexKind.IVF and loaded.nprobe == ivf_store.nprobe
    assert loaded.search("gentle falcon", 5) == ivf_store.search("gentle falcon", 5)
    assert list(loaded.search_stages("gentle falcon", 5, 3))[-1] == ivf_store.search("gentle falcon", 5)


def _rewrite_manifest(directory: Path, change: Callable[[dict], None]) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    change(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _resign(directory: Path, name: str, data: bytes) -> None:
    """Replace a file and fix its checksum, to reach the checks behind the checksum."""
    import hashlib

    (directory / name).write_bytes(data)
    _rewrite_manifest(directory, lambda m: m["files"][name].update(
        sha256=hashlib.sha256(data).hexdigest(), bytes=len(data)))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "missing manifest": lambda d: (d / "manifest.json").unlink(),
    "missing documents": lambda d: (d / "documents.jsonl").unlink(),
    "missing index": lambda d: (d / "index.faiss").unlink(),
    "manifest not json": lambda d: (d / "manifest.json").write_text("{not json"),
    "manifest truncated": lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text()[:40]),
    "manifest wrong format": lambda d: _rewrite_manifest(d, lambda m: m.update(format="other")),
    "manifest future version": lambda d: _rewrite_manifest(d, lambda m: m.update(format_version=99)),
    "manifest count not int": lambda d: _rewrite_manifest(d, lambda m: m.update(count="6")),
    "manifest lacks dim": lambda d: _rewrite_manifest(d, lambda m: m.pop("dim")),
    "manifest lacks checksum": lambda d: _rewrite_manifest(d, lambda m: m["files"].pop("index.faiss")),
    "documents truncated": lambda d: (d / "documents.jsonl").write_bytes(
        (d / "documents.jsonl").read_bytes()[:-50]),
    "documents byte flipped": lambda d: _flip_byte(d / "documents.jsonl"),
    "index truncated": lambda d: (d / "index.faiss").write_bytes((d / "index.faiss").read_bytes()[:100]),
    "index byte flipped": lambda d: _flip_byte(d / "index.faiss"),
    "documents bad json (re-signed)": lambda d: _resign(d, "documents.jsonl", b"{oops\n"),
    "doc_id not content hash (re-signed)": lambda d: _resign(d, "documents.jsonl", (
        d / "documents.jsonl").read_bytes().replace(b"list.sort()", b"list.sort( )")),
    "documents missing a row (re-signed)": lambda d: _resign(d, "documents.jsonl", b"".join(
        (d / "documents.jsonl").read_bytes().splitlines(keepends=True)[:-1])),
    "index garbage (re-signed)": lambda d: _resign(d, "index.faiss", b"\x00" * 64),
    "dim mismatch": lambda d: _rewrite_manifest(d, lambda m: m.update(dim=100)),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corruption_is_detected(saved: Path, tmp_path: Path, embedder: Embedder,
                                corrupt: Callable[[Path], None]) -> None:
    directory = tmp_path / "store"
    shutil.copytree(saved, directory)
    corrupt(directory)
    with pytest.raises(CorruptFileError, match=str(directory)):
        DocumentStore.load(directory, embedder=embedder)


def test_load_rejects_another_embedder(saved: Path) -> None:
    with pytest.raises(InvalidRequestError, match="built with embedder"):
        DocumentStore.load(saved, embedder=Embedder(name="some-other-model"))


def test_add_documents_skips_known_ids(embedder: Embedder) -> None:
    local = DocumentStore.build(_synthetic(5), embedder, progress=False)
    new = _doc("Photosynthesis turns sunlight, water and carbon dioxide into sugar in leaves.")
    added = local.add_documents([*_synthetic(5), new, new], embedder)
    assert added == [new] and len(local) == 6 and local.documents[-1] == new
    assert local.search("how do plants make food from light", 1)[0].document == new


def _write_corpus(folder: Path) -> None:
    folder.mkdir()
    for title, text in TOPICS.items():
        (folder / f"{title}.md").write_text(f"# {title}\n\n{text}\n")


def test_build_index_reuses_then_rebuilds(tmp_path: Path, embedder: Embedder,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    corpus, store_dir = tmp_path / "corpus", tmp_path / "store"
    _write_corpus(corpus)
    builds = []
    original = DocumentStore.build.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(DocumentStore, "build", classmethod(
        lambda cls, *a, **kw: builds.append(1) or original(cls, *a, **kw)))

    first = build_index(corpus, store_dir, embedder=embedder, progress=False)
    assert len(builds) == 1 and first.corpus_fingerprint == corpus_fingerprint(corpus)
    again = build_index(corpus, store_dir, embedder=embedder, progress=False)
    assert len(builds) == 1 and again.documents == first.documents

    changed = corpus / "files.md"
    changed.write_text("# files\n\nPathlib's Path.read_text reads a whole file into a string.\n")
    stat = changed.stat()
    os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    rebuilt = build_index(corpus, store_dir, embedder=embedder, progress=False)
    assert len(builds) == 2 and "Pathlib" in rebuilt.search("read a file into a string", 1)[0].document.text

    (store_dir / "index.faiss").write_bytes(b"broken")
    with pytest.raises(CorruptFileError, match="--rebuild"):  # corrupt: a clear error, no silent rebuild
        build_index(corpus, store_dir, embedder=embedder, progress=False)
    assert len(builds) == 2
    build_index(corpus, store_dir, embedder=embedder, progress=False, rebuild=True)
    assert len(builds) == 3


def test_default_store_dir(tmp_path: Path, embedder: Embedder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus"
    _write_corpus(corpus)
    directory = default_store_dir(corpus)
    assert directory.parent == tmp_path / "home" / "indexes" and len(directory.name) == 16
    assert default_store_dir(tmp_path / "corpus" / ".." / "corpus") == directory
    build_index(corpus, embedder=embedder, progress=False)
    assert (directory / "manifest.json").is_file()
    monkeypatch.delenv("RAGCACHE_HOME")
    assert default_store_dir(corpus).parent == Path.home() / ".cache" / "ragcache" / "indexes"


def test_build_index_reports_bad_corpus(tmp_path: Path, embedder: Embedder) -> None:
    with pytest.raises(CorpusError):
        build_index(tmp_path / "nope", tmp_path / "store", embedder=embedder, progress=False)


class _RecordingEmbedder:
    """An embedder stand-in: a text's vector is its length in one-hot-ish form; records each call."""

    name = "recording"
    dim = 8

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def token_lengths(self, texts):
        return [min(len(t), 40) for t in texts]  # capped, as the real model's window caps them

    def embed(self, texts, *, batch_size: int = 64, progress: bool = False):
        self.calls.append(list(texts))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in zip(out, texts):
            row[len(text) % self.dim] = 1.0
        return out


def test_indexing_embeds_longest_first_and_keeps_each_vector_with_its_text() -> None:
    from ragcache_backend.retrieval import docstore

    texts = [f"{'x' * (i * 7 % 53)}#{i}" for i in range(150)]
    fake = _RecordingEmbedder()
    vectors = docstore._embed_all(fake, texts, progress=False)
    expected = np.zeros((len(texts), fake.dim), dtype=np.float32)
    expected[np.arange(len(texts)), [len(t) % fake.dim for t in texts]] = 1.0
    np.testing.assert_array_equal(vectors, expected)  # row i is texts[i]'s vector
    flat = [t for call in fake.calls for t in call]
    assert sorted(flat) == sorted(texts) and len(flat) == len(texts)
    capped = fake.token_lengths(flat)
    assert capped == sorted(capped, reverse=True)  # longest (in tokens read) first
    assert all(len(call) <= docstore._EMBED_CHUNK for call in fake.calls)
    assert docstore._embed_all(fake, [], progress=False).shape == (0, fake.dim)


def test_indexing_progress_counts_tokens_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar's total is the tokens the embedder reads (what the time is proportional to, so its
    rate and ETA hold while chunks get shorter); it ends full, with every chunk counted."""
    import tqdm.auto

    from ragcache_backend.retrieval import docstore

    bars = []

    class Bar:
        def __init__(self, *, total, desc, unit, disable, **_):
            self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
            self.n, self.postfix = 0, ""
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            self.n += n

        def set_postfix_str(self, text, refresh=True):
            self.postfix = text

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    texts = ["y" * (10 + i % 60) for i in range(130)]
    fake = _RecordingEmbedder()
    docstore._embed_all(fake, texts, progress=True)
    (bar,) = bars
    assert not bar.disable and bar.unit == "tok" and "130 chunks" in bar.desc
    assert bar.total == sum(fake.token_lengths(texts)) == bar.n
    assert bar.postfix == "130/130 chunks"
    docstore._embed_all(fake, texts, progress=False)
    assert bars[-1].disable


def test_token_lengths_are_capped_at_the_model_window(embedder: Embedder) -> None:
    short, long = "a short text", "word " * 2000
    lengths = embedder.token_lengths([short, long])
    assert 3 < lengths[0] < 10 and lengths[1] == embedder._load().max_seq_length
    assert embedder.token_lengths([]) == []


def test_search_many_equals_one_search_per_query(store: DocumentStore) -> None:
    queries = ["sort a list in descending order", "protect shared state between threads", "exact money sums"]
    many = store.search_many(queries, 2)
    assert [_ids(hits) for hits in many] == [_ids(store.search(q, 2)) for q in queries]
    for hits, query in zip(many, queries):
        np.testing.assert_allclose([h.score for h in hits], [h.score for h in store.search(query, 2)], atol=1e-5)
    assert store.search_many([], 2) == []
    with pytest.raises(EmptyQueryError):
        store.search_many(["fine", "  "], 2)
    with pytest.raises(InvalidRequestError):
        store.search_many("one string", 2)
    with pytest.raises(InvalidRequestError):
        store.search_many(queries, 0)


def test_build_index_rebuilds_a_store_of_another_embedder(tmp_path: Path, embedder: Embedder,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    corpus, store_dir = tmp_path / "corpus", tmp_path / "store"
    _write_corpus(corpus)
    build_index(corpus, store_dir, embedder=embedder, progress=False)
    manifest = json.loads((store_dir / "manifest.json").read_text())
    other = Embedder(device="cpu", name="another-model")
    builds = []
    original = DocumentStore.build.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(DocumentStore, "build", classmethod(
        lambda cls, *a, **kw: builds.append(1) or original(cls, *a, **kw)))
    rebuilt = build_index(corpus, store_dir, embedder=other, progress=False)
    assert builds == [1] and rebuilt.embedder.name == "another-model"
    assert json.loads((store_dir / "manifest.json").read_text())["embedder"] != manifest["embedder"]


def test_search_many_keeps_query_vectors_between_runs(store: DocumentStore, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    queries = ["sort a list in descending order", "exact money sums"]
    cache = tmp_path / "vectors"
    first = store.search_many(queries, 2, cache_dir=cache)
    (saved,) = cache.glob("queries-*.npy")
    assert [_ids(h) for h in first] == [_ids(store.search(q, 2)) for q in queries]

    def no_embedder(*args, **kwargs):
        raise AssertionError("the embedder ran although the vectors were cached")

    with monkeypatch.context() as patch:
        patch.setattr(store.embedder, "embed", no_embedder)
        again = store.search_many(queries, 2, cache_dir=cache)
    assert [_ids(h) for h in again] == [_ids(h) for h in first]

    store.search_many(queries[:1], 2, cache_dir=cache)  # other queries: another file
    assert len(list(cache.glob("queries-*.npy"))) == 2
    saved.write_bytes(b"not an array")  # damaged: recomputed and replaced, never an error
    assert [_ids(h) for h in store.search_many(queries, 2, cache_dir=cache)] == [_ids(h) for h in first]
    assert np.load(saved).shape == (2, store.embedder.dim)
    np.save(saved, np.zeros((5, store.embedder.dim), dtype=np.float32))  # wrong shape: recomputed
    assert [_ids(h) for h in store.search_many(queries, 2, cache_dir=cache)] == [_ids(h) for h in first]
