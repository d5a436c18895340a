"""Transparent document recognition: find known documents inside a flat prompt and segment it.

The LangChain and LlamaIndex adapters (SPEC §3) receive a prompt that the user's own template and
``format_docs`` already flattened: a string, or chat messages. RAGCache (§5.1) needs that prompt
as ``[text before, document 1, ..., document k, text after]`` so that each document's KV is served
from the knowledge tree. Two steps:

1. :class:`DocumentRecognizer` finds the texts of known documents (a store's documents, plus any
   the adapters register) in a string. It keeps an **anchor index**: the first
   :data:`ANCHOR_CHARS` characters of each document's stripped text -> candidate ids. One pass
   over the prompt probes that dict at every position (one slice + one hash each, never one
   ``str.find`` per known document), and each anchor hit is verified by an exact comparison of
   the document's whole text, so an edited document never matches (no false reuse). Documents
   shorter than :data:`ANCHOR_CHARS` are never recognised: they are under one KV block.
   Overlapping matches are resolved **longest first** (ties: leftmost, then smallest id); the
   result is non-overlapping, left to right.
2. :class:`PromptSegmenter` renders the model's chat template with a sentinel in place of each
   message's content, tokenises template pieces as template (control tokens parsed) and contents
   as user text (special-token strings stay plain text), then cuts each content's token ids at
   the recognised documents. The cut is made on the token boundaries of the content's own
   tokenisation, so the segments concatenate to exactly the tokens the unsegmented prompt has:
   **no tokenizer boundary effect at document edges** (a token that straddles a document edge,
   e.g. ``" What"`` after ``"Context:"``, goes to the document segment). A document segment's
   tokens can therefore depend on the character just before or after it; that is harmless,
   because a knowledge-tree node is keyed by its tokens *and* the exact path before it.
   Against a single tokenisation of the whole rendered prompt the only possible differences are
   at template/content edges, exactly as for :class:`~ragcache_backend.prompts.builder.PromptBuilder`;
   ``tests/integrations/test_recognition.py`` measures them (0 tokens on real RAG prompts with the
   default model's ChatML template).

Segments: everything before the first document is one cacheable TEXT segment (the template
opening, system prompt and the user's fixed template text, so it is reused too), each document a
cacheable DOCUMENT segment, text between documents a cacheable TEXT segment, and everything after
the last document (question, template closing) the non-cacheable TAIL. A prompt with no
recognised document is one TAIL segment, computed as usual.

This module knows nothing of LangChain or LlamaIndex.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ragcache_backend.retrieval.documents import Document
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.prompts.builder import PromptBuilder, Segment, SegmentKind, bos_text

__all__ = ["ANCHOR_CHARS", "ChatTurn", "DocumentRecognizer", "PromptSegmenter", "RecognizedSpan",
           "SegmentedPrompt"]

#: Characters of a document's stripped text used as its anchor; shorter documents are ignored.
ANCHOR_CHARS = 64
_SENTINEL = "\x00RAGCACHE_MSG{}\x00"
_SENTINEL_RE = re.compile("\x00RAGCACHE_MSG(\\d+)\x00")


@dataclass(slots=True, frozen=True)
class RecognizedSpan:
    """A known document found in a text: ``text[start:end]`` equals its stripped text."""

    start: int
    end: int
    doc_id: str

    def __len__(self) -> int:
        return self.end - self.start


class DocumentRecognizer:
    """An index over known document texts that finds them inside prompts (thread-safe).

    Args:
        documents: documents to index now (more with :meth:`add` / :meth:`add_documents`).
        anchor_chars: anchor length; documents whose stripped text is shorter are not indexed.
    """

    def __init__(self, documents: Iterable[Document] = (), *, anchor_chars: int = ANCHOR_CHARS) -> None:
        if anchor_chars < 1:
            raise InvalidRequestError(f"anchor_chars must be >= 1, got {anchor_chars}")
        self.anchor_chars = anchor_chars
        self._bodies: dict[str, str] = {}  # doc id -> stripped text
        self._id_of_body: dict[str, str] = {}  # stripped text -> first doc id with it
        self._anchors: dict[str, tuple[str, ...]] = {}  # anchor -> candidate doc ids
        self._watched: list[_Watched] = []
        self._lock = threading.RLock()
        self.add_documents(documents)

    def __len__(self) -> int:
        return len(self._bodies)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._bodies

    def add(self, doc_id: str, text: str) -> bool:
        """Index one document; False when it is too short or its text (or id) is already known.

        Watched stores are indexed first, so a document a store holds keeps the store's id even when
        the same text is offered under another id (a learned copy) before the next :meth:`find`."""
        self._sync()
        return self._add(doc_id, text)

    def id_of(self, text: str) -> str | None:
        """The id under which ``text`` (stripped) is indexed, or None."""
        self._sync()
        with self._lock:
            return self._id_of_body.get(text.strip())

    def _add(self, doc_id: str, text: str) -> bool:
        body = text.strip()
        with self._lock:
            if len(body) < self.anchor_chars or doc_id in self._bodies or body in self._id_of_body:
                return False
            self._bodies[doc_id] = body
            self._id_of_body[body] = doc_id
            anchor = body[: self.anchor_chars]
            self._anchors[anchor] = (*self._anchors.get(anchor, ()), doc_id)
            return True

    def add_documents(self, documents: Iterable[Document]) -> int:
        """Index several documents; returns how many were new."""
        self._sync()
        return sum(self._add(doc.doc_id, doc.text) for doc in documents)

    def watch(self, store) -> None:
        """Keep every document of ``store`` (a DocumentStore) indexed, including ones it gains later.

        New documents of watched stores are indexed lazily, at the next :meth:`find`.
        """
        with self._lock:
            if all(w.store is not store for w in self._watched):
                self._watched.append(_Watched(store))
                self._sync()

    def _sync(self) -> None:
        with self._lock:
            for w in self._watched:
                size = len(w.store)
                if size > w.indexed:
                    docs, w.indexed = w.store.documents[w.indexed : size], size
                    for doc in docs:
                        self._add(doc.doc_id, doc.text)

    def find(self, text: str) -> list[RecognizedSpan]:
        """Known documents in ``text``: non-overlapping spans, left to right (longest first wins)."""
        self._sync()
        width, anchors, bodies = self.anchor_chars, self._anchors, self._bodies
        found: list[RecognizedSpan] = []
        for i in range(len(text) - width + 1):
            ids = anchors.get(text[i : i + width])
            if ids:
                found.extend(RecognizedSpan(i, i + len(bodies[d]), d) for d in ids if text.startswith(bodies[d], i))
        return _resolve_overlaps(found)


@dataclass(slots=True)
class _Watched:
    """A watched document store and how many of its documents (in order) are indexed."""

    store: object
    indexed: int = 0


def _resolve_overlaps(spans: list[RecognizedSpan]) -> list[RecognizedSpan]:
    """Keep the longest spans first (ties: leftmost, then smallest id), dropping any that overlap."""
    kept: list[RecognizedSpan] = []
    for span in sorted(spans, key=lambda s: (-len(s), s.start, s.doc_id)):
        if all(span.end <= k.start or span.start >= k.end for k in kept):
            kept.append(span)
    return sorted(kept, key=lambda s: s.start)


@dataclass(slots=True, frozen=True)
class ChatTurn:
    """One chat message as plain text: ``role`` is the template's role name (system/user/...)."""

    role: str
    content: str


