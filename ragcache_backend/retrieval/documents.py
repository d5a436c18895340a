"""Corpus loading: a folder of text files becomes a list of section-sized :class:`Document` s.

RAGCache (Jin et al., §4 and §5.1) caches the KV tensors of each *retrieved document*; here a
document is one section of a source file, so that a few of them fit a prompt. Files are split at
their headings (reST, Markdown, HTML h1-h6), short sections are merged into the following one and
long ones are split at paragraph, then line, sentence and word boundaries. A document's id is a
hash of its text (SPEC §2 "Retrieval": ids are content hashes), so the same text always has the
same id, across runs, folders and machines.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from ragcache_backend.errors import CorpusError, InvalidRequestError

__all__ = [
    "CHUNKER_VERSION", "CORPUS_SUFFIXES", "Document", "Section", "chunk_sections", "content_id",
    "corpus_files", "load_corpus", "parse_html_sections", "parse_markdown_sections",
    "parse_rst_sections",
]

log = logging.getLogger(__name__)

#: Bump when chunking changes, so persisted stores built from the old chunks are rebuilt.
CHUNKER_VERSION = 1
#: File name endings read by :func:`load_corpus` (compared case-insensitively).
CORPUS_SUFFIXES = (".rst", ".rst.txt", ".txt", ".md", ".markdown", ".html", ".htm")


@dataclass(slots=True, frozen=True)
class Document:
    """One retrievable unit: a section-sized chunk of a source file.

    ``doc_id`` is :func:`content_id` of ``text``; ``source`` is the file's path relative to the
    corpus folder (POSIX separators); ``title`` is the section heading (or the file name).
    """

    doc_id: str
    text: str
    source: str
    title: str

    @classmethod
    def from_text(cls, text: str, *, source: str, title: str) -> Document:
        """Build a document whose id is the content hash of ``text``."""
        return cls(doc_id=content_id(text), text=text, source=source, title=title)


@dataclass(slots=True, frozen=True)
class Section:
    """A heading and the text under it. ``text`` starts with the heading line (when there is one).

    ``title`` and ``level`` (1 = outermost heading style) are None for text before the first
    heading.
    """

    title: str | None
    level: int | None
    text: str


def content_id(text: str) -> str:
    """Content hash of ``text``: the first 16 hex digits of sha256 of its UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def corpus_files(folder: Path) -> list[Path]:
    """All corpus files under ``folder``, sorted by relative path; hidden files/dirs are skipped.

    Raises CorpusError if ``folder`` does not exist or is not a directory.
    """
    folder = Path(folder)
    if not folder.exists():
        raise CorpusError(f"corpus folder {folder} does not exist")
    if not folder.is_dir():
        raise CorpusError(f"corpus path {folder} is a file; pass the folder that holds documents")
    found: list[Path] = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if not name.startswith(".") and name.lower().endswith(CORPUS_SUFFIXES):
                found.append(Path(root) / name)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def load_corpus(folder: Path, *, max_chars: int = 1600, min_chars: int = 200) -> list[Document]:
    """Read every corpus file under ``folder`` and chunk it into documents, in file order.

    Every document's text has at most ``max_chars`` characters; sections shorter than
    ``min_chars`` are merged into the following section of the same file. Identical texts are
    kept once (first occurrence). Undecodable bytes become U+FFFD; unreadable files are skipped.

    Raises CorpusError (missing folder, a file instead of a folder, no readable documents) and
    InvalidRequestError (bad bounds).
    """
    if max_chars < 1 or min_chars < 0 or min_chars > max_chars:
        raise InvalidRequestError(
            f"need 1 <= max_chars and 0 <= min_chars <= max_chars, got {max_chars=}, {min_chars=}")
    folder = Path(folder)
    documents: list[Document] = []
    seen: set[str] = set()
    for path in corpus_files(folder):
        try:
            raw = path.read_bytes()
        except OSError as exc:
            log.warning("skipping unreadable corpus file %s: %s", path, exc)
            continue
        text = raw.decode("utf-8", errors="replace").lstrip("\ufeff").replace("\r\n", "\n")
        rel = path.relative_to(folder).as_posix()
        default_title = _strip_suffix(path.name)
        for title, piece in chunk_sections(_parse(path.name, text), max_chars=max_chars,
                                           min_chars=min_chars, default_title=default_title):
            doc = Document.from_text(piece, source=rel, title=title)
            if doc.doc_id not in seen:
                seen.add(doc.doc_id)
                documents.append(doc)
    if not documents:
        raise CorpusError(f"no readable documents in {folder}: expected non-empty files ending in "
                          + ", ".join(CORPUS_SUFFIXES))
    return documents


