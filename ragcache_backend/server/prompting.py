"""From request bodies to engine segments, with the server's documents recognised.

The server keeps one :class:`~ragcache_backend.prompts.recognition.DocumentRecognizer`: documents a
request passes explicitly (``documents``) are registered in it, so they are recognised wherever
they appear, in this request's messages and in any later request's. A passed document that the
messages do not already contain is put at the start of the last user message (documents
separated by blank lines, then a blank line, then the original content), so a plain OpenAI
client gets a RAG prompt whose documents' KV is reused.

The server also knows documents without a client's help: those of an index written by
``ragcache index`` (``ragcache serve --index DIR``, :func:`load_index_documents`) are recognised
inside plain chat messages, and the documents it learned from requests are kept in a JSON-lines
file (:class:`LearnedDocuments`), so a restarted server still recognises them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.errors import CorruptFileError, InvalidRequestError
from ragcache_backend.prompts.recognition import ChatTurn, DocumentRecognizer, PromptSegmenter, SegmentedPrompt
from ragcache_backend.prompts.tools import ToolError, render_tool_calls, render_tool_result
from ragcache_backend.retrieval.documents import Document, content_id
from ragcache_backend.server.errors import APIError
from ragcache_backend.server.schema import ChatMessage, ExplicitDocument

__all__ = ["LearnedDocuments", "PassedDocument", "PromptAssembler", "chat_turns", "index_folder",
           "load_index_documents", "passed_documents", "with_documents", "with_documents_raw"]

log = logging.getLogger(__name__)

#: Role names as the chat template knows them (``developer`` is OpenAI's newer name of ``system``).
_ROLES = {"developer": "system", "function": "tool"}


@dataclass(slots=True, frozen=True)
class PassedDocument:
    """A document from a request's ``documents`` field: its id and its stripped text."""

    doc_id: str
    text: str


def passed_documents(items: Sequence[str | ExplicitDocument] | None) -> list[PassedDocument]:
    """The ``documents`` field as :class:`PassedDocument` (id: the given one, else the content hash).

    Raises:
        APIError: 400 for a blank document.
    """
    docs = []
    for i, item in enumerate(items or ()):
        text = (item if isinstance(item, str) else item.text).strip()
        if not text:
            raise APIError(400, f"document {i} is empty", param=f"documents[{i}]")
        doc_id = content_id(text) if isinstance(item, str) or item.id is None else item.id
        docs.append(PassedDocument(doc_id, text))
    return docs


def chat_turns(messages: Sequence[ChatMessage]) -> list[ChatTurn]:
    """Messages as plain-text turns (text parts joined). An assistant's ``tool_calls`` become the
    calls as the model writes them, a ``tool`` message a ``<tool_response>`` in a user turn
    (:mod:`ragcache_backend.prompts.tools`).

    Raises:
        APIError: 400 for a non-text content part, a legacy ``function_call``, or tool calls that
            cannot be rendered (no function name, arguments not a JSON object).
    """
    turns = []
    for i, message in enumerate(messages):
        if message.function_call:
            raise APIError(400, f"message {i} carries a legacy function_call; use tool_calls",
                           param=f"messages[{i}].function_call")
        content = message.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise APIError(400, f"message {i} has a {part.type!r} content part; only text is supported",
                                   param=f"messages[{i}].content[{j}]", code="unsupported_content")
                if part.text is None:
                    raise APIError(400, f"message {i}: its text content part {j} has no 'text'",
                                   param=f"messages[{i}].content[{j}].text", code="invalid_value")
                parts.append(part.text)
            content = "".join(parts)
        content = content or ""
        role = _ROLES.get(message.role, message.role)
        if message.tool_calls:
            if message.role != "assistant":
                raise APIError(400, f"message {i}: only assistant messages carry tool_calls",
                               param=f"messages[{i}].tool_calls")
            try:
                calls = render_tool_calls(message.tool_calls)
            except ToolError as exc:
                raise APIError(400, f"message {i}: {exc}", param=f"messages[{i}].tool_calls") from None
            content = f"{content}\n{calls}" if content else calls
        if role == "tool":
            role, content = "user", render_tool_result(content)
        turns.append(ChatTurn(role, content))
    return turns


def with_documents(turns: list[ChatTurn], documents: Sequence[PassedDocument]) -> list[ChatTurn]:
    """``turns`` with the documents no message contains put at the start of the last user message.

    Raises:
        APIError: 400 when documents must be inserted and there is no user message.
    """
    missing = [d.text for d in documents if not any(d.text in t.content for t in turns)]
    if not missing:
        return turns
    last_user = next((i for i in range(len(turns) - 1, -1, -1) if turns[i].role == "user"), None)
    if last_user is None:
        raise APIError(400, "documents can only be added to a request with a user message", param="documents")
    turn = turns[last_user]
    out = list(turns)
    out[last_user] = ChatTurn(turn.role, "\n\n".join(missing) + "\n\n" + turn.content)
    return out


