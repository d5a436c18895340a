"""The disk tier's file writer: exact bytes whatever the length, around the page cache where it can,
an ordinary write where the file system refuses direct I/O."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys

import pytest

from ragcache_backend.cache.direct_write import ALIGN, FileWriter


def _opens_direct(folder) -> bool:
    """Whether ``folder``'s file system takes an aligned O_DIRECT write (tmpfs before Linux 6.6 does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    block = mmap.mmap(-1, ALIGN)  # page-aligned, as direct writes need
    try:
        fd = os.open(folder / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            os.write(fd, block)
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        (folder / ".probe").unlink(missing_ok=True)
        block.close()
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


def test_a_file_size_limit_gives_its_own_error_and_direct_io_stays_on(tmp_path):
    """EINVAL from a direct write cut short by a limit is not a file system refusing direct I/O:
    the caller gets the real error (EFBIG) and the next file is still written directly."""
    if not _opens_direct(tmp_path):
        pytest.skip("this file system does not open files with O_DIRECT")
    script = f"""
import errno, os, resource, signal
from pathlib import Path
from ragcache_backend.cache.direct_write import FileWriter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (10000, resource.RLIM_INFINITY))
w = FileWriter()
try:
    w.write(Path({str(tmp_path / 'big')!r}), os.urandom(3 * 4096 + 100))
    raise SystemExit("no error")
except OSError as exc:
    assert exc.errno == errno.EFBIG, exc
assert w.direct
w.write(Path({str(tmp_path / 'small')!r}), b"x" * 5000)
assert w.direct and Path({str(tmp_path / 'small')!r}).read_bytes() == b"x" * 5000
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
