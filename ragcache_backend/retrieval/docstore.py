"""Document store: documents plus a Faiss index over their embeddings, persisted with checksums.

Retrieval for RAGCache (SPEC §2 "Retrieval"): inner product on L2-normalised vectors (cosine),
``IndexFlatIP`` for small corpora and ``IndexIVFFlat`` (nlist ~ 4 sqrt(n)) for large ones, or a
sharded HNSW (:class:`~ragcache_backend.retrieval.hnsw.ShardedHNSW`) on request.
:meth:`DocumentStore.search_stages` is the pipelined vector search of RAGCache §5.3 (dynamic
speculative pipelining): the search runs in stages and yields the current top-k after each, the
last stage equal to a plain :meth:`DocumentStore.search` (:meth:`DocumentStore.asearch_stages`
is its async form). Every search passes its own parameters (nprobe, efSearch) to Faiss; no search
changes a shared index's settings.

On disk a store is a folder of ``documents.jsonl``, ``index.faiss`` (Faiss' own format, never
pickle) and ``manifest.json`` with the sha256 of both, written and verified by
:mod:`ragcache_backend.retrieval.docstore_io`.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import hashlib
import logging
import math
import os
import threading
from collections.abc import AsyncIterator, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from ragcache_backend.retrieval.docstore_io import MANIFEST, read_store, write_store
from ragcache_backend.retrieval.documents import CHUNKER_VERSION, Document, corpus_files, load_corpus
from ragcache_backend.retrieval.embedder import DEFAULT_EMBEDDER_NAME, Embedder
from ragcache_backend.retrieval.hnsw import ShardedHNSW
from ragcache_backend.errors import CorpusError, CorruptFileError, EmptyQueryError, InvalidRequestError

__all__ = ["DocumentStore", "IndexKind", "ScoredDocument", "build_index", "corpus_fingerprint",
           "default_store_dir"]

log = logging.getLogger(__name__)

_EMBED_CHUNK = 64  # texts per embedder call while building (the progress bar moves after each)
_EMBED_BATCH = 32  # texts per forward pass of the embedder
_TIE_MARGIN = 8  # extra candidates fetched so that score ties at rank k break the same way


class IndexKind(str, enum.Enum):
    """Faiss index type: exact ``IndexFlatIP``, approximate ``IndexIVFFlat`` or sharded HNSW."""

    FLAT = "flat"
    IVF = "ivf"
    HNSW = "hnsw"


@dataclass(slots=True, frozen=True)
class ScoredDocument:
    """A search hit: ``score`` is the cosine similarity, ``rank`` its 0-based position."""

    document: Document
    score: float
    rank: int


class DocumentStore:
    """Documents (insertion order, ids unique) and a Faiss inner-product index whose id i is
    ``documents[i]``. Build with :meth:`build`, reopen with :meth:`load`. Safe to search from
    several threads; :meth:`add_documents` is serialised with searches by a lock.
    """

    def __init__(self, documents: Sequence[Document], index: faiss.Index | ShardedHNSW, embedder: Embedder, *,
                 nprobe: int | None = None, corpus_fingerprint: str | None = None) -> None:
        if index.ntotal != len(documents):
            raise InvalidRequestError(f"index holds {index.ntotal} vectors for {len(documents)} documents")
        self._documents = list(documents)
        self._positions = {doc.doc_id: i for i, doc in enumerate(self._documents)}
        self._index = index
        self._embedder = embedder
        self._kind = (IndexKind.HNSW if isinstance(index, ShardedHNSW)
                      else IndexKind.IVF if isinstance(index, faiss.IndexIVF) else IndexKind.FLAT)
        self._nprobe: int | None = None
        if self._kind is IndexKind.IVF:
            self._nprobe = min(index.nlist, nprobe or index.nprobe)
        self.corpus_fingerprint = corpus_fingerprint
        self._lock = threading.RLock()

    @classmethod
    def build(cls, documents: Sequence[Document], embedder: Embedder, *, progress: bool = True,
              ivf_min_docs: int = 4096, nprobe: int | None = None, kind: IndexKind | str | None = None,
              vectors: np.ndarray | None = None, hnsw_shards: int = 8, ef_search: int = 64) -> DocumentStore:
        """Embed ``documents`` (duplicates by id dropped) and index them.

        ``kind`` None: below ``ivf_min_docs`` documents the index is exact (``IndexFlatIP``);
        otherwise an ``IndexIVFFlat`` with nlist = round(4 sqrt(n)) lists, trained on the vectors,
        searched with ``nprobe`` lists (default ceil(nlist / 8)). ``kind`` "flat", "ivf" or "hnsw"
        forces one (HNSW: ``hnsw_shards`` graphs searched with ``ef_search``, see
        :class:`~ragcache_backend.retrieval.hnsw.ShardedHNSW`). ``vectors``: float32 ``[n, dim]``
        L2-normalised embeddings of ``documents`` already computed with ``embedder`` (no
        duplicates then), e.g. by a benchmark that caches them.

        Raises CorpusError for no documents, InvalidRequestError for an unknown kind or vectors
        of the wrong shape.
        """
        unique = _unique(documents, {})
        if not unique:
            raise CorpusError("no documents to index")
        try:
            kind = IndexKind(kind) if kind is not None else None
        except ValueError:
            raise InvalidRequestError(f"index kind must be flat, ivf or hnsw, got {kind!r}") from None
        if vectors is None:
            vectors = _embed_all(embedder, [doc.text for doc in unique], progress)
        elif vectors.shape[0] != len(unique) or len(unique) != len(documents):
            raise InvalidRequestError(f"{vectors.shape[0]} vectors for {len(documents)} documents "
                                      f"({len(unique)} distinct); pass one vector per distinct document")
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        n, dim = vectors.shape
        if kind is None:
            kind = IndexKind.FLAT if n < max(ivf_min_docs, 2) else IndexKind.IVF
        if kind is IndexKind.HNSW:
            return cls(unique, ShardedHNSW.build(vectors, num_shards=hnsw_shards, ef_search=ef_search), embedder)
        if kind is IndexKind.FLAT:
            index: faiss.Index = faiss.IndexFlatIP(dim)
            nprobe = None
        else:
            nlist = max(1, min(n, round(4 * math.sqrt(n))))
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.cp.min_points_per_centroid = 1  # small corpora: no "too few points" warning
            index.train(vectors)
            nprobe = min(nlist, nprobe or math.ceil(nlist / 8))
            index.nprobe = nprobe
        index.add(vectors)
        return cls(unique, index, embedder, nprobe=nprobe)

    # -- read access -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._documents)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._positions

    def get(self, doc_id: str) -> Document:
        """The document with this id; raises KeyError if absent."""
        return self._documents[self._positions[doc_id]]

    @property
    def documents(self) -> tuple[Document, ...]:
        return tuple(self._documents)

    @property
    def embedder(self) -> Embedder:
        return self._embedder

    @property
    def index_kind(self) -> IndexKind:
        return self._kind

    @property
    def nprobe(self) -> int | None:
        """IVF lists probed per search; None for a flat (exact) or HNSW index."""
        return self._nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        """Probe ``value`` IVF lists in this store's later searches (each search passes it to
        Faiss; the index itself is not changed). Raises InvalidRequestError for a non-IVF store or
        ``value`` outside ``1..nlist``."""
        if self._kind is not IndexKind.IVF:
            raise InvalidRequestError("only an IVF store has nprobe")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self._index.nlist:
            raise InvalidRequestError(f"nprobe must be an integer in 1..{self._index.nlist}, got {value!r}")
        self._nprobe = value

    @property
    def nlist(self) -> int | None:
        """IVF lists in the index; None for a flat or HNSW index."""
        return int(self._index.nlist) if self._kind is IndexKind.IVF else None

    def with_nprobe(self, nprobe: int) -> DocumentStore:
        """A store sharing this one's documents and index, searching ``nprobe`` IVF lists (a share
        of the index, as RAGCache Table 3 varies it). The shared index is not changed.

        Raises InvalidRequestError for a non-IVF store or ``nprobe`` outside ``1..nlist``.
        """
        view = copy.copy(self)  # shallow: the same documents, index and lock
        view.nprobe = nprobe
        return view

    # -- search ------------------------------------------------------------------------------
    def search(self, query: str, k: int) -> list[ScoredDocument]:
        """The ``min(k, len(self))`` documents most similar to ``query``, best first.

        IVF may return fewer when the probed lists hold fewer vectors. Raises
        InvalidRequestError (k < 1) and EmptyQueryError (blank query).
        """
        return self.search_vector(self._embed_query(query, k), k)

    def search_many(self, queries: Sequence[str], k: int, *, cache_dir: Path | None = None) -> list[list[ScoredDocument]]:
        """:meth:`search` for each of ``queries``, the queries embedded together in batches (one
        embedder call instead of one per query: tens of times faster for the ~180 FAQ questions).

        ``cache_dir``: keep the queries' vectors there (one ``.npy`` file per embedder and list of
        queries, written atomically), so that the same queries later need no embedder at all (not
        even loading it: seconds). A cache file that is unreadable or of the wrong shape is
        recomputed and replaced.

        Raises InvalidRequestError (k < 1, or a single string) and EmptyQueryError (a blank query).
        """
        if isinstance(queries, str):
            raise InvalidRequestError("search_many() takes a sequence of queries; use search(query, k)")
        self._check_k(k)
        for query in queries:
            if not isinstance(query, str) or not query.strip():
                raise EmptyQueryError("a query is empty; every query needs some text")
        if not queries:
            return []
        vectors = _query_vectors(self._embedder, list(queries), Path(cache_dir) if cache_dir is not None else None)
        return [self.search_vector(vector, k) for vector in vectors]

    def search_vector(self, vector: np.ndarray, k: int) -> list[ScoredDocument]:
        """Like :meth:`search` for a query vector, float32 [dim], L2-normalised."""
        k = self._check_k(k)
        query, keep = _as_query(vector, self._index.d), k + _TIE_MARGIN
        with self._lock:
            if self._kind is IndexKind.HNSW:
                scores, ids = self._index.search_shards(query, keep, range(self._index.num_shards))
                return self._top(_merge(_EMPTY, scores, ids, keep), k)
            params = faiss.SearchParametersIVF(nprobe=self._nprobe) if self._kind is IndexKind.IVF else None
            scores, ids = self._index.search(query, keep, params=params)
        return self._top(_merge(_EMPTY, scores[0], ids[0], keep), k)

    def search_stages(self, query: str, k: int, num_stages: int) -> Iterator[list[ScoredDocument]]:
        """Pipelined search (RAGCache §5.3): yield the current top-k after each stage.

        IVF: the nprobe lists from one coarse-quantizer search are scanned in ``num_stages``
        consecutive slices (``search_preassigned``); HNSW: the shards in ``num_stages`` groups;
        flat: the ids in ``num_stages`` ranges. Yields ``min(num_stages, nprobe)`` (IVF),
        ``min(num_stages, shards)`` (HNSW) or ``min(num_stages, len(self))`` (flat) lists; the
        last equals ``search(query, k)`` (ids, order and scores), and the stages together cost
        about one plain search. Raises InvalidRequestError (k < 1 or num_stages < 1) and
        EmptyQueryError when called.
        """
        _check_stages(num_stages)
        return self._stages(_as_query(self._embed_query(query, k), self._index.d), self._check_k(k), num_stages)

    def search_vector_stages(self, vector: np.ndarray, k: int, num_stages: int) -> Iterator[list[ScoredDocument]]:
        """Like :meth:`search_stages` for a query vector (float32 [dim], L2-normalised); the last
        stage equals :meth:`search_vector`."""
        _check_stages(num_stages)
        return self._stages(_as_query(vector, self._index.d), self._check_k(k), num_stages)

    def _stages(self, query: np.ndarray, k: int, num_stages: int) -> Iterator[list[ScoredDocument]]:
        keep, best = k + _TIE_MARGIN, _EMPTY
        if self._kind is IndexKind.IVF:
            nprobe = self._nprobe  # read once: a search keeps its width if nprobe is set meanwhile
            params = faiss.SearchParametersIVF(nprobe=nprobe)
            with self._lock:
                list_scores, lists = self._index.quantizer.search(query, nprobe)
            for part in np.array_split(np.arange(nprobe), min(num_stages, nprobe)):
                # Faiss skips list ids < 0: probe only this slice, keep nprobe-wide arrays.
                stage_lists = np.full_like(lists, -1)
                stage_lists[0, part] = lists[0, part]
                with self._lock:
                    scores, ids = _search_preassigned(self._index, query, keep, stage_lists, list_scores, params)
                best = _merge(best, scores[0], ids[0], keep)
                yield self._top(best, k)
            return
        if self._kind is IndexKind.HNSW:
            shards = np.arange(self._index.num_shards)
            for part in np.array_split(shards, min(num_stages, len(shards))):
                with self._lock:
                    scores, ids = self._index.search_shards(query, keep, part.tolist())
                best = _merge(best, scores, ids, keep)
                yield self._top(best, k)
            return
        for part in np.array_split(np.arange(len(self)), min(num_stages, len(self))):
            selector = faiss.IDSelectorRange(int(part[0]), int(part[-1]) + 1)
            with self._lock:
                scores, ids = self._index.search(query, keep, params=faiss.SearchParameters(sel=selector))
            best = _merge(best, scores[0], ids[0], keep)
            yield self._top(best, k)

    async def asearch_stages(self, query: str, k: int, num_stages: int) -> AsyncIterator[list[ScoredDocument]]:
        """Async :meth:`search_stages`: each stage (and the query's embedding) runs on a worker
        thread, so an event loop keeps serving while the search runs. Same results and errors."""
        stages = await asyncio.to_thread(self.search_stages, query, k, num_stages)
        done = object()
        while (hits := await asyncio.to_thread(next, stages, done)) is not done:
            yield hits

    def _embed_query(self, query: str, k: int) -> np.ndarray:
        self._check_k(k)
        if not isinstance(query, str) or not query.strip():
            raise EmptyQueryError("the query is empty; ask a question with some text in it")
        return self._embedder.embed_query(query)

    def _check_k(self, k: int) -> int:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidRequestError(f"k must be an integer >= 1, got {k!r}")
        return min(k, len(self))

    def _top(self, best: tuple[np.ndarray, np.ndarray], k: int) -> list[ScoredDocument]:
        scores, ids = best
        return [ScoredDocument(self._documents[int(i)], float(s), rank)
                for rank, (s, i) in enumerate(zip(scores[:k], ids[:k]))]

    # -- mutation ----------------------------------------------------------------------------
    def add_documents(self, documents: Iterable[Document], embedder: Embedder | None = None,
                      *, progress: bool = False) -> list[Document]:
        """Embed and append the documents whose ids are new; returns those, in order.

        The index kind and IVF lists stay as built. Raises InvalidRequestError if ``embedder``
        is not the store's model.
        """
        if embedder is not None and embedder.name != self._embedder.name:
            raise InvalidRequestError(f"store uses embedder {self._embedder.name}, got {embedder.name}")
        with self._lock:
            new = _unique(documents, self._positions)
            if new:
                self._index.add(_embed_all(self._embedder, [d.text for d in new], progress))
                for doc in new:
                    self._positions[doc.doc_id] = len(self._documents)
                    self._documents.append(doc)
        return new

    # -- persistence -------------------------------------------------------------------------
    def save(self, directory: Path, *, corpus_fingerprint: str | None = None) -> None:
        """Write the store to ``directory`` (created if needed), each file atomically
        (:func:`~ragcache_backend.retrieval.docstore_io.write_store`)."""
        if corpus_fingerprint is not None:
            self.corpus_fingerprint = corpus_fingerprint
        with self._lock:
            documents = list(self._documents)
            fields = {"embedder": self._embedder.name, "dim": int(self._index.d), "count": len(documents),
                      "index_kind": self._kind.value, "nprobe": self._nprobe,
                      "corpus_fingerprint": self.corpus_fingerprint}
            if self._kind is IndexKind.HNSW:
                index_bytes, fields["hnsw_shards"] = self._index.to_bytes()
                fields["ef_search"] = self._index.ef_search
            else:
                index_bytes = faiss.serialize_index(self._index).tobytes()
        write_store(directory, documents, index_bytes, fields)

    @classmethod
    def load(cls, directory: Path, *, embedder: Embedder | None = None) -> DocumentStore:
        """Open a store written by :meth:`save`, verifying schema and checksums.

        Raises CorruptFileError (missing file, bad JSON or schema, checksum or size mismatch,
        unreadable index) and InvalidRequestError if ``embedder`` is not the model the store was
        built with (without ``embedder`` the default model is used and must be the one recorded).
        """
        directory = Path(directory)
        manifest, documents, index = read_store(directory)
        if embedder is None:
            if manifest["embedder"] != DEFAULT_EMBEDDER_NAME:
                raise InvalidRequestError(f"store {directory} was built with embedder "
                                          f"{manifest['embedder']}; pass embedder=Embedder(<its path>)")
            embedder = Embedder()
        elif embedder.name != manifest["embedder"]:
            raise InvalidRequestError(f"store {directory} was built with embedder "
                                      f"{manifest['embedder']}, not {embedder.name}")
        return cls(documents, index, embedder, nprobe=manifest["nprobe"],
                   corpus_fingerprint=manifest["corpus_fingerprint"])


# -- helpers ---------------------------------------------------------------------------------
_EMPTY = (np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64))


def _unique(documents: Iterable[Document], present: Container[str]) -> list[Document]:
    """First occurrence of each id not in ``present``, in order."""
    unique: dict[str, Document] = {}
    for doc in documents:
        if doc.doc_id not in present:
            unique.setdefault(doc.doc_id, doc)
    return list(unique.values())


def _merge(best: tuple[np.ndarray, np.ndarray], scores: np.ndarray, ids: np.ndarray,
           keep: int) -> tuple[np.ndarray, np.ndarray]:
    """Top ``keep`` of two candidate lists, by score then id (ids < 0 mean "no result")."""
    all_scores, all_ids = np.concatenate([best[0], scores]), np.concatenate([best[1], ids])
    found = all_ids >= 0
    all_scores, all_ids = all_scores[found], all_ids[found]
    order = np.lexsort((all_ids, -all_scores))[:keep]
    return all_scores[order], all_ids[order]


def _check_stages(num_stages: int) -> None:
    if num_stages < 1:
        raise InvalidRequestError(f"num_stages must be >= 1, got {num_stages}")


def _search_preassigned(index: faiss.IndexIVF, query: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray,
                        params: faiss.SearchParametersIVF) -> tuple[np.ndarray, np.ndarray]:
    """``IndexIVF::search_preassigned`` with ``params`` (its nprobe is the width of ``lists``).

    Faiss' Python wrapper refuses ``params`` here and would use the index's own ``nprobe``; the
    C++ method it wraps (``search_preassigned_c``) takes them, so the shared index is never changed.
    """
    scores = np.empty((1, k), dtype=np.float32)
    ids = np.empty((1, k), dtype=np.int64)
    lists = np.ascontiguousarray(lists, dtype=np.int64)
    list_scores = np.ascontiguousarray(list_scores, dtype=np.float32)
    index.search_preassigned_c(1, faiss.swig_ptr(query), k, faiss.swig_ptr(lists), faiss.swig_ptr(list_scores),
                               faiss.swig_ptr(scores), faiss.swig_ptr(ids), False, params)
    return scores, ids


def _as_query(vector: np.ndarray, dim: int) -> np.ndarray:
    query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, -1)
    if query.shape[1] != dim:
        raise InvalidRequestError(f"query vector has {query.shape[1]} dimensions, the index {dim}")
    return query


def _embed_all(embedder: Embedder, texts: list[str], progress: bool) -> np.ndarray:
    """Embed ``texts``: float32 ``[len(texts), dim]``, row i the vector of ``texts[i]``.

    The texts are embedded longest first, in calls of :data:`_EMBED_CHUNK` texts (batches of
    :data:`_EMBED_BATCH`), so that a batch's texts have about the same length and little of the
    work is padding (9% less on the Python docs than batches in corpus order). With ``progress`` a
    tqdm bar counts the tokens the embedder reads (each text's length capped at the model's
    window) and the chunks done: the tokens, not the chunks, are what the time is proportional to,
    so its rate and time left hold while the chunks get shorter.
    """
    from tqdm.auto import tqdm

    if not texts:
        return np.zeros((0, embedder.dim), dtype=np.float32)
    lengths = embedder.token_lengths(texts)
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])  # stable: ties keep corpus order
    vectors = np.empty((len(texts), embedder.dim), dtype=np.float32)
    with tqdm(total=sum(lengths), desc=f"embedding {len(texts):,} chunks", unit="tok", unit_scale=True,
              disable=not progress) as bar:
        for start in range(0, len(order), _EMBED_CHUNK):
            part = order[start:start + _EMBED_CHUNK]
            vectors[part] = embedder.embed([texts[i] for i in part], batch_size=_EMBED_BATCH)
            bar.set_postfix_str(f"{start + len(part):,}/{len(order):,} chunks", refresh=False)
            bar.update(sum(lengths[i] for i in part))  # redraws the bar, with the postfix
    return vectors


def _query_vectors(embedder: Embedder, queries: list[str], cache_dir: Path | None) -> np.ndarray:
    """The queries' vectors, float32 ``[len(queries), dim]``: read from ``cache_dir`` when it holds
    them for this embedder and these queries, else embedded (and saved there)."""
    if cache_dir is None:
        return embedder.embed(queries)
    key = hashlib.sha256("\0".join([embedder.name, *queries]).encode("utf-8")).hexdigest()[:24]
    path = cache_dir / f"queries-{key}.npy"
    try:
        vectors = np.load(path, allow_pickle=False)
        if vectors.dtype == np.float32 and vectors.ndim == 2 and vectors.shape[0] == len(queries):
            return vectors
        log.info("query vector cache %s has the wrong shape; recomputing it", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.info("query vector cache %s is unreadable (%s); recomputing it", path, exc)
    vectors = embedder.embed(queries)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            np.save(handle, vectors, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as exc:  # a cache: the search goes on without it
        tmp.unlink(missing_ok=True)
        log.warning("cannot write the query vector cache %s: %s", path, exc)
    return vectors


# -- corpus -> persisted store ----------------------------------------------------------------
def default_store_dir(corpus_dir: Path) -> Path:
    """``$RAGCACHE_HOME/indexes/<first 16 hex of sha256(resolved corpus path)>``;
    RAGCACHE_HOME defaults to ``~/.cache/ragcache``."""
    home = Path(os.environ.get("RAGCACHE_HOME") or "~/.cache/ragcache").expanduser()
    key = hashlib.sha256(str(Path(corpus_dir).resolve()).encode("utf-8")).hexdigest()[:16]
    return home / "indexes" / key


def corpus_fingerprint(corpus_dir: Path) -> str:
    """sha256 hex of the corpus files' relative paths, sizes and mtimes (and the chunker version).

    Raises CorpusError for a missing folder or a file instead of a folder.
    """
    corpus_dir = Path(corpus_dir)
    digest = hashlib.sha256(f"chunker {CHUNKER_VERSION}\n".encode())
    for path in corpus_files(corpus_dir):
        stat = path.stat()
        rel = path.relative_to(corpus_dir).as_posix()
        digest.update(f"{rel}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode("utf-8", "replace"))
    return digest.hexdigest()


def build_index(corpus_dir: Path, store_dir: Path | None = None, *, embedder: Embedder | None = None,
                progress: bool = True, rebuild: bool = False) -> DocumentStore:
    """The store for ``corpus_dir``: loaded from ``store_dir`` (default :func:`default_store_dir`)
    when its manifest has the corpus' current fingerprint and embedder, else built and saved.

    A store built from an older corpus or another embedder is rebuilt (logged).

    Raises:
        CorpusError: a missing or empty corpus.
        CorruptFileError: the saved store fails its checksums or schema; nothing is overwritten
            silently: the message says to rebuild with ``rebuild=True`` (``ragcache index DIR --rebuild``).
    """
    corpus_dir = Path(corpus_dir)
    fingerprint = corpus_fingerprint(corpus_dir)
    store_dir = Path(store_dir) if store_dir is not None else default_store_dir(corpus_dir)
    embedder = embedder if embedder is not None else Embedder()
    if not rebuild and (store_dir / MANIFEST).exists():
        try:
            store = DocumentStore.load(store_dir, embedder=embedder)
        except CorruptFileError as exc:
            raise CorruptFileError(
                f"{exc}; rebuild it with `ragcache index {corpus_dir} --rebuild` (or build_index(..., rebuild=True))"
            ) from exc
        except InvalidRequestError as exc:  # built with another embedder
            log.warning("rebuilding the document store in %s: %s", store_dir, exc)
        else:
            if store.corpus_fingerprint == fingerprint:
                return store
            log.info("corpus %s changed; rebuilding the document store in %s", corpus_dir, store_dir)
    store = DocumentStore.build(load_corpus(corpus_dir), embedder, progress=progress)
    store.save(store_dir, corpus_fingerprint=fingerprint)
    return store