def with_documents_raw(prompt: str, documents: Sequence[PassedDocument]) -> str:
    """A completion prompt with the documents it does not contain put at its start (blank-line separated)."""
    missing = [d.text for d in documents if d.text not in prompt]
    return "\n\n".join([*missing, prompt]) if missing else prompt


# ---- documents the server knows without a client's help ----------------------------------------
def index_folder(path: Path) -> Path:
    """The document store folder ``path`` names: a folder written by ``ragcache index`` (it holds a
    ``manifest.json``), or the corpus folder that ``ragcache index`` indexed (its store is then found
    under ``$RAGCACHE_HOME/indexes``).

    Raises:
        InvalidRequestError: ``path`` is missing, not a folder, or neither an index nor an indexed corpus.
    """
    from ragcache_backend.retrieval.docstore import default_store_dir
    from ragcache_backend.retrieval.docstore_io import MANIFEST

    path = Path(path).expanduser()
    if not path.exists():
        raise InvalidRequestError(f"index folder does not exist: {path}")
    if not path.is_dir():
        raise InvalidRequestError(f"index {path} is not a folder; give the folder `ragcache index` wrote")
    if (path / MANIFEST).is_file():
        return path
    built = default_store_dir(path)
    if (built / MANIFEST).is_file():
        return built
    raise InvalidRequestError(f"{path} is not a ragcache index (no {MANIFEST}) nor an indexed corpus folder; "
                              f"build one with `ragcache index CORPUS` and pass the folder it names (or CORPUS)")


def load_index_documents(path: Path) -> list[Document]:
    """The documents of the index at ``path`` (see :func:`index_folder`), every checksum verified.

    Only the documents are kept: the server recognises them and never searches, so no embedder is
    loaded.

    Raises:
        InvalidRequestError: ``path`` is not an index (:func:`index_folder`).
        CorruptFileError: the index is damaged or incomplete (the message says how to rebuild it).
    """
    from ragcache_backend.retrieval.docstore_io import read_store

    folder = index_folder(path)
    try:
        _, documents, _ = read_store(folder)
    except CorruptFileError as exc:
        raise CorruptFileError(f"index {folder} is damaged: {exc}; rebuild it with `ragcache index CORPUS --rebuild`") from exc
    log.info("index %s: %d documents recognised in prompts", folder, len(documents))
    return documents


