"""The quick-start notebooks in docs/ run top to bottom and their outputs show cache hits.

Each notebook runs in a fresh ``python3`` kernel (jupyter_client starts it with this test's own
interpreter), loads the default engine and the FAQ index, asks 4 real questions twice and plots
TTFT, then makes a tool call and gets a structured answer. Set ``RAGCACHE_WRITE_NOTEBOOKS=1`` to save the executed notebooks back into docs/ (that is
how the committed outputs were made).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

DOCS = Path(__file__).resolve().parents[2] / "docs"
NOTEBOOKS = ["quickstart_langchain.ipynb", "quickstart_llamaindex.ipynb"]


def outputs(notebook) -> tuple[str, list[str]]:
    """All text printed by the notebook, and the MIME types of its rich outputs."""
    text, kinds = [], []
    for cell in notebook.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text.append(out.text)
            elif out.output_type in ("display_data", "execute_result"):
                kinds.extend(out.data)
                text.append(out.data.get("text/plain", ""))
    return "".join(text), kinds


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_shows_cache_hits(name: str) -> None:
    path = DOCS / name
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(DOCS)}}).execute()
    text, kinds = outputs(notebook)
    assert "cache hits on the second pass: 4/4" in text, text
    if name == "quickstart_langchain.ipynb":  # chunk caches on new questions, any retriever
        found = re.search(r"new questions reading documents from chunk caches: (\d+)/2", text)
        assert found and int(found.group(1)) >= 1, text  # a document whose context changed too much is recomputed
    assert "same answer: False" not in text
    assert re.search(r"tool call: \w+ \{", text), text  # a forced tool call, parsed into its arguments
    assert "structured answer: Answer(" in text, text
    assert "image/png" in kinds  # the TTFT plot
    if os.environ.get("RAGCACHE_WRITE_NOTEBOOKS") == "1":
        nbformat.write(notebook, path)
