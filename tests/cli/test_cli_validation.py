"""The CLI checks every option before any work: one line on stderr, exit 2, never a traceback.

No model and no index here: whatever would load them is replaced by a recorder that raises
:class:`Reached`, so a test either stops at the option check (exit 2, nothing loaded) or proves
the options were accepted by reaching the loader.
"""

from __future__ import annotations

from typing import get_args

import pytest

from ragcache_backend import cli


class Reached(Exception):
    """Raised by the stand-in loaders: parsing and checking are over, the real work would start."""


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Replace the index and model loaders of every command; returns the names of those called."""
    called: list[str] = []

    def recorder(name):
        def load(*args, **kwargs):
            called.append(name)
            raise Reached(name)
        return load

    monkeypatch.setattr(cli, "_store", recorder("store"))
    monkeypatch.setattr(cli, "_engine", recorder("engine"))
    # bench imports these inside its body
    import ragcache_backend.demo.datasets as datasets
    import ragcache_backend.model.loader as loader
    import ragcache_backend.retrieval.docstore as docstore

    monkeypatch.setattr(docstore, "build_index", recorder("build_index"))
    monkeypatch.setattr(loader, "load_model", recorder("load_model"))
    monkeypatch.setattr(datasets, "python_docs_dir", recorder("python_docs_dir"))
    return called


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


def assert_one_line_error(code: int, stderr: str, *needles: str) -> None:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], (needle, stderr)


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["ask", "q", "--threads", "0"], ["--threads"]),
        (["ask", "q", "--threads", "-2"], ["--threads"]),
        (["ask", "q", "--threads", "two"], ["--threads"]),
        (["ask", "q", "--dtype", "bogus"], ["--dtype", "unknown dtype 'bogus'", "bfloat16", "bf16"]),
        (["ask", "q", "--policy", "nope"], ["--policy", "unknown policy 'nope'", "pgdsf"]),
        (["ask", "q", "--reuse", "fuzzy"], ["--reuse", "unknown reuse mode 'fuzzy'", "auto"]),
        (["ask", "q", "--k", "0"], ["--k"]),
        (["ask", "q", "--max-tokens", "0"], ["--max-tokens"]),
        (["ask", "q", "--no-such-option"], ["--no-such-option"]),
        (["ask"], ["question"]),
        (["demo", "--questions", "0"], ["--questions"]),
        (["demo", "--k", "0"], ["--k"]),
        (["demo", "--max-tokens", "0"], ["--max-tokens"]),
        (["demo", "--threads", "0"], ["--threads"]),
        (["demo", "--dtype", "int8"], ["--dtype", "unknown dtype"]),
        (["demo", "--json", "/no/such/folder/out.json"], ["--json", "does not exist"]),
        (["bench", "--threads", "0"], ["--threads"]),
        (["bench", "--k", "0"], ["--k"]),
        (["bench", "--warmup", "-1"], ["--warmup"]),
        (["bench", "--zipf", "-0.5"], ["--zipf"]),
        (["bench", "--max-batch-size", "0"], ["--max-batch-size"]),
        (["bench", "--rates", "1,0"], ["--rates", "> 0"]),
        (["bench", "--rates", "1,fast"], ["--rates", "not a number"]),
        (["bench", "--rates", "1,,2"], ["--rates", "not a number"]),
        (["bench", "--ablation-host-mib", "0,-1"], ["--ablation-host-mib", ">= 0"]),
        (["bench", "--sim-host-mib", "0,64.5"], ["--sim-host-mib", "whole number"]),
        (["bench", "--peers", "vllm, llamacpp"], ["--peers", "' llamacpp'"]),
        (["bench", "--corpus", "wiki"], ["--corpus", "unknown corpus 'wiki'"]),
        (["bench", "--peers", "vllm,sglang"], ["--peers", "sglang"]),
        (["bench", "--ours", "ragcache,bogus"], ["--ours", "bogus"]),
        (["bench", "--model", "/no/such/model"], ["--model", "does not exist"]),
        (["nosuchcommand"], ["nosuchcommand"]),
    ],
)
def test_bad_option_is_one_line_exit_2_before_any_loading(capsys, loads, argv, needles):
    code, _, stderr = run(capsys, *argv)
    assert_one_line_error(code, stderr, *needles)
    assert loads == []


def test_threads_zero_message(capsys, loads):
    code, stdout, stderr = run(capsys, "ask", "q", "--threads", "0")
    assert_one_line_error(code, stderr, "threads")
    assert stdout == "" and loads == []


def test_user_errors_before_loading_are_one_line(capsys, loads, tmp_path):
    code, _, stderr = run(capsys, "ask", "   ")
    assert_one_line_error(code, stderr, "question is empty")
    code, _, stderr = run(capsys, "ask", "q", "--corpus", str(tmp_path / "missing"))
    assert_one_line_error(code, stderr, "does not exist")
    code, _, stderr = run(capsys, "index", str(tmp_path / "missing"))
    assert_one_line_error(code, stderr, "does not exist")
    assert loads == []


def test_long_error_is_not_wrapped(capsys, loads):
    code, _, stderr = run(capsys, "ask", "q", "--policy", "x" * 300)
    assert_one_line_error(code, stderr, "x" * 300)


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("bf16", "bfloat16"), ("BF16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16"),
     ("float16", "float16"), ("fp32", "float32"), ("float32", "float32")],
)
def test_dtype_aliases_are_accepted_and_normalized(monkeypatch, capsys, loads, given, canonical):
    configs = []
    real_config = cli.engine_config

    def record(*args, **kwargs):
        configs.append(real_config(*args, **kwargs))
        return configs[-1]

    monkeypatch.setattr(cli, "engine_config", record)
    with pytest.raises(Reached):
        cli.main(["ask", "q", "--dtype", given, "--policy", "LRU", "--threads", "1", "--k", "2", "--reuse", "Auto"])
    assert loads == ["store"]
    assert configs[0].dtype == canonical and configs[0].policy == "lru" and configs[0].threads == 1
    assert configs[0].reuse == "auto"


def test_demo_options_accepted(capsys, loads, tmp_path):
    with pytest.raises(Reached):
        cli.main(["demo", "--questions", "1", "--k", "1", "--max-tokens", "1", "--dtype", "fp32",
                  "--threads", "1", "--json", str(tmp_path / "out.json")])
    assert loads == ["python_docs_dir"]


def test_bench_options_accepted(capsys, loads, tmp_path):
    import torch

    threads = torch.get_num_threads()  # bench sets them before it reaches the (stand-in) loaders
    try:
        with pytest.raises(Reached):
            cli.main(["bench", "--quick", "--out", str(tmp_path / "out"), "--rates", "0.5,2", "--threads", "1",
                      "--k", "2", "--corpus", "FAQ", "--peers", "", "--ours", "ragcache", "--warmup", "0",
                      "--ablation-host-mib", "0,256", "--sim-host-mib", "", "--zipf", "0"])
    finally:
        torch.set_num_threads(threads)
    assert loads == ["python_docs_dir"]


def test_help_lists_choices(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    code, stdout, _ = run(capsys, "ask", "--help")
    assert code == 0
    assert "[pgdsf|gdsf|lru|lfu]" in stdout
    assert "[auto|float32|bfloat16|float16]" in stdout
    assert "bf16" in stdout
    assert "x>=1" in stdout  # --k, --max-tokens, --threads
    code, stdout, _ = run(capsys, "demo", "--help")
    assert code == 0 and "[auto|float32|bfloat16|float16]" in stdout
    code, stdout, _ = run(capsys, "bench", "--help")
    assert code == 0 and "[docs|faq]" in stdout


def test_bare_command_prints_help(capsys):
    code, stdout, stderr = run(capsys)
    assert code == 2
    assert "ask" in stdout + stderr and "Traceback" not in stdout + stderr


def test_choices_match_the_engine_and_the_loader():
    from ragcache_backend.config import EngineConfig
    from ragcache_backend.model.loader import DTYPES, parse_dtype

    # the loader's dtypes, and "auto" (model.loader.choose_dtype), which load_model takes too
    assert set(get_args(EngineConfig.model_fields["dtype"].annotation)) == set(cli.DTYPES) == {*DTYPES, "auto"}
    assert set(get_args(EngineConfig.model_fields["policy"].annotation)) == set(cli.POLICIES)
    assert set(get_args(EngineConfig.model_fields["reuse"].annotation)) == set(cli.REUSE_MODES)
    for alias, canonical in cli.DTYPE_ALIASES.items():
        assert parse_dtype(alias) == DTYPES[canonical]


def test_config_validation_error_is_a_user_error():
    from ragcache_backend.errors import RAGCacheError

    with pytest.raises(RAGCacheError) as info:
        cli.engine_config(None, "float32", 0)
    message = str(info.value)
    assert "threads" in message and "\n" not in message