def chunk_sections(sections: list[Section], *, max_chars: int, min_chars: int,
                   default_title: str) -> list[tuple[str, str]]:
    """Merge short sections forward and split long ones; returns ``(title, text)`` pairs.

    A merged group takes the title of its longest section (``default_title`` if it has none).
    """
    groups: list[list[Section]] = []
    pending: list[Section] = []
    for section in sections:
        if not section.text.strip():
            continue
        pending.append(section)
        if len(_join(pending)) >= min_chars:
            groups.append(pending)
            pending = []
    if pending:  # a short tail joins the previous group rather than standing alone
        if groups:
            groups[-1].extend(pending)
        else:
            groups.append(pending)
    chunks: list[tuple[str, str]] = []
    for group in groups:
        title = max(group, key=lambda s: len(s.text)).title or default_title
        chunks.extend((title, piece) for piece in _split(_join(group), max_chars, min_chars, 0))
    return chunks


def _join(sections: list[Section]) -> str:
    return "\n\n".join(s.text.strip("\n").rstrip() for s in sections)


# Boundaries tried in order when a text is longer than max_chars: (joiner, splitter).
_BOUNDARIES = (
    ("\n\n", re.compile(r"\n[ \t]*\n")),
    ("\n", re.compile(r"\n")),
    (" ", re.compile(r"(?<=[.!?])\s+")),
    (" ", re.compile(r"\s+")),
)


def _split(text: str, max_chars: int, min_chars: int, depth: int) -> list[str]:
    """Split ``text`` into pieces of at most ``max_chars``, packing greedily at each boundary.

    A last piece shorter than ``min_chars`` is balanced against the one before it.
    """
    if len(text) <= max_chars:
        return [text] if text.strip() else []
    if depth == len(_BOUNDARIES):
        return [p for i in range(0, len(text), max_chars) if (p := text[i:i + max_chars]).strip()]
    joiner, splitter = _BOUNDARIES[depth]
    pieces: list[str] = []
    for part in splitter.split(text):
        part = part.strip("\n").rstrip() if depth < 2 else part.strip()
        pieces.extend(_split(part, max_chars, min_chars, depth + 1))
    groups: list[list[str]] = []
    for piece in pieces:
        if groups and len(joiner.join(groups[-1] + [piece])) <= max_chars:
            groups[-1].append(piece)
        else:
            groups.append([piece])
    if len(groups) > 1 and len(joiner.join(groups[-1])) < min_chars:
        groups[-2:] = _rebalance(groups[-2] + groups[-1], joiner, max_chars)
    return [joiner.join(group) for group in groups]


def _rebalance(units: list[str], joiner: str, max_chars: int) -> list[list[str]]:
    """Cut ``units`` in two pieces of at most ``max_chars``, making the shorter one longest."""
    cuts = [j for j in range(1, len(units)) if len(joiner.join(units[:j])) <= max_chars
            and len(joiner.join(units[j:])) <= max_chars]
    best = max(cuts, key=lambda j: min(len(joiner.join(units[:j])), len(joiner.join(units[j:]))))
    return [units[:best], units[best:]]


def _strip_suffix(name: str) -> str:
    lower = name.lower()
    for suffix in sorted(CORPUS_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _parse(name: str, text: str) -> list[Section]:
    lower = name.lower()
    if lower.endswith((".html", ".htm")):
        return parse_html_sections(text)
    if lower.endswith((".md", ".markdown")):
        return parse_markdown_sections(text)
    return parse_rst_sections(text)  # .rst, .rst.txt and plain .txt (underlined headings)


_BLANK_RUN = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)+")


class _SectionBuilder:
    """Collects lines into sections; a heading closes the current section and opens a new one."""

    def __init__(self) -> None:
        self.sections: list[Section] = []
        self.title: str | None = None
        self.level: int | None = None
        self.lines: list[str] = []

    def heading(self, title: str, level: int) -> None:
        self.close()
        self.title, self.level, self.lines = title, level, [title, ""]

    def close(self) -> list[Section]:
        if self.lines:
            text = _BLANK_RUN.sub("\n\n", "\n".join(self.lines)).strip("\n")
            self.sections.append(Section(self.title, self.level, text))
        self.lines = []
        return self.sections


_ADORNMENT = re.compile(r"^([!-/:-@\[-`{-~])\1*[ \t]*$")  # a line of one repeated punctuation


def parse_rst_sections(text: str) -> list[Section]:
    """Split reST (or underlined plain text) at section titles, underlined or over+underlined.

    Levels follow the order in which adornment styles first appear, as in docutils.
    """
    lines = text.splitlines()
    styles: list[tuple[str, bool]] = []
    builder = _SectionBuilder()
    i = 0
    while i < len(lines):
        found = _rst_heading_at(lines, i)
        if found is None:
            builder.lines.append(lines[i])
            i += 1
            continue
        title, style, consumed = found
        if style not in styles:
            styles.append(style)
        builder.heading(title, styles.index(style) + 1)
        i += consumed
    return builder.close()