@dataclass(slots=True, frozen=True)
class SegmentedPrompt:
    """A prompt cut for the engine.

    Attributes:
        segments: what :meth:`RAGCacheEngine.generate_segments` takes.
        text: the rendered prompt text (template and contents).
        spans: the recognised documents, positions in ``text``.
    """

    segments: tuple[Segment, ...]
    text: str
    spans: tuple[RecognizedSpan, ...]

    @property
    def doc_ids(self) -> tuple[str, ...]:
        return tuple(s.doc_id for s in self.spans)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for s in self.segments for t in s.token_ids)


@dataclass(slots=True)
class _Piece:
    """Token ids of one run of the prompt; ``doc_id`` set for a recognised document."""

    token_ids: tuple[int, ...]
    doc_id: str | None = None


class PromptSegmenter:
    """Renders chat turns (or raw text) into segments, documents cut out for KV reuse.

    Args:
        prompts: the engine's :class:`PromptBuilder` (tokenizer and tokenisation rules).
        recognizer: the known documents.
        documents_alone: tokenise each recognised document on its own (and the text between them
            on its own) instead of cutting one tokenisation of the content at token edges. A
            document then has the same token ids wherever it appears, which chunk caches need
            (reuse at any position); the price is that tokens at a document's edges may differ
            from a single tokenisation of the prompt (as for :class:`PromptBuilder` documents).
            Off (the default), the segments concatenate to exactly the unsegmented prompt's tokens.
    """

    def __init__(self, prompts: PromptBuilder, recognizer: DocumentRecognizer, *, documents_alone: bool = False) -> None:
        self.prompts = prompts
        self.recognizer = recognizer
        self.documents_alone = documents_alone

    def chat(self, turns: Sequence[ChatTurn]) -> SegmentedPrompt:
        """Segments of ``turns`` in the model's chat template, with the assistant turn opened.

        Raises InvalidRequestError for no turns, or a chat template that does not insert message
        contents verbatim.
        """
        if not turns:
            raise InvalidRequestError("a chat prompt needs at least one message")
        return self._segment(self._render(turns), [t.content for t in turns])

    def raw(self, text: str) -> SegmentedPrompt:
        """Segments of ``text`` used as is (no chat template), for completion-style prompting."""
        if not text:
            raise InvalidRequestError("the prompt is empty")
        return self._segment(["", ""], [text])

    def _render(self, turns: Sequence[ChatTurn]) -> list[str]:
        """The template pieces around the message contents: ``len(turns) + 1`` strings."""
        tok = self.prompts.tokenizer
        if not getattr(tok, "chat_template", None):  # no template: contents separated by blank lines, after any BOS
            return [bos_text(tok), *["\n\n"] * (len(turns) - 1), "\n\n"]
        messages = [{"role": t.role, "content": _SENTINEL.format(i)} for i, t in enumerate(turns)]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        parts = _SENTINEL_RE.split(rendered)
        if parts[1::2] != [str(i) for i in range(len(turns))]:
            raise InvalidRequestError(
                "the model's chat template does not insert message contents verbatim, so its prompt "
                "cannot be segmented; use a model whose template does"
            )
        return parts[0::2]

    def _segment(self, template: list[str], contents: list[str]) -> SegmentedPrompt:
        pieces: list[_Piece] = []
        spans: list[RecognizedSpan] = []
        offset = 0
        for piece, content in zip(template, contents):
            pieces.append(_Piece(self.prompts.encode_template(piece)))
            offset += len(piece)
            found = self.recognizer.find(content)
            pieces.extend(self._cut(content, found))
            spans.extend(RecognizedSpan(s.start + offset, s.end + offset, s.doc_id) for s in found)
            offset += len(content)
        pieces.append(_Piece(self.prompts.encode_template(template[-1])))
        text = "".join(p + c for p, c in zip(template, contents)) + template[-1]
        return SegmentedPrompt(_group(pieces), text, tuple(spans))

    def _cut(self, content: str, spans: list[RecognizedSpan]) -> list[_Piece]:
        """The content's token ids (one tokenisation), cut at the token edges nearest each span;
        with ``documents_alone``, each document and each run of text between them tokenised alone."""
        if not content:
            return []
        if self.documents_alone:
            encode, pieces, done = self.prompts.encode_text, [], 0
            for span in spans:
                pieces.append(_Piece(encode(content[done:span.start])))
                pieces.append(_Piece(encode(content[span.start:span.end]), span.doc_id))
                done = span.end
            pieces.append(_Piece(encode(content[done:])))
            return pieces
        enc = self.prompts.tokenizer(content, add_special_tokens=False, split_special_tokens=True,
                                     return_offsets_mapping=True)
        ids = enc["input_ids"]
        starts = [start for start, _ in enc["offset_mapping"]]  # both non-decreasing
        ends = [end for _, end in enc["offset_mapping"]]
        pieces, done = [], 0
        for span in spans:  # a document is >= ANCHOR_CHARS long, so it keeps >= 1 token of its own
            first = bisect.bisect_right(ends, span.start, lo=done)  # first token ending inside it
            stop = bisect.bisect_left(starts, span.end, lo=first)  # first token starting after it
            pieces.append(_Piece(tuple(ids[done:first])))
            pieces.append(_Piece(tuple(ids[first:stop]), span.doc_id))
            done = stop
        pieces.append(_Piece(tuple(ids[done:])))
        return pieces


def _group(pieces: list[_Piece]) -> tuple[Segment, ...]:
    """TEXT before/between documents (cacheable), DOCUMENT per document, TAIL after the last one."""
    docs = [i for i, p in enumerate(pieces) if p.doc_id is not None]
    if not docs:
        return (Segment(_join(pieces), SegmentKind.TAIL, cacheable=False),)
    segments, start = [], 0
    for i in docs:
        text = _join(pieces[start:i])
        if text:
            segments.append(Segment(text, SegmentKind.TEXT, cacheable=True))
        segments.append(Segment(pieces[i].token_ids, SegmentKind.DOCUMENT, cacheable=True, doc_id=pieces[i].doc_id))
        start = i + 1
    tail = _join(pieces[start:])
    if tail:
        segments.append(Segment(tail, SegmentKind.TAIL, cacheable=False))
    return tuple(segments)


def _join(pieces: Sequence[_Piece]) -> tuple[int, ...]:
    return tuple(t for p in pieces for t in p.token_ids)
