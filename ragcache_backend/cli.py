"""The ``ragcache`` command line: ``index``, ``ask``, ``demo``, ``serve`` (and ``bench``); ``--version``.

Every error a user can cause is a :class:`~ragcache_backend.errors.RAGCacheError`; the CLI prints
its message on one line and exits with status 2 (1 for unexpected failures), never a traceback.
Every option is checked before any work (index load, model load): bad values, unknown choices
and missing arguments are one line on stderr (``error: ...``) and exit status 2.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.models import OptionInfo

from ragcache_backend.errors import RAGCacheError

try:  # typer >= 0.2x runs on its own copy of click
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - older typer runs on click itself
    from click import exceptions as _click_errors

app = typer.Typer(
    help="ragcache: document-level KV caching for retrieval-augmented generation (RAGCache).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


#: Canonical dtype and policy names: those :class:`~ragcache_backend.config.EngineConfig` accepts.
DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("pgdsf", "gdsf", "lru", "lfu")
REUSE_MODES = ("exact", "chunk", "auto")
HOST_COMMITS = ("background", "lazy")
#: Short dtype names, as :func:`ragcache_backend.model.loader.parse_dtype` also accepts them.
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _print_error(message: object) -> None:
    """``error: MESSAGE`` on one line of stderr (never wrapped, never rich markup from the message)."""
    err.print(f"[bold red]error:[/] {escape(_one_line(message))}", highlight=False, soft_wrap=True)


class NameChoice:
    """Parser of a case-insensitive choice of names that also takes aliases and returns the canonical
    name (``bf16`` -> ``bfloat16``); a wrong value fails with ``unknown <noun> 'x'; choose one of ...``.
    ``metavar`` (``[float32|bfloat16|float16]``) is what ``--help`` shows.
    """

    def __init__(self, noun: str, choices: Sequence[str], aliases: Mapping[str, str] | None = None) -> None:
        self.noun = noun
        self.choices = tuple(choices)
        self.aliases = dict(aliases or {})
        self.metavar = "[" + "|".join(self.choices) + "]"

    def __call__(self, value: Any) -> str:
        key = str(value).strip().lower()
        key = self.aliases.get(key, key)
        if key in self.choices:
            return key
        also = f" (or {', '.join(self.aliases)})" if self.aliases else ""
        raise typer.BadParameter(f"unknown {self.noun} {str(value)!r}; choose one of {', '.join(self.choices)}{also}")


def _choice_option(default: str, decl: str, choice: NameChoice, help: str) -> Any:
    return typer.Option(default, decl, parser=choice, metavar=choice.metavar, help=help)


# Checks of comma-separated options, read exactly as ``bench`` reads them later; each returns the
# text unchanged (an option callback).
def _rates(text: str) -> str:
    """``--rates``: empty (the mode's default) or numbers > 0, as ``float(x) for x in text.split(",")``."""
    if not text:
        return text
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise typer.BadParameter(f"{item!r} is not a number (comma-separated request rates, req/s)") from None
        if not (math.isfinite(value) and value > 0):
            raise typer.BadParameter(f"request rate {item!r} must be a number > 0")
    return text


def _mib_sizes(text: str) -> str:
    """Host-tier sizes: whole MiB >= 0, as ``int(x) for x in text.split(",") if x``."""
    for item in (x for x in text.split(",") if x):
        try:
            value = int(item)
        except ValueError:
            raise typer.BadParameter(f"{item!r} is not a whole number of MiB") from None
        if value < 0:
            raise typer.BadParameter(f"size {item!r} must be >= 0 MiB")
    return text


def _names_in(what: str, known: Sequence[str]) -> Callable[[str], str]:
    """Comma-separated names, each one of ``known`` (as ``x for x in text.split(",") if x``)."""
    def check(text: str) -> str:
        unknown = [x for x in text.split(",") if x and x not in known]
        if unknown:
            raise typer.BadParameter(f"unknown {what} {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
        return text

    return check


def _new_file(value: Optional[Path]) -> Optional[Path]:
    """An output file: not a folder, and its folder exists (checked now, not after minutes of work)."""
    if value is None:
        return value
    if value.is_dir():
        raise typer.BadParameter(f"{value} is a folder; give a file name")
    parent = value.expanduser().resolve().parent
    if not parent.is_dir():
        raise typer.BadParameter(f"folder {parent} does not exist")
    return value


def _not_a_file(value: Path) -> Path:
    if value.exists() and not value.is_dir():
        raise typer.BadParameter(f"{value} exists and is not a folder")
    return value


def _not_a_folder(value: Path) -> Path:
    if value.is_dir():
        raise typer.BadParameter(f"{value} is a folder; give a file name")
    return value


def _existing_model(value: Optional[str]) -> Optional[str]:
    from ragcache_backend.errors import ModelLoadError
    from ragcache_backend.model.loader import resolve_model

    if value:
        try:
            resolve_model(value)
        except ModelLoadError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def _validation_message(exc: Exception) -> str:
    """A pydantic ``ValidationError`` as one line: ``field: message; field: message``."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            return "; ".join(f"{'.'.join(map(str, e.get('loc', ()))) or 'config'}: {e.get('msg', '')}"
                             for e in errors())
    return _one_line(exc)


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    try:
        yield
    except RAGCacheError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None


def _precheck(corpus: Optional[Path], model: Optional[str]) -> None:
    """Cheap checks before minutes of indexing or seconds of model loading."""
    from ragcache_backend.errors import CorpusError

    if corpus is not None and not corpus.is_dir():
        raise CorpusError(f"corpus folder does not exist: {corpus}")
    if model is not None:
        from ragcache_backend.model.loader import check_architecture, resolve_model

        check_architecture(resolve_model(model))  # ModelLoadError: no such path, or an architecture we cannot run


def _quiet_loaders() -> None:
    """transformers' weight-loading progress bars say nothing useful to a CLI user."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def engine_config(model: Optional[str], dtype: str, threads: int, policy: str = "pgdsf", reuse: str = "exact", *,
                  disk_dir: Optional[Path] = None, disk_budget_mib: int = 4096):
    """The engine configuration, built (and so validated) before the index or the model is loaded.

    ``disk_dir`` None disables the disk tier; ``disk_budget_mib`` is its budget in MiB."""
    from pydantic import ValidationError

    from ragcache_backend.config import MiB, EngineConfig
    from ragcache_backend.errors import InvalidRequestError

    try:
        return EngineConfig(model=model, dtype=dtype, threads=threads, policy=policy, reuse=reuse,
                            disk_dir=disk_dir, disk_budget_bytes=disk_budget_mib * MiB)
    except ValidationError as exc:  # the options are checked above; this is the safety net
        raise InvalidRequestError(f"invalid engine configuration: {_validation_message(exc)}") from None


def _engine(config, store=None, *, profile=None):
    """The engine; ``profile`` None: this machine's prefill profile (the shipped one for the default
    model until one was measured; another model's measured once, ~45 s)."""
    from ragcache_backend.engine.engine import RAGCacheEngine

    with err.status("loading the model..."):
        return RAGCacheEngine(config, store=store, profile=profile)


def _store(corpus: Optional[Path], *, rebuild: bool = False):
    from ragcache_backend.demo.datasets import python_docs_dir
    from ragcache_backend.retrieval.docstore import build_index

    _quiet_loaders()
    corpus = corpus if corpus is not None else python_docs_dir()
    err.print(f"corpus: {corpus}")
    return build_index(corpus, progress=True, rebuild=rebuild)


MODEL = typer.Option(None, "--model", help="GGUF file, HF folder or packaged model name (default: SmolLM2-135M-Instruct)")
DTYPE = _choice_option("auto", "--dtype", NameChoice("dtype", DTYPES, DTYPE_ALIASES),
                       help="weights and KV dtype (also fp32, bf16, fp16); auto: bfloat16 where the native bf16 "
                            "kernels run (AVX512-BF16), else float32")
THREADS = typer.Option(os.cpu_count() or 1, "--threads", min=1, help="torch threads")
POLICY = _choice_option("pgdsf", "--policy", NameChoice("policy", POLICIES), help="cache replacement policy")
REUSE = _choice_option("exact", "--reuse", NameChoice("reuse mode", REUSE_MODES),
                       help="exact: knowledge-tree prefixes only; auto/chunk: documents also from chunk caches at any "
                            "position (approximate, guarded)")
CORPUS = typer.Option(None, "--corpus", help="folder of .rst/.txt/.md/.html (default: the Python 3.11 docs)")
CACHE_DIR = typer.Option(None, "--cache-dir", callback=lambda v: _not_a_file(v) if v is not None else v,
                         help="disk KV tier folder (default: $RAGCACHE_HOME/kv, i.e. ~/.cache/ragcache/kv)")
NO_DISK_CACHE = typer.Option(False, "--no-disk-cache", help="no disk KV tier (nothing survives the process)")
DISK_BUDGET = typer.Option(4096, "--disk-budget-mib", min=0, help="disk KV tier budget, MiB")


def _version(value: bool) -> None:
    if value:
        out.print(f"ragcache {package_version()}", highlight=False)
        raise typer.Exit(0)


def package_version() -> str:
    """The installed distribution's version (``ragcache-kv``), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ragcache-kv")
    except PackageNotFoundError:
        from ragcache_backend import __version__

        return __version__


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="print the version and exit"),
) -> None:
    """ragcache: document-level KV caching for retrieval-augmented generation (RAGCache)."""


def _disk_dir(cache_dir: Optional[Path], no_disk_cache: bool) -> Optional[Path]:
    from ragcache_backend.config import default_disk_dir

    return None if no_disk_cache else (cache_dir or default_disk_dir()).expanduser()


@app.command()
def index(
    corpus: Path = typer.Argument(..., help="folder of .rst/.txt/.md/.html documents"),
    rebuild: bool = typer.Option(False, "--rebuild", help="rebuild even if a matching index exists"),
) -> None:
    """Chunk, embed and index a folder (stored under $RAGCACHE_HOME/indexes)."""
    with _user_errors():
        from ragcache_backend.retrieval.docstore import default_store_dir

        _precheck(corpus, None)
        store = _store(corpus, rebuild=rebuild)
        out.print(f"{len(store)} chunks indexed ({store.index_kind.value}) in {default_store_dir(corpus)}")


@app.command()
def ask(
    question: str = typer.Argument(..., help="the question"),
    corpus: Optional[Path] = CORPUS,
    k: int = typer.Option(3, "--k", min=1, help="documents to retrieve"),
    policy: str = POLICY,
    reuse: str = REUSE,
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
    model: Optional[str] = MODEL,
    dtype: str = DTYPE,
    threads: int = THREADS,
    cache_dir: Optional[Path] = CACHE_DIR,
    no_disk_cache: bool = NO_DISK_CACHE,
    disk_budget_mib: int = DISK_BUDGET,
    cache_salt: Optional[str] = typer.Option(None, "--cache-salt", help="tenant salt: KV cached under another salt is never reused"),
    pipelined: bool = typer.Option(False, "--pipelined", help="overlap the staged vector search with speculative prefill (RAGCache §5.3); same answer"),
) -> None:
    """Answer one question from the top-k retrieved documents."""
    with _user_errors():
        from ragcache_backend.errors import EmptyQueryError, InvalidRequestError
        from ragcache_backend.model.sampling import SamplingParams
        from ragcache_backend.prompts.builder import MAX_SALT_CHARS

        if not question.strip():
            raise EmptyQueryError("the question is empty")
        if cache_salt is not None and len(cache_salt) > MAX_SALT_CHARS:  # before the model loads
            raise InvalidRequestError(f"--cache-salt must be at most {MAX_SALT_CHARS} characters")
        _precheck(corpus, model)
        config = engine_config(model, dtype, threads, policy, reuse, disk_dir=_disk_dir(cache_dir, no_disk_cache),
                               disk_budget_mib=disk_budget_mib)
        store = _store(corpus)
        engine = _engine(config, store)
        sampling = SamplingParams(max_tokens=max_tokens)
        final: list = []

        def candidates():  # the staged search; the last stage is the search's result
            for stage in store.search_stages(question, k, config.search_stages):
                final[:] = stage
                yield [h.document for h in stage]

        if pipelined:
            answer = engine.stream_pipelined(question, candidates(), sampling, cache_salt=cache_salt)
        else:
            final[:] = store.search(question, k)
            answer = engine.stream(question, [h.document for h in final], sampling, cache_salt=cache_salt)
        try:
            if as_json:
                *_, last = answer
                hits, result = final, last.result
                payload = {f: getattr(result, f) for f in result.__slots__}
                payload["sources"] = [{"doc_id": h.document.doc_id, "title": h.document.title,
                                       "source": h.document.source, "score": h.score} for h in hits]
                out.print_json(json.dumps(payload))
                return
            for chunk in answer:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            result = chunk.result
            sys.stdout.write("\n")
            for h in final:
                err.print(f"  [dim]source:[/] {h.document.title} ({h.document.source})", highlight=False)
            err.print(f"  [dim]{cache_summary(result, config.disk_dir is not None)}[/]", highlight=False, soft_wrap=True)
        finally:
            engine.close()  # the disk tier's queued files are written before the process ends


def cache_summary(result, disk_tier: bool) -> str:
    """One line: TTFT, prompt tokens, cached tokens, and the tiers the reused nodes came from."""
    tiers = f"device {result.device_hits}, host {result.host_hits}"
    tiers += f", disk {result.disk_hits}" if disk_tier else " (no disk tier)"
    line = (f"TTFT {result.ttft_s * 1000:.0f} ms; cache: {result.cached_tokens}/{result.prompt_tokens} prompt tokens "
            f"from the cache; hits by tier: {tiers}")
    if result.speculative_requests:
        line += (f"; search {result.search_s * 1000:.0f} ms, {result.unoverlapped_search_s * 1000:.0f} ms of it not "
                 f"overlapped (speculative generations: {result.speculative_requests}, kept: "
                 f"{'yes' if result.speculation_kept else 'no'}, wasted tokens: {result.wasted_tokens})")
    return line


@app.command()
def demo(
    questions: int = typer.Option(6, "--questions", min=1, help="FAQ questions to sample"),
    json_file: Optional[Path] = typer.Option(None, "--json", callback=_new_file, dir_okay=False,
                                             help="write per-question records and the ratio here"),
    corpus: Optional[Path] = typer.Option(None, "--corpus", help="folder to retrieve from (default: the Python FAQ, "
                                                                  "where the questions' answers are; the whole docs: "
                                                                  "/usr/share/doc/python3.11/html/_sources)"),
    k: int = typer.Option(3, "--k", min=1, help="documents per question"),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="new tokens per answer (greedy)"),
    seed: int = typer.Option(0, "--seed"),
    model: Optional[str] = MODEL,
    dtype: str = DTYPE,
    threads: int = THREADS,
) -> None:
    """Real FAQ questions over the Python docs, with and without the cache (mean TTFT and ratio)."""
    with _user_errors():
        import dataclasses
        import time

        from ragcache_backend.config import ragcache_home
        from ragcache_backend.demo.datasets import demo_corpus_dir, faq_questions, python_docs_dir
        from ragcache_backend.demo.demo import reference_profile, run_demo, write_report

        _precheck(corpus, model)
        config = engine_config(model, dtype, threads)
        docs_root = python_docs_dir()
        started = time.perf_counter()
        store = _store(corpus if corpus is not None else demo_corpus_dir(docs_root))
        indexed = time.perf_counter()
        profile = reference_profile(config.model, config.load_dtype(), config.device)
        engine = _engine(config, store=store, profile=profile)
        loaded = time.perf_counter()
        pool = faq_questions(docs_root)
        with err.status("retrieving...") as status:
            report = run_demo(
                engine, store, pool, k=k, num_questions=questions, max_tokens=max_tokens, seed=seed,
                progress=lambda i, n, label: status.update(f"request {i}/{n} ({label})"),
                vector_cache=ragcache_home() / "demo",
            )
        report = dataclasses.replace(
            report, phases_s={"index": indexed - started, "model": loaded - indexed, **report.phases_s},
            config={**report.config, "prefill_profile": f"shipped reference ({report.config['dtype']})"
                    if profile is not None else "measured on this machine"})
        table = Table(title=f"ragcache demo: {engine.model_name}, k={k}, steady state")
        table.add_column("question", ratio=3, overflow="fold")
        for col in ("TTFT cached", "TTFT no cache", "cached tokens"):
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column("answer", ratio=4, overflow="fold")
        for r in report.records:
            table.add_row(r.question, f"{r.ttft_cached_s * 1000:.0f} ms", f"{r.ttft_uncached_s * 1000:.0f} ms",
                          f"{r.cached_tokens}/{r.prompt_tokens}", " ".join(r.answer_cached.split())[:100])
        out.print(table)
        out.print(f"mean TTFT with cache {report.mean_ttft_cached_s * 1000:.0f} ms, caching off "
                  f"{report.mean_ttft_uncached_s * 1000:.0f} ms: [bold]{report.ratio:.1f}x[/] lower; answers identical: "
                  f"{report.answers_identical}; document recurrence {report.document_recurrence:.0%}")
        err.print(f"[dim]{len(store):,} chunks; time: "
                  + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in report.phases_s.items()) + "[/]",
                  highlight=False)
        if json_file is not None:
            write_report(report, json_file)
            out.print(f"wrote {json_file}")


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@app.command()
def serve(
    model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", callback=_existing_model,
                                              help="GGUF file, HF folder or packaged model name "
                                                   "(default: SmolLM2-135M-Instruct); same as --model"),
    config_file: Optional[Path] = typer.Option(None, "--config", exists=True, dir_okay=False,
                                               help="TOML or JSON file of settings (flags > RAGCACHE_* env > file)"),
    host: Optional[str] = typer.Option(None, "--host", help="interface to listen on (default 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, "--port", min=1, max=65535, help="TCP port (default 8000)"),
    model: Optional[str] = typer.Option(None, "--model", callback=_existing_model,
                                        help="GGUF file, HF folder or packaged model name (default: SmolLM2-135M-Instruct)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", parser=NameChoice("dtype", DTYPES, DTYPE_ALIASES),
                                        metavar="[auto|float32|bfloat16|float16]",
                                        help="weights and KV dtype (default auto: bfloat16 where the native bf16 kernels run, else float32)"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads"),
    policy: Optional[str] = typer.Option(None, "--policy", parser=NameChoice("policy", POLICIES),
                                         metavar="[pgdsf|gdsf|lru|lfu]", help="cache replacement policy (default pgdsf)"),
    reuse: Optional[str] = typer.Option(None, "--reuse", parser=NameChoice("reuse mode", REUSE_MODES),
                                        metavar="[exact|chunk|auto]", help="default reuse mode of a request (default exact)"),
    device_mib: Optional[int] = typer.Option(None, "--device-mib", min=1, help="device tier budget, MiB (default 512)"),
    host_mib: Optional[int] = typer.Option(None, "--host-mib", min=0, help="host tier budget, MiB (default 2048; 0: off)"),
    host_commit: Optional[str] = typer.Option(None, "--host-commit", parser=NameChoice("host commit", HOST_COMMITS),
                                              metavar="[background|lazy]",
                                              help="the host tier's memory committed from start by a low-priority thread, "
                                                   "or as it fills (default background)"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", callback=lambda v: _not_a_file(v) if v is not None else v,
                                             help="disk KV tier folder (default: $RAGCACHE_HOME/kv)"),
    disk_cache: Optional[bool] = typer.Option(None, "--disk-cache/--no-disk-cache", help="disk KV tier on or off (default on)"),
    disk_budget_mib: Optional[int] = typer.Option(None, "--disk-budget-mib", min=0, help="disk tier budget, MiB (default 4096)"),
    remote_url: Optional[str] = typer.Option(None, "--remote-url",
                                             help="remote KV tier shared by replicas: redis://host:port/db (default off)"),
    max_batch_size: Optional[int] = typer.Option(None, "--max-batch-size", min=1, help="sequences per forward step (default 8)"),
    max_batch_tokens: Optional[int] = typer.Option(
        None, "--max-batch-tokens", min=1,
        help="new tokens per forward step: one per decode plus prefill chunks; longer prompts are prefilled in "
             "chunks (default 4096)"),
    max_queue: Optional[int] = typer.Option(None, "--max-queue", min=0,
                                            help="requests that may wait beyond a full batch; more get 503 (default 64)"),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="the model name clients use (default: the engine's)"),
    default_max_tokens: Optional[int] = typer.Option(None, "--default-max-tokens", min=1,
                                                     help="max_tokens of a request that sets none (default 256)"),
    drain_timeout: Optional[float] = typer.Option(None, "--drain-timeout", min=0.0,
                                                  help="seconds in-flight requests get to finish on shutdown (default 30)"),
    log_level: Optional[str] = typer.Option(None, "--log-level", parser=NameChoice("log level", LOG_LEVELS),
                                            metavar="[" + "|".join(LOG_LEVELS) + "]", help="log level (default info)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="require 'Authorization: Bearer KEY' on /v1 (or RAGCACHE_API_KEY)"),
    index: Optional[Path] = typer.Option(
        None, "--index", help="a folder written by `ragcache index` (the one it prints, or the corpus folder it "
                              "indexed): every document of it is recognised inside plain chat messages, without the "
                              "request's documents field, and gets its own cache nodes (or RAGCACHE_INDEX)"),
    learned_documents: Optional[Path] = typer.Option(
        None, "--learned-documents", callback=lambda v: _not_a_folder(v) if v is not None else v,
        help="file keeping the documents learned from requests' documents field, so a restarted server still "
             "recognises them (default: $RAGCACHE_HOME/learned_documents.jsonl)"),
    remember_documents: Optional[bool] = typer.Option(
        None, "--remember-documents/--no-remember-documents",
        help="keep learned documents across restarts (default on; off: that file is neither read nor written)"),
) -> None:
    """Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models,
    /tokenize, /detokenize, /health, /metrics)."""
    with _user_errors():
        from ragcache_backend.errors import InvalidRequestError

        if model_arg is not None and model is not None and model_arg != model:
            raise InvalidRequestError(f"two models given: {model_arg!r} and --model {model!r}; give one")
        model = model or model_arg

        try:
            from ragcache_backend.server.app import bind_socket
            from ragcache_backend.server.app import serve as run_server
            from ragcache_backend.server.prompting import LearnedDocuments, load_index_documents
            from ragcache_backend.server.settings import load_settings
        except ImportError as exc:
            raise InvalidRequestError(f"ragcache serve needs the serve extra (pip install 'ragcache-kv[serve]'): {exc}") from None
        settings = load_settings(
            config_file, host=host, port=port, model=model, dtype=dtype, threads=threads, policy=policy, reuse=reuse,
            device_mib=device_mib, host_mib=host_mib, host_commit=host_commit, cache_dir=cache_dir, disk_cache=disk_cache,
            disk_budget_mib=disk_budget_mib, remote_url=remote_url, max_batch_size=max_batch_size,
            max_batch_tokens=max_batch_tokens, max_queue=max_queue,
            served_model_name=served_model_name, default_max_tokens=default_max_tokens, drain_timeout=drain_timeout,
            log_level=log_level, api_key=api_key, index=index, learned_documents=learned_documents,
            remember_documents=remember_documents,
        )
        _precheck(None, settings.model)
        config = settings.engine_config()
        if settings.learned_documents_path is not None:
            LearnedDocuments(settings.learned_documents_path).check()
        # before the model: a bad or damaged index fails in a moment, not after seconds of loading
        index_documents = load_index_documents(settings.index) if settings.index is not None else None
        if index_documents is not None:
            err.print(f"index: {len(index_documents)} documents recognised in prompts", highlight=False)
        try:
            sock = bind_socket(settings.host, settings.port)
        except OSError as exc:
            raise InvalidRequestError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from None
        level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
        logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")  # the engine's and disk tier's logs
        logging.getLogger("ragcache_backend").setLevel(level)
        from ragcache_backend.engine.engine import RAGCacheEngine

        # the port answers at once (/health: "starting"); the model loads (and another model than the
        # default measures its prefill profile on a fresh machine) in the background
        err.print("loading the model while listening...", highlight=False)
        run_server(lambda: RAGCacheEngine(config), settings, sock, index_documents=index_documents)


#: Bounds of ``ragcache bench``'s numeric options (0 means "the mode's default" where allowed).
BENCH_MIN = {"threads": 1, "num_requests": 0, "warmup": 0, "max_tokens": 0, "k": 1, "zipf": 0.0,
             "device_mib": 0, "host_mib": 0, "max_batch_size": 1, "max_batch_tokens": 1, "window": 0,
             "mmlu": 0, "policy_sim": 0, "drift_every": 1}
BENCH_CHOICES = {"corpus": NameChoice("corpus", ("docs", "faq"))}


def _checked_bench(bench: Callable[..., Any]) -> Callable[..., Any]:
    """``bench`` with every option checked before it starts (bounds and choices shown in ``--help``,
    comma-separated lists and paths checked while parsing) and user errors as one line, exit 2."""
    from ragcache_backend.bench.bench import OUR_SYSTEMS, PEER_VENVS

    callbacks = {
        "out": _not_a_file, "model": _existing_model, "rates": _rates, "host_sizes": _mib_sizes,
        "sim_host_sizes": _mib_sizes, "peers": _names_in("peer", tuple(PEER_VENVS)),
        "ours": _names_in("system", tuple(s.name for s in OUR_SYSTEMS)),
    }
    signature = inspect.signature(bench, eval_str=True)
    params = []
    for param in signature.parameters.values():
        info = param.default
        if isinstance(info, OptionInfo) and (
                param.name in BENCH_MIN or param.name in BENCH_CHOICES or param.name in callbacks):
            info = copy.copy(info)
            if param.name in BENCH_MIN:
                info.min = BENCH_MIN[param.name]
            if param.name in BENCH_CHOICES:
                info.parser = BENCH_CHOICES[param.name]
                info.metavar = BENCH_CHOICES[param.name].metavar
            if param.name in callbacks:
                info.callback = callbacks[param.name]
            param = param.replace(default=info)
        params.append(param)

    @functools.wraps(bench)
    def checked(**kwargs: Any) -> Any:
        with _user_errors():
            return bench(**kwargs)

    checked.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return checked


def _register_optional() -> None:
    with contextlib.suppress(ImportError):
        from ragcache_backend.bench.bench import bench

        app.command(name="bench")(_checked_bench(bench))


_register_optional()


class _NeverRaised(Exception):
    pass


_NoArgsIsHelp = getattr(_click_errors, "NoArgsIsHelpError", _NeverRaised)  # click >= 8.2


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point: exits 0, 2 for anything the user can fix (one line), 1 otherwise."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = typer.main.get_command(app)
    try:
        code = command.main(args=None if argv is None else list(argv), prog_name="ragcache", standalone_mode=False)
    except _NoArgsIsHelp as exc:
        exc.show()  # bare `ragcache`: the help, as before
        sys.exit(exc.exit_code)
    except _click_errors.UsageError as exc:  # bad option value, unknown option, missing argument
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        _print_error(f"{exc.format_message()}{hint}")
        sys.exit(2)
    except _click_errors.ClickException as exc:
        _print_error(exc.format_message())
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
