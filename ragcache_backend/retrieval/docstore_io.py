"""On-disk format of a document store: checksummed files, written atomically, verified on read.

A store folder holds ``documents.jsonl`` (one JSON object per document: ``doc_id``, ``text``,
``source``, ``title``), ``index.faiss`` (Faiss' own serialisation, never pickle; for a sharded
HNSW index the shards' serialisations concatenated, sizes in the manifest) and
``manifest.json`` (format, embedder, dimensions, index kind, corpus fingerprint, and the sha256 and
size of both files). Every file is written to a temporary name, fsynced and renamed, so a crash
never leaves a half-written file under the real name. Reading checks the schema, sizes, checksums,
content-hash document ids and the index's type and shape, and raises
:class:`~ragcache_backend.errors.CorruptFileError` on any mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import faiss
import numpy as np

from ragcache_backend.retrieval.documents import Document, content_id
from ragcache_backend.retrieval.hnsw import ShardedHNSW
from ragcache_backend.errors import CorruptFileError

__all__ = ["DOCUMENTS", "FORMAT", "FORMAT_VERSION", "INDEX", "MANIFEST", "read_store", "write_store"]

FORMAT = "ragcache-docstore"
FORMAT_VERSION = 1
MANIFEST, DOCUMENTS, INDEX = "manifest.json", "documents.jsonl", "index.faiss"
_FIELDS = ("doc_id", "text", "source", "title")  # one JSON object per line of documents.jsonl


def write_store(directory: Path, documents: list[Document], index_bytes: bytes, fields: dict) -> None:
    """Write ``documents``, the serialised Faiss index and the manifest (``fields`` plus format and
    checksums) under ``directory`` (created if needed), each file atomically, manifest last."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({f: getattr(d, f) for f in _FIELDS}, ensure_ascii=False) + "\n" for d in documents)
    payloads = {DOCUMENTS: "".join(lines).encode("utf-8"), INDEX: index_bytes}
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **fields,
                "files": {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                          for name, data in payloads.items()}}
    for name, data in payloads.items():
        _write_atomic(directory / name, data)
    _write_atomic(directory / MANIFEST, json.dumps(manifest, indent=2).encode("utf-8"))


def read_store(directory: Path) -> tuple[dict, list[Document], faiss.Index]:
    """``(manifest, documents, index)`` of the store in ``directory``, every check passed.

    Raises:
        CorruptFileError: a missing or unreadable file, bad JSON or schema, a size or checksum
            mismatch, a document whose id is not the hash of its text, or an index whose type,
            metric or shape does not match the manifest.
    """
    directory = Path(directory)
    manifest = _read_manifest(directory / MANIFEST)
    return manifest, _parse_documents(directory / DOCUMENTS, manifest), _parse_index(directory / INDEX, manifest)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a unique temporary file beside ``path``, fsync, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # honours the umask, unlike mkstemp
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: missing (document store incomplete)") from None
    except OSError as exc:
        raise CorruptFileError(f"{path}: cannot read: {exc}") from exc


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(_read(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptFileError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptFileError(f"{path}: not a ragcache document store manifest")
    m, files = manifest.get, manifest.get("files")
    valid = {
        "format_version": m("format_version") == FORMAT_VERSION,
        "embedder": isinstance(m("embedder"), str),
        "dim": _is_int(m("dim")) and m("dim") >= 1,
        "count": _is_int(m("count")) and m("count") >= 1,
        "index_kind": m("index_kind") in {"flat", "ivf", "hnsw"},
        "nprobe": _is_int(m("nprobe")) and m("nprobe") >= 1 if m("index_kind") == "ivf" else m("nprobe") is None,
        "hnsw_shards": m("index_kind") != "hnsw" or (
            isinstance(m("hnsw_shards"), list) and bool(m("hnsw_shards"))
            and all(_is_int(x) and x > 0 for x in m("hnsw_shards"))),
        "ef_search": m("index_kind") != "hnsw" or (_is_int(m("ef_search")) and m("ef_search") >= 1),
        "corpus_fingerprint": m("corpus_fingerprint") is None or isinstance(m("corpus_fingerprint"), str),
        "files": isinstance(files, dict) and all(
            isinstance(files.get(name), dict) and isinstance(files[name].get("sha256"), str)
            and _is_int(files[name].get("bytes")) for name in (DOCUMENTS, INDEX)),
    }
    if not all(valid.values()):
        bad = ", ".join(key for key, ok in valid.items() if not ok)
        raise CorruptFileError(f"{path}: missing or invalid field(s): {bad} (format {FORMAT_VERSION})")
    return manifest


def _read_checked(path: Path, manifest: dict) -> bytes:
    """The file's bytes after checking its size and sha256 against the manifest."""
    expected = manifest["files"][path.name]
    data = _read(path)
    if len(data) != expected["bytes"]:
        raise CorruptFileError(f"{path}: {len(data)} bytes, manifest says {expected['bytes']} "
                               "(truncated or modified)")
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CorruptFileError(f"{path}: sha256 does not match the manifest (file modified)")
    return data


def _parse_documents(path: Path, manifest: dict) -> list[Document]:
    try:
        lines = _read_checked(path, manifest).decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise CorruptFileError(f"{path}: not UTF-8: {exc}") from exc
    documents = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorruptFileError(f"{path}:{number}: not valid JSON: {exc}") from exc
        if not isinstance(row, dict) or not all(isinstance(row.get(f), str) for f in _FIELDS):
            raise CorruptFileError(f"{path}:{number}: expected an object with string fields {_FIELDS}")
        if row["doc_id"] != content_id(row["text"]):
            raise CorruptFileError(f"{path}:{number}: doc_id is not the content hash of the text")
        documents.append(Document(*(row[f] for f in _FIELDS)))
    if len({d.doc_id for d in documents}) != manifest["count"] or len(documents) != manifest["count"]:
        raise CorruptFileError(f"{path}: {len(documents)} documents (or repeated ids), "
                               f"manifest says {manifest['count']}")
    return documents


def _parse_index(path: Path, manifest: dict) -> faiss.Index | ShardedHNSW:
    data = _read_checked(path, manifest)
    if manifest["index_kind"] == "hnsw":
        try:
            index = ShardedHNSW.from_bytes(data, manifest["hnsw_shards"], manifest["ef_search"])
        except (RuntimeError, ValueError) as exc:
            raise CorruptFileError(f"{path}: not a readable sharded HNSW index: {str(exc)[:200]}") from exc
        if (index.ntotal, index.d) != (manifest["count"], manifest["dim"]):
            raise CorruptFileError(f"{path}: HNSW of {index.ntotal} x {index.d} does not match the manifest "
                                   f"({manifest['count']} x {manifest['dim']})")
        return index
    try:
        index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except RuntimeError as exc:
        raise CorruptFileError(f"{path}: not a readable Faiss index: {str(exc)[:200]}") from exc
    kind = faiss.IndexIVFFlat if manifest["index_kind"] == "ivf" else faiss.IndexFlatIP
    if (not isinstance(index, kind) or index.metric_type != faiss.METRIC_INNER_PRODUCT
            or (index.ntotal, index.d) != (manifest["count"], manifest["dim"])
            or (kind is faiss.IndexIVFFlat and manifest["nprobe"] > index.nlist)):
        raise CorruptFileError(
            f"{path}: {type(index).__name__} of {index.ntotal} x {index.d} does not match the "
            f"manifest ({manifest['index_kind']}, inner product, {manifest['count']} x "
            f"{manifest['dim']}, nprobe {manifest['nprobe']})")
    return index
