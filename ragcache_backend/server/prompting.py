"""From request bodies to engine segments, with the server's documents recognised.

The server keeps one :class:`~ragcache_backend.prompts.recognition.DocumentRecognizer`: documents a
request passes explicitly (``documents``) are registered in it, so they are recognised wherever
they appear, in this request's messages and in any later request's. A passed document that the
messages do not already contain is put at the start of the last user message (documents
separated by blank lines, then a blank line, then the original content), so a plain OpenAI
client gets a RAG prompt whose documents' KV is reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.prompts.recognition import ChatTurn, DocumentRecognizer, PromptSegmenter, SegmentedPrompt
from ragcache_backend.retrieval.documents import content_id
from ragcache_backend.server.errors import APIError
from ragcache_backend.server.schema import ChatMessage, ExplicitDocument

__all__ = ["PassedDocument", "PromptAssembler", "chat_turns", "passed_documents", "with_documents",
           "with_documents_raw"]

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
    """Messages as plain-text turns (text parts joined).

    Raises:
        APIError: 400 for a non-text content part, or a message carrying tool or function calls.
    """
    turns = []
    for i, message in enumerate(messages):
        if message.tool_calls or message.function_call:
            raise APIError(400, f"message {i} carries tool calls; this server has no tool calling",
                           param=f"messages[{i}].tool_calls")
        content = message.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"message {i} has a {part.type!r} content part; only text is supported",
                                   param=f"messages[{i}].content[{j}]", code="unsupported_content")
                parts.append(part.text)
            content = "".join(parts)
        turns.append(ChatTurn(_ROLES.get(message.role, message.role), content or ""))
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


class PromptAssembler:
    """Segments requests for one engine over the server's recognizer (thread-safe).

    Args:
        engine: whose tokenizer and template are used.
        recognizer: the server's known documents (default: a new, empty one).
    """

    def __init__(self, engine: RAGCacheEngine, recognizer: DocumentRecognizer | None = None) -> None:
        self.recognizer = recognizer or DocumentRecognizer()
        if engine.store is not None:
            self.recognizer.watch(engine.store)
        # exact reuse cuts one tokenisation (the segments equal the unsegmented prompt's tokens);
        # chunk reuse tokenises each document alone, so its tokens are the same at any position
        self._exact = PromptSegmenter(engine.prompts, self.recognizer, documents_alone=False)
        self._alone = PromptSegmenter(engine.prompts, self.recognizer, documents_alone=True)

    def register(self, documents: Sequence[PassedDocument]) -> None:
        """Make ``documents`` recognisable from now on.

        Raises:
            APIError: 400 when an id already names another text.
        """
        for i, doc in enumerate(documents):
            known = self.recognizer.id_of(doc.text)
            if known is None and doc.doc_id in self.recognizer:
                raise APIError(400, f"document id {doc.doc_id!r} already names another text; use another id",
                               param=f"documents[{i}].id")
            if known is None:
                self.recognizer.add(doc.doc_id, doc.text)  # False (ignored) for texts under 64 characters

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
