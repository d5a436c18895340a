"""Documents the server knows without a client's help: an index given to ``ragcache serve --index``
is recognised inside plain chat messages, and documents learned from the ``documents`` field
survive a restart (a new app over the same file), whatever state that file is in.

In-process apps (httpx ``ASGITransport``) over the tiny random model; indexes are written with
random vectors (the embedder is never loaded: the server only recognises, never searches).
"""

from __future__ import annotations

import json
import logging
import socket

import httpx
import numpy as np
import pytest

from ragcache_backend import cli
from ragcache_backend.config import EngineConfig
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.retrieval.docstore import DocumentStore, default_store_dir
from ragcache_backend.retrieval.documents import Document, content_id
from ragcache_backend.retrieval.embedder import Embedder
from ragcache_backend.server.app import create_app
from ragcache_backend.server.prompting import LearnedDocuments, PassedDocument
from ragcache_backend.server.settings import ServerSettings

RAIL = ("The Larkspur Valley Railway carried slate from the quarries at Upper Larkspur down to Merrow harbour, "
        "with four small tank engines named after local birds.")
HARBOUR = ("Merrow harbour silted up after the storm of 1911; the slate trade moved to the new deep-water quay at "
           "Kestle, and the railway closed to goods traffic two years later.")
ENGINES = ("The four tank engines were Wren, Linnet, Curlew and Kite. Kite, the last survivor, is displayed at the "
           "Merrow heritage centre, restored in her 1905 green livery.")
QUESTION = "Which engines did the railway have?"