def _rst_heading_at(lines: list[str], i: int) -> tuple[str, tuple[str, bool], int] | None:
    """``(title, (char, overlined), lines consumed)`` if a section title starts at line ``i``."""
    if i > 0 and lines[i - 1].strip() and not _ADORNMENT.match(lines[i - 1]):
        return None  # a title follows a blank line (or another title)
    line = lines[i]
    over = _ADORNMENT.match(line)
    if over and i + 2 < len(lines) and lines[i + 1].strip():
        under = lines[i + 2].rstrip()
        title = lines[i + 1].strip()
        if under == line.rstrip() and len(under) >= len(title) and not _ADORNMENT.match(title):
            return title, (over.group(1), True), 3
        return None
    if over or not line.strip() or line[0].isspace() or i + 1 >= len(lines):
        return None
    under_match = _ADORNMENT.match(lines[i + 1])
    if under_match and len(lines[i + 1].rstrip()) >= len(line.rstrip()):
        return line.strip(), (under_match.group(1), False), 2
    return None


_ATX = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")


def parse_markdown_sections(text: str) -> list[Section]:
    """Split Markdown at ``#`` (ATX) and underlined (setext) headings, ignoring code fences."""
    lines = text.splitlines()
    if lines and lines[0].strip() == "---" and "---" in (s.strip() for s in lines[1:]):
        lines = lines[[s.strip() for s in lines].index("---", 1) + 1:]  # YAML front matter
    builder = _SectionBuilder()
    fence: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if (m := _FENCE.match(line)) and (fence is None or m.group(1) == fence):
            fence = m.group(1) if fence is None else None
        elif fence is None and (m := _ATX.match(line)):
            builder.heading(m.group(2).strip() or line.strip(), len(m.group(1)))
            i += 1
            continue
        elif (fence is None and line.strip() and i + 1 < len(lines) and (i == 0 or not lines[i - 1].strip())
              and (u := _SETEXT.match(lines[i + 1]))):
            builder.heading(line.strip(), 1 if u.group(1)[0] == "=" else 2)
            i += 2
            continue
        builder.lines.append(line)
        i += 1
    return builder.close()


_HEADINGS = {f"h{n}": n for n in range(1, 7)}
_SKIPPED = {"script", "style", "head", "noscript", "template", "svg"}
_BLOCKS = {"p", "div", "section", "article", "main", "header", "footer", "nav", "aside", "ul",
           "ol", "li", "dl", "dt", "dd", "table", "tr", "blockquote", "pre", "figure", "hr",
           "form", "fieldset", "details", "summary", "body"}


class _HTMLSections(HTMLParser):
    """Strips tags; h1-h6 open sections, block tags separate paragraphs, <pre> keeps spacing."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.builder = _SectionBuilder()
        self.skip = 0
        self.pre = 0
        self.heading_level: int | None = None
        self.heading_text: list[str] = []
        self.body: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIPPED:
            self.skip += 1
        elif tag in _HEADINGS:
            self._flush_body()
            self.heading_level, self.heading_text = _HEADINGS[tag], []
        elif tag == "br":
            self.body.append("\n")
        elif tag in _BLOCKS:
            self.pre += tag == "pre"
            self.body.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED:
            self.skip = max(0, self.skip - 1)
        elif tag in _HEADINGS and self.heading_level is not None:
            title = " ".join("".join(self.heading_text).split())
            if title:
                self.builder.heading(title, self.heading_level)
            self.heading_level = None
        elif tag in _BLOCKS:
            self.pre = max(0, self.pre - (tag == "pre"))
            self.body.append("\n\n")

    def handle_data(self, data: str) -> None:
        if self.skip:
            return
        if self.heading_level is not None:
            self.heading_text.append(data)
        else:
            self.body.append(data if self.pre else re.sub(r"\s+", " ", data))

    def _flush_body(self) -> None:
        text = re.sub(r"[ \t]*\n[ \t]*\n\s*", "\n\n", "".join(self.body))
        self.builder.lines.extend(line.rstrip() for line in text.strip().splitlines())
        self.body = []

    def sections(self) -> list[Section]:
        self.close()
        self._flush_body()
        return self.builder.close()


def parse_html_sections(text: str) -> list[Section]:
    """Strip HTML tags (stdlib ``html.parser``); each h1-h6 heading starts a section."""
    parser = _HTMLSections()
    parser.feed(text)
    return parser.sections()
