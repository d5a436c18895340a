"""A sharded HNSW index: Faiss ``IndexHNSWFlat`` graphs over consecutive id ranges.

RAGCache §6 pipelines HNSW search by time slices of one graph traversal, which Faiss does not
expose. Here the graph is split instead: the vectors are cut into ``num_shards`` consecutive
ranges, each with its own HNSW graph (inner product). A plain search searches every shard with the
same ``efSearch`` and merges; a staged search (:meth:`~ragcache_backend.retrieval.docstore.DocumentStore.search_stages`)
searches the shards a group at a time, so its last stage is the plain search and the stages
together cost one plain search. Each shard is searched with its own parameters object, never by
changing a shared index's ``efSearch``.

On disk the shards are Faiss' own serialisations, concatenated in order (sizes in the manifest).
"""

from __future__ import annotations

from collections.abc import Sequence

import faiss
import numpy as np

__all__ = ["ShardedHNSW"]


class ShardedHNSW:
    """HNSW graphs over consecutive id ranges; global id = shard offset + local id.

    Args:
        shards: the graphs, in id order (each an ``IndexHNSWFlat`` with inner product).
        ef_search: candidate list length of every search (Faiss ``efSearch``), >= 1.
    """

    def __init__(self, shards: Sequence[faiss.IndexHNSWFlat], ef_search: int) -> None:
        if not shards:
            raise ValueError("a sharded HNSW index needs at least one shard")
        self.shards = list(shards)
        self.ef_search = int(ef_search)
        self.d = int(self.shards[0].d)

    @classmethod
    def build(cls, vectors: np.ndarray, *, num_shards: int = 8, m: int = 32, ef_construction: int = 80,
              ef_search: int = 64) -> ShardedHNSW:
        """Graphs over float32 ``[n, dim]`` L2-normalised ``vectors`` in ``min(num_shards, n)`` ranges."""
        n, dim = vectors.shape
        shards = []
        for part in np.array_split(np.arange(n), max(1, min(num_shards, n))):
            shard = faiss.IndexHNSWFlat(dim, m, faiss.METRIC_INNER_PRODUCT)
            shard.hnsw.efConstruction = ef_construction
            shard.add(np.ascontiguousarray(vectors[part[0]:part[-1] + 1]))
            shards.append(shard)
        return cls(shards, ef_search)

    @property
    def ntotal(self) -> int:
        return sum(int(s.ntotal) for s in self.shards)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def offsets(self) -> list[int]:
        """The first global id of each shard."""
        out, start = [], 0
        for shard in self.shards:
            out.append(start)
            start += int(shard.ntotal)
        return out

    def search_shards(self, query: np.ndarray, k: int, shard_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` of the given shards for a float32 ``[1, dim]`` query: ``(scores, global ids)``,
        concatenated shard by shard (not merged); ids < 0 mean "no result"."""
        params = faiss.SearchParametersHNSW(efSearch=max(self.ef_search, k))
        offsets = self.offsets()
        scores, ids = [], []
        for i in shard_ids:
            s, local = self.shards[i].search(query, k, params=params)
            scores.append(s[0])
            ids.append(np.where(local[0] >= 0, local[0] + offsets[i], -1))
        return np.concatenate(scores), np.concatenate(ids)

    def add(self, vectors: np.ndarray) -> None:
        """Append vectors to the last shard (their ids follow the current ones)."""
        self.shards[-1].add(np.ascontiguousarray(vectors, dtype=np.float32))

    def to_bytes(self) -> tuple[bytes, list[int]]:
        """The shards' Faiss serialisations concatenated, and each one's size in bytes."""
        blobs = [faiss.serialize_index(s).tobytes() for s in self.shards]
        return b"".join(blobs), [len(b) for b in blobs]

    @classmethod
    def from_bytes(cls, data: bytes, sizes: Sequence[int], ef_search: int) -> ShardedHNSW:
        """Inverse of :meth:`to_bytes`; raises ValueError when ``sizes`` do not add up or a shard
        is not an inner-product ``IndexHNSWFlat`` of one dimension (RuntimeError from Faiss for an
        unreadable blob)."""
        if sum(sizes) != len(data) or not sizes:
            raise ValueError(f"shard sizes add up to {sum(sizes)} bytes, the index has {len(data)}")
        shards, start = [], 0
        for size in sizes:
            shard = faiss.deserialize_index(np.frombuffer(data[start:start + size], dtype=np.uint8))
            if not isinstance(shard, faiss.IndexHNSWFlat) or shard.metric_type != faiss.METRIC_INNER_PRODUCT:
                raise ValueError(f"shard at byte {start} is a {type(shard).__name__}, not an inner-product IndexHNSWFlat")
            shards.append(shard)
            start += size
        if len({s.d for s in shards}) != 1:
            raise ValueError("the shards have different dimensions")
        return cls(shards, ef_search)
