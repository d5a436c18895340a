"""The ``ragcache`` command line: ``index``, ``ask``, ``demo`` (and ``bench``).

Every error a user can cause is a :class:`~ragcache_backend.errors.RAGCacheError`; the CLI prints
its message on one line and exits with status 2 (1 for unexpected failures), never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import typer
from rich.console import Console
from rich.table import Table

from ragcache_backend.errors import RAGCacheError

app = typer.Typer(
    help="ragcache: document-level KV caching for retrieval-augmented generation (RAGCache).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    try:
        yield
    except RAGCacheError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None


def _precheck(corpus: Optional[Path], model: Optional[str]) -> None:
    """Cheap checks before minutes of indexing or seconds of model loading."""
    from ragcache_backend.errors import CorpusError, ModelLoadError

    if corpus is not None and not corpus.is_dir():
        raise CorpusError(f"corpus folder does not exist: {corpus}")
    if model is not None and not Path(model).expanduser().exists():
        raise ModelLoadError(f"model path does not exist: {model}")


def _quiet_loaders() -> None:
    """transformers' weight-loading progress bars say nothing useful to a CLI user."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _engine(model: Optional[str], dtype: str, threads: int, policy: str = "pgdsf", store=None):
    from ragcache_backend.config import EngineConfig
    from ragcache_backend.engine.engine import RAGCacheEngine

    with err.status("loading the model (and, the first time, measuring its prefill profile)..."):
        return RAGCacheEngine(EngineConfig(model=model, dtype=dtype, threads=threads, policy=policy), store=store)


def _store(corpus: Optional[Path], *, rebuild: bool = False):
    from ragcache_backend.demo.datasets import python_docs_dir
    from ragcache_backend.retrieval.docstore import build_index

    _quiet_loaders()
    corpus = corpus if corpus is not None else python_docs_dir()
    err.print(f"corpus: {corpus}")
    return build_index(corpus, progress=True, rebuild=rebuild)


MODEL = typer.Option(None, "--model", help="GGUF file or HF folder of a Llama-family model (default: SmolLM2-135M-Instruct)")
DTYPE = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16")
THREADS = typer.Option(os.cpu_count() or 1, "--threads", help="torch threads")
CORPUS = typer.Option(None, "--corpus", help="folder of .rst/.txt/.md/.html (default: the Python 3.11 docs)")


@app.command()
def index(
    corpus: Path = typer.Argument(..., help="folder of .rst/.txt/.md/.html documents"),
    rebuild: bool = typer.Option(False, "--rebuild", help="rebuild even if a matching index exists"),
) -> None:
    """Chunk, embed and index a folder (stored under $RAGCACHE_HOME/indexes)."""
    with _user_errors():
        from ragcache_backend.retrieval.docstore import default_store_dir

        store = _store(corpus, rebuild=rebuild)
        out.print(f"{len(store)} chunks indexed ({store.index_kind.value}) in {default_store_dir(corpus)}")


@app.command()
def ask(
    question: str = typer.Argument(..., help="the question"),
    corpus: Optional[Path] = CORPUS,
    k: int = typer.Option(3, "--k", min=1, help="documents to retrieve"),
    policy: str = typer.Option("pgdsf", "--policy", help="pgdsf | gdsf | lru | lfu"),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
    model: Optional[str] = MODEL,
    dtype: str = DTYPE,
    threads: int = THREADS,
) -> None:
    """Answer one question from the top-k retrieved documents."""
    with _user_errors():
        from ragcache_backend.errors import EmptyQueryError
        from ragcache_backend.model.sampling import SamplingParams

        if not question.strip():
            raise EmptyQueryError("the question is empty")
        if policy not in {"pgdsf", "gdsf", "lru", "lfu"}:
            from ragcache_backend.errors import UnknownPolicyError

            raise UnknownPolicyError(f"unknown policy {policy!r}; choose pgdsf, gdsf, lru or lfu")
        _precheck(corpus, model)
        store = _store(corpus)
        engine = _engine(model, dtype, threads, policy, store)
        hits = store.search(question, k)
        sampling = SamplingParams(max_tokens=max_tokens)
        if as_json:
            result = engine.generate(question, [h.document for h in hits], sampling)
            payload = {f: getattr(result, f) for f in result.__slots__}
            payload["sources"] = [{"doc_id": h.document.doc_id, "title": h.document.title,
                                   "source": h.document.source, "score": h.score} for h in hits]
            out.print_json(json.dumps(payload))
            return
        for chunk in engine.stream(question, [h.document for h in hits], sampling):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        result = chunk.result
        sys.stdout.write("\n")
        for h in hits:
            err.print(f"  [dim]source:[/] {h.document.title} ({h.document.source})", highlight=False)
        err.print(f"  [dim]TTFT {result.ttft_s * 1000:.0f} ms, {result.cached_tokens}/{result.prompt_tokens} "
                  f"prompt tokens from the cache[/]")


@app.command()
def demo(
    questions: int = typer.Option(8, "--questions", min=1, help="FAQ questions to sample"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write per-question records and the ratio here"),
    corpus: Optional[Path] = CORPUS,
    k: int = typer.Option(3, "--k", min=1, help="documents per question"),
    max_tokens: int = typer.Option(48, "--max-tokens", min=1),
    seed: int = typer.Option(0, "--seed"),
    model: Optional[str] = MODEL,
    dtype: str = DTYPE,
    threads: int = THREADS,
) -> None:
    """Real FAQ questions over the Python docs, with and without the cache (mean TTFT and ratio)."""
    with _user_errors():
        from ragcache_backend.demo.datasets import faq_questions, python_docs_dir
        from ragcache_backend.demo.demo import run_demo, write_report

        _precheck(corpus, model)
        docs_root = python_docs_dir()
        store = _store(corpus)
        engine = _engine(model, dtype, threads, store=store)
        pool = faq_questions(docs_root)
        with err.status("") as status:
            report = run_demo(
                engine, store, pool, k=k, num_questions=questions, max_tokens=max_tokens, seed=seed,
                progress=lambda i, n, label: status.update(f"request {i}/{n} ({label})"),
            )
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
        if json_file is not None:
            write_report(report, json_file)
            out.print(f"wrote {json_file}")


def _register_optional() -> None:
    with contextlib.suppress(ImportError):
        from ragcache_backend.bench.bench import bench

        app.command(name="bench")(bench)


_register_optional()


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
