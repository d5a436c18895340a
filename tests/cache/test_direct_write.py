"""The disk tier's file writer: exact bytes whatever the length, around the page cache where it can,
an ordinary write where the file system refuses direct I/O."""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import torch
from safetensors.torch import load as st_load

from ragcache_backend.cache.direct_write import ALIGN, FileWriter
from ragcache_backend.cache.kv_file import FileHeader, KVFileFormat, header_metadata


def _opens_direct(folder) -> bool:
    """Whether ``folder``'s file system opens files with O_DIRECT (tmpfs before Linux 6.6 does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(folder / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    (folder / ".probe").unlink()
    return True


@pytest.mark.parametrize("length", [1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * (1 << 20) + 7])
def test_a_file_holds_exactly_the_bytes_written(tmp_path, length):
    data = os.urandom(length)
    writer = FileWriter()
    writer.write(tmp_path / "f.bin", data)
    assert (tmp_path / "f.bin").read_bytes() == data
    # where the file system takes O_DIRECT the writer keeps using it (it fell back only on a refusal)
    assert writer.direct == _opens_direct(tmp_path)
    writer.close()


def test_the_buffer_is_reused_and_a_shorter_file_after_a_longer_one_is_exact(tmp_path):
    writer = FileWriter()
    long, short = os.urandom(5 * ALIGN + 11), os.urandom(ALIGN // 2)
    writer.write(tmp_path / "a", long)
    writer.write(tmp_path / "b", short)
    writer.write(tmp_path / "a", short)  # replaces: no tail of the longer content survives
    assert (tmp_path / "b").read_bytes() == short
    assert (tmp_path / "a").read_bytes() == short
    writer.close()
    writer.write(tmp_path / "c", long)  # works again after close
    assert (tmp_path / "c").read_bytes() == long


def test_a_file_system_refusing_direct_io_gets_ordinary_writes(tmp_path, monkeypatch, caplog):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this OS: the writer never tries it")
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    writer = FileWriter()
    with caplog.at_level("INFO", logger="ragcache_backend.cache.direct_write"):
        writer.write(tmp_path / "f", b"abc")
        writer.write(tmp_path / "g", b"defg")
    assert (tmp_path / "f").read_bytes() == b"abc" and (tmp_path / "g").read_bytes() == b"defg"
    assert not writer.direct
    assert sum("refuses direct I/O" in r.getMessage() for r in caplog.records) == 1


def test_other_errors_propagate(tmp_path):
    with pytest.raises(OSError):
        FileWriter().write(tmp_path / "missing-folder" / "f", b"abc")
    with pytest.raises(OSError):
        FileWriter(direct=False).write(tmp_path / "missing-folder" / "f", b"abc")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_kv_file_written_in_pieces_is_the_file_safetensors_writes(tmp_path, dtype):
    """encode_parts + FileWriter give a file safetensors and the format read back as encode's: the
    same tensors bit for bit, the same metadata, the same table of tensors."""
    fmt = KVFileFormat("model-fp", (3, 2, 16), dtype)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 5, 2, 16, generator=g).to(dtype)
    v = torch.randn(3, 5, 2, 16, generator=g).to(dtype)
    header = FileHeader("a" * 32, "b" * 32, "c" * 32, 5, 3, 0.25, '{"chunk": "x"}', (7, 8, 9, 10, 11))
    whole = fmt.encode(header, k, v)
    FileWriter().write(tmp_path / "f", fmt.encode_parts(header, k, v))
    pieces = (tmp_path / "f").read_bytes()
    assert len(pieces) == len(whole) and struct.unpack("<Q", pieces[:8])[0] % 8 == 0  # tensors 8-byte aligned
    assert header_metadata(pieces) == header_metadata(whole)
    table = lambda b: {n: t for n, t in json.loads(b[8:8 + struct.unpack("<Q", b[:8])[0]]).items()  # noqa: E731
                       if n != "__metadata__"}
    assert table(pieces) == table(whole)
    for data in (pieces, whole):
        got_k, got_v = fmt.decode(data, "a" * 32)  # checksum, shapes and dtype checked
        assert torch.equal(got_k.view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(got_v.view(torch.uint8), v.view(torch.uint8))
    loaded = st_load(pieces)
    assert set(loaded) == {"k", "v"} and loaded["k"].dtype == dtype


def test_pieces_reading_a_strided_tensor_write_its_dense_bytes(tmp_path):
    fmt = KVFileFormat("model-fp", (2, 2, 8), torch.float32)
    big = torch.arange(2 * 6 * 2 * 8, dtype=torch.float32).reshape(2, 6, 2, 8)
    k, v = big[:, 1:4], big[:, 2:5] + 0.5  # strided views, as a slot range of an arena
    header = FileHeader("d" * 32, "", "e" * 32, 3, 1, 0.0, None, ())
    FileWriter(direct=False).write(tmp_path / "f", fmt.encode_parts(header, k, v))
    got_k, got_v = fmt.decode((tmp_path / "f").read_bytes(), "d" * 32)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
