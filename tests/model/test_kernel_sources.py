"""The native kernels' C files travel with the package and their build sees every one of them:
a header missing from the wheel would silently leave a user on the torch path."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from ragcache_backend.model.kernels import native

ROOT = Path(__file__).parents[2]
CSRC = Path(native.__file__).with_name("csrc")


def test_every_kernel_file_is_package_data() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["ragcache_backend.model.kernels"]
    files = sorted(p.name for p in CSRC.iterdir() if p.suffix in (".c", ".h"))
    assert files, "no kernel sources found"
    missing = [f for f in files if not any(fnmatch.fnmatch(f"csrc/{f}", g) for g in globs)]
    assert not missing, f"not in the wheel: {missing}"


def test_every_included_header_exists_and_changes_the_build_hash() -> None:
    hashed = {p.name for p in (*native.SOURCES, *native.HEADERS)}
    assert {p.name for p in CSRC.glob("*.c")} == {p.name for p in native.SOURCES}, "a C file the build leaves out"
    for source in (*native.SOURCES, *native.HEADERS):
        for header in re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.M):
            assert (CSRC / header).is_file(), f"{source.name} includes {header}, which is missing"
            assert header in hashed, f"{header} is not part of the kernels' build hash"