@pytest.fixture(scope="module")
def engine(tiny_model, fixed_profile):
    eng = RAGCacheEngine(EngineConfig(device_budget_bytes=4 << 20, host_budget_bytes=16 << 20),
                         loaded=tiny_model, profile=fixed_profile)
    yield eng
    eng.close(cancel=True)


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def write_index(folder, texts) -> list[Document]:
    """A store as ``ragcache index`` saves it (flat index, random unit vectors)."""
    docs = [Document.from_text(t, source="larkspur.md", title=f"section {i}") for i, t in enumerate(texts)]
    vectors = np.random.default_rng(0).standard_normal((len(docs), 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    DocumentStore.build(docs, Embedder(), vectors=vectors, progress=False).save(folder)
    return docs


def pasted(*texts: str) -> list[dict]:
    """A plain chat request: the documents pasted into the user message, no documents field."""
    return [{"role": "user", "content": "Context:\n" + "\n\n".join(texts) + f"\n\nQuestion: {QUESTION}"}]


async def chat(api: httpx.AsyncClient, **body) -> dict:
    response = await api.post("/v1/chat/completions", json={"max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    return response.json()


# ---- (a) an index's documents are recognised in plain chat messages -----------------------------
async def test_index_documents_are_recognised_in_plain_messages(engine, tmp_path):
    docs = write_index(tmp_path / "index", [RAIL, HARBOUR, ENGINES])
    async with client_for(create_app(engine, ServerSettings())) as api:  # no index: nothing recognised
        assert (await chat(api, messages=pasted(RAIL, ENGINES)))["ragcache"]["documents"] == []
    async with client_for(create_app(engine, ServerSettings(index=tmp_path / "index"))) as api:
        first = await chat(api, messages=pasted(RAIL, ENGINES))
        assert first["ragcache"]["documents"] == [docs[0].doc_id, docs[2].doc_id]
        # each document is its own node: the same documents under another question are reused
        other = await chat(api, messages=[{"role": "user", "content": pasted(RAIL, ENGINES)[0]["content"]
                                           .replace(QUESTION, "Where did the slate go?")}])
        assert other["ragcache"]["documents"] == [docs[0].doc_id, docs[2].doc_id]
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_index_given_as_its_corpus_folder(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = write_index(default_store_dir(corpus), [HARBOUR])  # where `ragcache index corpus` writes it
    async with client_for(create_app(engine, ServerSettings(index=corpus))) as api:
        assert (await chat(api, messages=pasted(HARBOUR)))["ragcache"]["documents"] == [docs[0].doc_id]


# ---- (b) learned documents survive a restart ----------------------------------------------------
async def test_learned_documents_are_recognised_after_a_restart(engine, tmp_path, monkeypatch):
    monkeypatch.delenv("RAGCACHE_LEARNED_DOCUMENTS")  # the default file, under RAGCACHE_HOME
    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path / "home"))
    learned = tmp_path / "home" / "learned_documents.jsonl"
    body = {"messages": [{"role": "user", "content": QUESTION}],
            "documents": [{"id": "rail", "text": RAIL}, HARBOUR, "too short to be recognised"]}
    async with client_for(create_app(engine, ServerSettings())) as api:
        assert (await chat(api, **body))["ragcache"]["documents"] == ["rail", content_id(HARBOUR)]
        await chat(api, **body)  # learned again: stored once
    assert [json.loads(line)["id"] for line in learned.read_text().splitlines()] == ["rail", content_id(HARBOUR)]

    # a restart: a new app (a new recognizer) over the same home; no documents field this time
    async with client_for(create_app(engine, ServerSettings())) as api:
        plain = await chat(api, messages=pasted(HARBOUR, RAIL))
        assert plain["ragcache"]["documents"] == [content_id(HARBOUR), "rail"]
        clash = await api.post("/v1/chat/completions", json={**body, "documents": [{"id": "rail", "text": ENGINES}]})
        assert clash.status_code == 400 and clash.json()["error"]["param"] == "documents[0].id"
        await chat(api, **body)  # known since the start: not stored again
    assert len(learned.read_text().splitlines()) == 2

    # --no-remember-documents: the file is neither read nor written
    async with client_for(create_app(engine, ServerSettings(remember_documents=False))) as api:
        assert (await chat(api, messages=pasted(HARBOUR, RAIL)))["ragcache"]["documents"] == []
        await chat(api, messages=[{"role": "user", "content": QUESTION}], documents=[ENGINES])
    assert len(learned.read_text().splitlines()) == 2


# ---- (c) a damaged file never stops the server ---------------------------------------------------
def line(doc_id: str, text: str, stored_text: str | None = None) -> bytes:
    """A line of a learned-documents file; ``stored_text``: the text written in place of the
    checksummed one (a modified line)."""
    from ragcache_backend.server.prompting import _line_checksum

    row = {"id": doc_id, "text": text if stored_text is None else stored_text, "sha256": _line_checksum(doc_id, text)}
    return json.dumps(row).encode() + b"\n"


async def test_damaged_learned_documents_are_skipped(engine, tmp_path, caplog):
    path = tmp_path / "learned.jsonl"
    path.write_bytes(
        line("rail", RAIL)
        + line("harbour", HARBOUR, stored_text=HARBOUR.replace("1911", "1912"))  # modified: checksum mismatch
        + b"\xff\xfe\x00 not json at all\n"
        + b"[1, 2, 3]\n"
        + line("rail-again", RAIL)  # the same text twice: kept once
        + line("engines", ENGINES)[:-25]  # torn by a crash: no end, no newline
    )
    settings = ServerSettings(learned_documents=path)
    with caplog.at_level(logging.WARNING, logger="ragcache_backend.server.prompting"):
        app = create_app(engine, settings)
    assert "skipped 4 damaged line(s) (line 2, 3, 4, 6)" in caplog.text
    async with client_for(app) as api:
        assert (await chat(api, messages=pasted(RAIL, HARBOUR, ENGINES)))["ragcache"]["documents"] == ["rail"]
        await chat(api, messages=[{"role": "user", "content": QUESTION}], documents=[{"id": "engines", "text": ENGINES}])
    # rewritten without the damaged lines, then appended to
    assert path.read_bytes() == line("rail", RAIL) + line("engines", ENGINES)
    async with client_for(create_app(engine, settings)) as api:
        assert (await chat(api, messages=pasted(RAIL, ENGINES)))["ragcache"]["documents"] == ["rail", "engines"]


def test_learned_documents_file_edge_cases(tmp_path, caplog):
    path = tmp_path / "learned.jsonl"
    path.write_bytes(bytes(range(256)) * 4)  # garbage, no newline at all
    with caplog.at_level(logging.WARNING):
        assert LearnedDocuments(path).load() == []
    assert "damaged" in caplog.text and path.read_bytes() == b""
    # a last line complete but for its newline is kept, and the next append starts on a fresh line
    path.write_bytes(line("rail", RAIL)[:-1])
    journal = LearnedDocuments(path)
    assert journal.load() == [PassedDocument("rail", RAIL)]
    journal.append([PassedDocument("harbour", HARBOUR)])
    assert LearnedDocuments(path).load() == [PassedDocument("rail", RAIL), PassedDocument("harbour", HARBOUR)]
    assert path.read_bytes() == line("rail", RAIL) + line("harbour", HARBOUR)
    # a new file's folder is created; a folder is a setting to fix, not damage
    nested = LearnedDocuments(tmp_path / "new" / "home" / "learned.jsonl")
    assert nested.load() == []
    nested.append([PassedDocument("rail", RAIL)])
    assert nested.load() == [PassedDocument("rail", RAIL)]
    with pytest.raises(InvalidRequestError, match="is a folder"):
        LearnedDocuments(tmp_path).load()


# ---- (d) ragcache serve --index: checked before the model loads ---------------------------------
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


def damaged_index(tmp_path):
    write_index(tmp_path / "damaged", [RAIL])
    with open(tmp_path / "damaged" / "documents.jsonl", "a") as handle:
        handle.write("\n")
    return tmp_path / "damaged"


@pytest.mark.parametrize(("make", "needle"), [
    (lambda tmp: tmp / "missing", "index folder does not exist"),
    (lambda tmp: tmp, "is not a ragcache index"),
    (lambda tmp: (tmp / "file.txt").write_text("x") and tmp / "file.txt", "is not a folder"),
    (damaged_index, "--rebuild"),
])
@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_bad_index_fails_before_the_model_loads(capsys, monkeypatch, tmp_path, make, needle, how):
    monkeypatch.setattr(cli, "_engine", lambda *a, **k: pytest.fail("the model must not load"))
    folder = make(tmp_path)
    if how == "env":
        monkeypatch.setenv("RAGCACHE_INDEX", str(folder))
        code, _, stderr = run_cli(capsys, "serve")
    else:
        code, _, stderr = run_cli(capsys, "serve", "--index", str(folder))
    assert code == 2 and stderr.startswith("error: ") and needle in stderr and len(stderr.strip().splitlines()) == 1


def test_serve_learned_documents_folder_fails_before_the_model_loads(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "_engine", lambda *a, **k: pytest.fail("the model must not load"))
    code, _, stderr = run_cli(capsys, "serve", "--learned-documents", str(tmp_path))
    assert code == 2 and "is a folder" in stderr
    monkeypatch.setenv("RAGCACHE_LEARNED_DOCUMENTS", str(tmp_path))
    code, _, stderr = run_cli(capsys, "serve")
    assert code == 2 and "is a folder" in stderr


def test_serve_index_reaches_the_server(capsys, monkeypatch, tmp_path):
    import ragcache_backend.server.app as server_app

    docs = write_index(tmp_path / "index", [RAIL, HARBOUR])
    started = {}

    def fake_serve(engine, settings, sock=None, *, index_documents=None):
        sock.close()
        started.update(engine=engine, settings=settings, index_documents=index_documents)

    monkeypatch.setattr(server_app, "serve", fake_serve)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, _, stderr = run_cli(capsys, "serve", "--port", str(port), "--index", str(tmp_path / "index"))
    assert code == 0, stderr
    assert "index: 2 documents" in stderr
    # serve gets what builds the engine (it listens first, then builds it in the background)
    assert callable(started["engine"]) and started["settings"].index == tmp_path / "index"
    assert started["index_documents"] == docs
