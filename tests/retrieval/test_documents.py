from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ragcache_backend.retrieval.documents import (
    Document,
    content_id,
    corpus_files,
    load_corpus,
    parse_html_sections,
    parse_markdown_sections,
    parse_rst_sections,
)
from ragcache_backend.errors import CorpusError, InvalidRequestError


def _para(word: str, n: int = 30) -> str:
    return " ".join(f"{word}{i}" for i in range(n)) + "."


RST = f"""\
=========
Big Title
=========

Intro paragraph. {_para("intro")}

First Section
=============

{_para("alpha")}

Sub section
-----------

{_para("beta")}

    indented code line
    ----------------

Second Section
==============

{_para("gamma")}
"""


def test_rst_headings_split_with_levels() -> None:
    sections = parse_rst_sections(RST)
    assert [(s.title, s.level) for s in sections] == [
        ("Big Title", 1), ("First Section", 2), ("Sub section", 3), ("Second Section", 2)]
    assert sections[1].text.startswith("First Section\n\nalpha0")
    assert "====" not in sections[1].text
    assert "indented code line" in sections[2].text  # an indented underline is not a heading


def test_rst_transition_and_preamble_are_not_headings() -> None:
    sections = parse_rst_sections("Some preamble text.\n\n----------\n\nMore text.\n")
    assert len(sections) == 1
    assert sections[0].title is None and sections[0].level is None


def test_markdown_headings_ignore_code_fences_and_front_matter() -> None:
    text = ("---\ntitle: x\n---\n# Top\n\nbody\n\n```python\n# not a heading\n```\n\n"
            "## Second ##\n\ntext\n\nSetext\n======\n\nmore\n")
    sections = parse_markdown_sections(text)
    assert [(s.title, s.level) for s in sections] == [("Top", 1), ("Second", 2), ("Setext", 1)]
    assert "# not a heading" in sections[0].text
    assert "title: x" not in "".join(s.text for s in sections)


def test_html_strips_tags_and_splits_at_headings() -> None:
    html = ("<html><head><title>T</title><style>p {color: red}</style></head><body>"
            "<p>before</p><h1>One &amp; only</h1><p>first <b>bold</b>\n  para</p><p>second</p>"
            "<script>var x = 1;</script><h2>Two</h2><pre>  keep\n    spacing</pre></body></html>")
    sections = parse_html_sections(html)
    assert [s.title for s in sections] == [None, "One & only", "Two"]
    assert sections[0].text == "before"
    assert sections[1].text == "One & only\n\nfirst bold para\n\nsecond"
    assert "keep\n    spacing" in sections[2].text
    assert all("color" not in s.text and "var x" not in s.text for s in sections)


def test_load_corpus_titles_sources_and_ids(tmp_path: Path) -> None:
    (tmp_path / "guide.rst").write_text(RST)
    docs = load_corpus(tmp_path, max_chars=400, min_chars=10)
    assert [d.title for d in docs] == ["Big Title", "First Section", "Sub section", "Second Section"]
    assert {d.source for d in docs} == {"guide.rst"}
    for doc in docs:
        assert doc.doc_id == hashlib.sha256(doc.text.encode()).hexdigest()[:16]
        assert doc.doc_id == content_id(doc.text)
    assert load_corpus(tmp_path, max_chars=400, min_chars=10) == docs  # deterministic


def test_short_sections_merge_into_the_following_one(tmp_path: Path) -> None:
    text = "A\n=\n\nshort.\n\nB\n=\n\ntiny.\n\nC\n=\n\n" + _para("long", 40) + "\n"
    (tmp_path / "m.rst").write_text(text)
    docs = load_corpus(tmp_path, max_chars=2000, min_chars=100)
    assert len(docs) == 1
    assert docs[0].text.startswith("A\n\nshort.\n\nB\n\ntiny.\n\nC\n\nlong0")
    assert docs[0].title == "C"  # the longest merged section names the chunk


