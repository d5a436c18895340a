"""The disk tier's file format: one node's KV as a safetensors file with checksummed metadata.

A file holds tensors ``k`` and ``v``, ``[layers, tokens, kv_heads, head_dim]`` in the model's dtype,
and string metadata: format version, model fingerprint, path key, parent path key, segment key,
token count, the segment's token ids (since format 2: a key is a hash; a reader compares the tokens
before the KV serves a request), the node's statistics (frequency, mean cost per token) and a CRC-32
of the tensors' bytes, then of the token ids and of the chunk-variant record when there is one
(format 3; format 2 had a SHA-256, 3-4x the CPU time: the checksum guards against damaged or
truncated files, not against an adversary, and writers share a few cores with the forward pass). Files are never unpickled (safetensors only); a
file whose header is truncated, whose metadata is foreign (another format, model, dtype, name) or
whose tensors fail the shape, dtype or checksum test is refused with the reason.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ragcache_backend.errors import CorruptFileError

__all__ = ["FORMAT", "SUFFIX", "FileHeader", "KVFileFormat", "kv_digest", "parse_tokens", "read_metadata", "tokens_text"]

FORMAT = 3
"""File format version: part of the folder name and of each file's metadata."""
SUFFIX = ".kv.safetensors"
_HEADER_CAP = 1 << 20  # a safetensors header of two tensors is < 1 KiB; more is a foreign file


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor) made contiguous, by numpy when it is strided: torch's copy would open an
    OpenMP parallel region from the calling thread. Writers call this from their own threads, and
    there such a region's team contends with the forward pass's threads for the same cores
    (measured on 2 busy cores: 16 ms for a 737 KB block's two halves, against 0.05 ms by numpy)."""
    if t.is_contiguous():
        return t
    if t.dim() == 0 or t.stride(-1) != 1:
        return t.contiguous()
    raw = t.view(torch.uint8).numpy()  # strided bytes: the last dimension is contiguous
    return torch.from_numpy(np.ascontiguousarray(raw)).view(t.dtype)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU tensors share any byte (safetensors refuses to write such a pair)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def kv_digest(k: torch.Tensor, v: torch.Tensor, variant: str = "", tokens: str = "") -> str:
    """CRC-32 (8 hex digits) of the tensors' bytes, then of the token ids' text (if any), then of
    the variant record (if any)."""
    crc = 0
    for t in (k, v):
        crc = zlib.crc32(memoryview(dense(t).view(torch.uint8).numpy()), crc)
    if tokens:
        crc = zlib.crc32(b"\x00tokens\x00" + tokens.encode(), crc)
    if variant:
        crc = zlib.crc32(b"\x00variant\x00" + variant.encode(), crc)
    return f"{crc:08x}"


@dataclass(slots=True, frozen=True)
class FileHeader:
    """What a file says about its node besides the KV (all written as metadata strings).

    Attributes:
        path_key, parent, key: the node's path key, its parent's, its segment key.
        num_tokens: tokens of KV (>= 1).
        frequency, avg_cost: the node's statistics (requests; seconds per token).
        variant: the chunk-variant record as JSON, or None.
        tokens: the segment's token ids (empty: not recorded; such a file serves no request that
            gives its tokens).
    """

    path_key: str
    parent: str
    key: str
    num_tokens: int
    frequency: int
    avg_cost: float
    variant: str | None = None
    tokens: tuple[int, ...] = ()


def tokens_text(tokens: tuple[int, ...]) -> str:
    """Token ids as the metadata string (comma-separated decimals)."""
    return ",".join(map(str, tokens))


def parse_tokens(text: str, num_tokens: int) -> tuple[int, ...]:
    """Token ids from a file's metadata string ("" = none recorded).

    Raises:
        CorruptFileError: not comma-separated non-negative integers, or not ``num_tokens`` of them.
    """
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) != num_tokens or not all(p.isdigit() for p in parts):
        raise CorruptFileError("bad token ids")
    return tuple(int(p) for p in parts)