def _line_checksum(doc_id: str, text: str) -> str:
    return hashlib.sha256(json.dumps([doc_id, text], ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def _learned_lines(documents: Sequence[PassedDocument]) -> bytes:
    """``documents`` as lines of a learned-documents file (UTF-8, each ending with a newline)."""
    return "".join(json.dumps({"id": d.doc_id, "text": d.text, "sha256": _line_checksum(d.doc_id, d.text)},
                              ensure_ascii=False) + "\n" for d in documents).encode("utf-8")


def _learned_line(raw: bytes) -> PassedDocument | None:
    """The document of one line of a learned-documents file; None if the line is damaged."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(row, dict) or set(row) != {"id", "text", "sha256"}:
        return None
    doc_id, text, checksum = row["id"], row["text"], row["sha256"]
    if not (isinstance(doc_id, str) and doc_id and isinstance(text, str) and text.strip()
            and checksum == _line_checksum(doc_id, text)):
        return None
    return PassedDocument(doc_id, text)


class LearnedDocuments:
    """Documents learned from requests' ``documents`` field, kept in a JSON-lines file so that a
    restarted server recognises them too.

    One JSON object per line: ``{"id", "text", "sha256"}``, ``sha256`` the first 16 hex digits of the
    sha256 of ``[id, text]`` as JSON. New documents are appended (one write per request, flushed and
    fsynced, starting on a fresh line even after a torn write). Reading skips a damaged line (a
    truncated last line, garbage, a checksum mismatch) with a warning, never fails on one, and then
    rewrites the file atomically with the good lines only; a text stored twice is kept once.

    Args:
        path: the file (created, with its folder, on the first append).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser()
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raises InvalidRequestError when the path is a folder (a setting to fix, not damage)."""
        if self.path.is_dir():
            raise InvalidRequestError(f"learned documents file {self.path} is a folder; give a file name")

    def load(self) -> list[PassedDocument]:
        """The documents in the file, in the order learned (none when it does not exist).

        Raises:
            InvalidRequestError: the path is a folder.
        """
        self.check()
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("cannot read the learned documents in %s (%s); starting without them", self.path, exc)
            return []
        documents: list[PassedDocument] = []
        texts: set[str] = set()
        damaged: list[int] = []
        repeated = 0
        for number, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            doc = _learned_line(raw)
            if doc is None:
                damaged.append(number)
            elif doc.text in texts:
                repeated += 1
            else:
                texts.add(doc.text)
                documents.append(doc)
        if damaged:
            shown = ", ".join(map(str, damaged[:10])) + (", ..." if len(damaged) > 10 else "")
            log.warning("%s: skipped %d damaged line(s) (line %s): truncated or modified", self.path,
                        len(damaged), shown)
        if damaged or repeated:
            self._rewrite(documents)
        return documents

    def append(self, documents: Sequence[PassedDocument]) -> None:
        """Add ``documents`` at the end of the file; a failure is logged, never raised (the server
        still recognises them until it stops)."""
        if not documents:
            return
        payload = _learned_lines(documents)
        with self._lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a+b") as handle:
                    if handle.seek(0, os.SEEK_END) > 0:
                        handle.seek(-1, os.SEEK_END)
                        if handle.read(1) != b"\n":  # a torn last line: start on a fresh one
                            payload = b"\n" + payload
                    handle.write(payload)
                    handle.flush()
                    os.fsync(handle.fileno())
            except OSError as exc:
                log.warning("cannot keep %d learned document(s) in %s (%s); they are recognised until the "
                            "server stops", len(documents), self.path, exc)

    def _rewrite(self, documents: Sequence[PassedDocument]) -> None:
        """Replace the file by ``documents`` (temporary file, fsync, rename); a failure is logged."""
        lines = _learned_lines(documents)
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
        with self._lock:
            try:
                with open(tmp, "xb") as handle:
                    handle.write(lines)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, self.path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                log.warning("cannot rewrite %s without its damaged lines (%s)", self.path, exc)


class PromptAssembler:
    """Segments requests for one engine over the server's recognizer (thread-safe).

    Args:
        engine: whose tokenizer and template are used; its store's documents (if any) are recognised.
        recognizer: the server's known documents (default: a new, empty one).
        documents: more documents to recognise (an index's, :func:`load_index_documents`).
        learned: where documents passed in requests are kept across restarts: those it holds are
            recognised now, new ones are appended (None: forgotten when the server stops).
    """

    def __init__(self, engine: RAGCacheEngine, recognizer: DocumentRecognizer | None = None, *,
                 documents: Iterable[Document] = (), learned: LearnedDocuments | None = None) -> None:
        self.recognizer = recognizer or DocumentRecognizer()
        if engine.store is not None:
            self.recognizer.watch(engine.store)
        self.recognizer.add_documents(documents)
        self.learned = learned
        if learned is not None:
            docs = learned.load()
            added = sum(self.recognizer.add(d.doc_id, d.text) for d in docs)
            if docs:
                log.info("%s: %d learned documents (%d new to the recognizer)", learned.path, len(docs), added)
        self._lock = threading.Lock()  # one request's check-then-add at a time
        # exact reuse cuts one tokenisation (the segments equal the unsegmented prompt's tokens);
        # chunk reuse tokenises each document alone, so its tokens are the same at any position
        self._exact = PromptSegmenter(engine.prompts, self.recognizer, documents_alone=False)
        self._alone = PromptSegmenter(engine.prompts, self.recognizer, documents_alone=True)

    def register(self, documents: Sequence[PassedDocument]) -> None:
        """Make ``documents`` recognisable from now on (and, with ``learned``, after a restart).

        Raises:
            APIError: 400 when an id already names another text.
        """
        new: list[PassedDocument] = []
        with self._lock:
            try:
                for i, doc in enumerate(documents):
                    known = self.recognizer.id_of(doc.text)
                    if known is None and doc.doc_id in self.recognizer:
                        raise APIError(400, f"document id {doc.doc_id!r} already names another text; use another id",
                                       param=f"documents[{i}].id")
                    # False (not kept) for a known text or one under 64 characters
                    if known is None and self.recognizer.add(doc.doc_id, doc.text):
                        new.append(doc)
            finally:
                if new and self.learned is not None:
                    self.learned.append(new)

    def _segmenter(self, reuse: str) -> PromptSegmenter:
        return self._exact if reuse == "exact" else self._alone

    def chat(self, turns: Sequence[ChatTurn], reuse: str) -> SegmentedPrompt:
        """Segments of chat ``turns`` in the model's template (assistant turn opened).

        Raises:
            InvalidRequestError: the template cannot be segmented.
        """
        return self._segmenter(reuse).chat(list(turns))

    def raw(self, prompt: str, reuse: str) -> SegmentedPrompt:
        """Segments of a completion prompt used as is.

        Raises:
            InvalidRequestError: empty prompt.
        """
        return self._segmenter(reuse).raw(prompt)