def test_short_tail_joins_the_previous_chunk(tmp_path: Path) -> None:
    (tmp_path / "t.md").write_text(f"# A\n\n{_para('a', 40)}\n\n# B\n\nend.\n")
    docs = load_corpus(tmp_path, max_chars=2000, min_chars=50)
    assert len(docs) == 1 and docs[0].text.endswith("B\n\nend.")


def test_long_sections_split_at_paragraphs_then_lines_then_sentences(tmp_path: Path) -> None:
    paragraphs = [_para(f"p{i}w", 20) for i in range(6)]  # ~150-170 chars each
    lines = "\n".join(_para(f"l{i}w", 12) for i in range(8))  # one paragraph of 8 lines
    sentences = " ".join(f"Sentence {i} " + "word " * 12 + "ends." for i in range(12))
    body = "\n\n".join(paragraphs + [lines, sentences])
    (tmp_path / "long.txt").write_text(f"Heading\n=======\n\n{body}\n")
    docs = load_corpus(tmp_path, max_chars=400, min_chars=100)
    assert len(docs) > 5
    assert all(len(d.text) <= 400 for d in docs)
    assert all(d.title == "Heading" for d in docs)
    for paragraph in paragraphs:  # paragraphs that fit are never cut
        assert any(paragraph in d.text for d in docs)
    assert any(d.text.startswith("Sentence ") for d in docs)  # a too-long paragraph cut at sentences
    words = " ".join(d.text for d in docs).split()
    assert words == f"Heading {body}".split()  # nothing lost, nothing duplicated


def test_unbreakable_text_is_cut_hard(tmp_path: Path) -> None:
    blob = "".join(chr(ord("a") + i % 26) for i in range(1000))  # no space, no newline
    (tmp_path / "blob.txt").write_text(blob)
    docs = load_corpus(tmp_path, max_chars=300, min_chars=0)
    assert [len(d.text) for d in docs] == [300, 300, 300, 100]
    assert "".join(d.text for d in docs) == blob


def test_duplicates_and_blank_files_are_dropped(tmp_path: Path) -> None:
    text = f"Same\n====\n\n{_para('dup')}\n"
    (tmp_path / "a.rst").write_text(text)
    (tmp_path / "b.rst").write_text(text)
    (tmp_path / "blank.md").write_text("   \n\n\t\n")
    (tmp_path / "ignored.py").write_text("print('not a document')")
    docs = load_corpus(tmp_path)
    assert len(docs) == 1 and docs[0].source == "a.rst"


def test_walks_subfolders_sorted_and_skips_hidden(tmp_path: Path) -> None:
    for rel in ["b/z.md", "a/y.html", "c.rst.txt", ".hidden/x.md", "b/.secret.md"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n\n{_para(rel.replace('/', '_'))}\n")
    assert [p.relative_to(tmp_path).as_posix() for p in corpus_files(tmp_path)] == [
        "a/y.html", "b/z.md", "c.rst.txt"]
    assert [d.source for d in load_corpus(tmp_path)] == ["a/y.html", "b/z.md", "c.rst.txt"]


def test_undecodable_bytes_are_replaced(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"Title\n=====\n\nvalid text \xff\xfe\x80 more text\n")
    (docs,) = load_corpus(tmp_path)
    assert "\ufffd" in docs.text and docs.text.startswith("Title")


def test_same_text_same_id_across_folders(tmp_path: Path) -> None:
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.md").write_text(f"# H\n\n{_para('same')}\n")
    one, two = load_corpus(tmp_path / "one"), load_corpus(tmp_path / "two")
    assert one[0].doc_id == two[0].doc_id and one[0].source != two[0].source
    assert Document.from_text("abc", source="s", title="t").doc_id == content_id("abc")


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "missing")
    (tmp_path / "file.md").write_text("# x\n")
    with pytest.raises(CorpusError, match="is a file"):
        load_corpus(tmp_path / "file.md")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no readable documents"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("\n \n")
    with pytest.raises(CorpusError, match="no readable documents"):
        load_corpus(tmp_path / "blank")
    with pytest.raises(InvalidRequestError):
        load_corpus(tmp_path, max_chars=100, min_chars=200)