@dataclass(slots=True, frozen=True)
class KVFileFormat:
    """Encodes and checks the files of one model.

    Attributes:
        fingerprint: the model's identity; a file of another is foreign.
        layout: ``(layers, kv_heads, head_dim)``.
        dtype: the KV dtype.
    """

    fingerprint: str
    layout: tuple[int, int, int]
    dtype: torch.dtype

    def encode(self, header: FileHeader, k: torch.Tensor, v: torch.Tensor) -> bytes:
        """The file's bytes for ``k``, ``v`` (``[layers, tokens, kv_heads, head_dim]``) and ``header``."""
        k, v = dense(k), dense(v)  # once, for the checksum and the file
        if _overlap(k, v):  # e.g. the same tensor twice: safetensors would refuse to write the pair
            v = torch.from_numpy(v.view(torch.uint8).numpy().copy()).view(v.dtype)
        meta = {"format": str(FORMAT), "fingerprint": self.fingerprint, "path_key": header.path_key,
                "parent": header.parent, "key": header.key, "num_tokens": str(header.num_tokens),
                "crc32": kv_digest(k, v, header.variant or "", tokens_text(header.tokens)),
                "frequency": str(header.frequency), "avg_cost": repr(float(header.avg_cost))}
        if header.tokens:
            if len(header.tokens) != header.num_tokens:
                raise CorruptFileError(f"{len(header.tokens)} token ids for {header.num_tokens} tokens of KV")
            meta["tokens"] = tokens_text(header.tokens)
        if header.variant is not None:
            meta["variant"] = header.variant
        return st_save({"k": k, "v": v}, metadata=meta)

    def decode(self, data: bytes, pkey: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of a good file named ``pkey``.

        Raises:
            CorruptFileError: the file is truncated, foreign (see :meth:`foreign`), or its tensors
                have another shape or dtype or fail the checksum; the message says which.
        """
        meta = header_metadata(data)
        if meta is None:
            raise CorruptFileError("not a safetensors file (truncated header)")
        why = self.foreign(meta, pkey)
        if why is not None:
            raise CorruptFileError(why)
        try:
            tensors = st_load(data)
        except Exception as exc:  # safetensors raises its own error type for a truncated body
            raise CorruptFileError(f"unreadable tensors ({type(exc).__name__})") from None
        k, v = tensors.get("k"), tensors.get("v")
        n = int(meta["num_tokens"])
        shape = (self.layout[0], n, self.layout[1], self.layout[2])
        if k is None or v is None or tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise CorruptFileError("tensors of the wrong shape")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise CorruptFileError(f"tensors of dtype {k.dtype}, expected {self.dtype}")
        if kv_digest(k, v, meta.get("variant", ""), meta.get("tokens", "")) != meta["crc32"]:
            raise CorruptFileError("checksum mismatch")
        return k, v

    def foreign(self, meta: dict[str, str], pkey: str | None) -> str | None:
        """Why a file's metadata does not belong to this model's files (None if it does)."""
        if meta.get("format") != str(FORMAT):
            return f"format {meta.get('format')!r}, expected {FORMAT}"
        if meta.get("fingerprint") != self.fingerprint:
            return "written for another model or dtype"
        if pkey is not None and meta.get("path_key") != pkey:
            return "its path key does not match its name"
        for field in ("parent", "key", "num_tokens", "crc32"):
            if field not in meta:
                return f"metadata lacks {field!r}"
        if not meta["num_tokens"].isdigit() or int(meta["num_tokens"]) < 1:
            return "bad token count"
        try:
            parse_tokens(meta.get("tokens", ""), int(meta["num_tokens"]))
        except CorruptFileError as exc:
            return str(exc)
        return None


def read_metadata(path: Path) -> dict[str, str] | None:
    """The metadata of the file at ``path`` from its header alone (the body is not read), or None.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fh:
        head = fh.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        body = fh.read(size) if 0 < size <= _HEADER_CAP else b""
    return header_metadata(head + body)


def header_metadata(data: bytes) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file's bytes (its first 8 + header bytes), or None."""
    if len(data) < 8:
        return None
    size = struct.unpack("<Q", data[:8])[0]
    if size < 2 or size > _HEADER_CAP or len(data) < 8 + size:
        return None
    try:
        header = json.loads(data[8: 8 + size])
    except ValueError:
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return None
    return meta
