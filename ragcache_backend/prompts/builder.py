"""Prompt assembly as a list of segments (RAGCache §5.1, SPEC §2 "prompt assembly").

A request's prompt is ``[prefix, document_1, ..., document_k, tail]``:

* **prefix** = the chat template's opening, the system prompt and the start of the user turn;
  it is the first level of the knowledge tree (the system-prompt node);
* each **document** is tokenised on its own, so its token ids, and so its KV boundaries, are the
  same wherever it appears; it becomes one node per distinct path;
* the **tail** = the question and the template's closing (``assistant`` turn start).

:func:`plan_prompt` says which tokens the knowledge tree may serve: with whole-prompt reuse (the
default, as vLLM's prefix cache) every segment is a tree node except the prompt's last token,
which is always computed for the first token's logits; without it, only the leading run of
cacheable segments.

Text that comes from users (system prompt, documents, question) is tokenised with special-token
parsing *off*: a document containing ``<|im_end|>`` gets the plain-text tokens of that string,
never the control token. Only the chat template's own pieces may produce control tokens.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ragcache_backend.errors import EmptyQueryError, InvalidRequestError
from ragcache_backend.cache.knowledge_tree import SegmentKey

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents in the user's message. "
    "Be concise."
)
_SYS, _CTX, _Q = "\x00RAGCACHE_SYS\x00", "\x00RAGCACHE_CTX\x00", "\x00RAGCACHE_Q\x00"


class SegmentKind(str, enum.Enum):
    """What a segment holds."""

    PREFIX = "prefix"
    DOCUMENT = "document"
    TEXT = "text"
    TAIL = "tail"


#: Longest accepted ``cache_salt`` (characters).
MAX_SALT_CHARS = 256


def segment_key(token_ids: Sequence[int], salt: str = "") -> SegmentKey:
    """Content hash of a segment's token ids (32 hex chars): the knowledge-tree child key.

    ``salt`` (a tenant's ``cache_salt``) enters the hash when non-empty: the same tokens under two
    salts get two keys, so KV computed under one salt is never served under another, in any tier
    and in the chunk caches (every key of the request is salted, not only the first)."""
    digest = hashlib.sha256(b"ragcache-seg-v1")
    if salt:
        digest.update(b"\x00salt\x00" + salt.encode("utf-8", "surrogatepass") + b"\x00")
    digest.update(",".join(map(str, token_ids)).encode())
    return SegmentKey(digest.hexdigest()[:32])


@dataclass(slots=True, frozen=True)
class Segment:
    """A run of prompt tokens with one identity.

    Attributes:
        token_ids: the tokens (non-empty).
        kind: prefix, document, free text or tail.
        cacheable: True when its KV may be stored in (and served from) the knowledge tree. Only a
            leading run of cacheable segments is ever served from the tree.
        doc_id: the document's content-hash id, for document segments.
        salt: the tenant's ``cache_salt`` ("" = none); part of ``key``.
        key: content hash of ``token_ids`` and ``salt`` (computed).
    """

    token_ids: tuple[int, ...]
    kind: SegmentKind
    cacheable: bool
    doc_id: str | None = None
    salt: str = ""
    key: SegmentKey = field(init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise InvalidRequestError(f"empty {self.kind.value} segment")
        if not isinstance(self.salt, str) or len(self.salt) > MAX_SALT_CHARS:
            raise InvalidRequestError(f"cache_salt must be a string of at most {MAX_SALT_CHARS} characters")
        object.__setattr__(self, "key", segment_key(self.token_ids, self.salt))

    def __len__(self) -> int:
        return len(self.token_ids)


def cacheable_lead(segments: Sequence[Segment]) -> list[Segment]:
    """The segments served from and inserted into the knowledge tree: the leading run of cacheable
    segments, never the last segment (it is always computed: it yields the first token)."""
    lead: list[Segment] = []
    for s in segments[:-1]:
        if not s.cacheable:
            break
        lead.append(s)
    return lead


def bos_text(tokenizer) -> str:
    """The BOS token's text when ``tokenizer`` puts one before plain text (Gemma, Llama 2), else
    "": a prompt without a chat template starts with it, as the tokenizer's own encoding would
    (Gemma's output degrades without it)."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos_id else ""


class PromptBuilder:
    """Turns ``(system prompt, documents, question)`` into segments with the model's chat template.

    Args:
        tokenizer: a transformers tokenizer. With a chat template, the template is rendered once
            with placeholder markers and split into its fixed pieces; without one, a plain
            ``system / documents / Question: ... Answer:`` layout is used (after the BOS token
            where the tokenizer adds one, :func:`bos_text`).
        system_prompt: the system message (plain text).
    """

    def __init__(self, tokenizer, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self._head, self._mid, self._between, self._end = self._template_pieces()
        self._prefix = self._make_prefix()

    def _template_pieces(self) -> tuple[str, str, str, str]:
        if getattr(self.tokenizer, "chat_template", None):
            msgs = [{"role": "system", "content": _SYS}, {"role": "user", "content": _CTX + _Q}]
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            head, rest = text.split(_SYS, 1)
            mid, rest = rest.split(_CTX, 1)
            between, end = rest.split(_Q, 1)
            return head, mid, between, end
        return bos_text(self.tokenizer), "\n\n", "", "\nAnswer:"

    def encode_text(self, text: str) -> tuple[int, ...]:
        """Token ids of user-supplied text, special-token strings treated as plain text."""
        if not text:
            return ()
        return tuple(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def encode_template(self, text: str) -> tuple[int, ...]:
        """Token ids of a chat-template piece (its control tokens are parsed as such)."""
        if not text:
            return ()
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _make_prefix(self) -> Segment:
        ids = self.encode_template(self._head) + self.encode_text(self.system_prompt) + self.encode_template(self._mid)
        return Segment(ids, SegmentKind.PREFIX, cacheable=True)

    @property
    def prefix(self) -> Segment:
        """The system-prompt segment (first level of the knowledge tree)."""
        return self._prefix

    def document(self, text: str, doc_id: str | None = None) -> Segment:
        """A document segment: the stripped text followed by a blank line."""
        body = text.strip()
        if not body:
            raise InvalidRequestError(f"document {doc_id or ''} is empty")
        return Segment(self.encode_text(body + "\n\n"), SegmentKind.DOCUMENT, cacheable=True, doc_id=doc_id)

    def tail(self, question: str) -> Segment:
        """The question and the template's closing; raises EmptyQueryError for a blank question."""
        q = question.strip()
        if not q:
            raise EmptyQueryError("the question is empty")
        ids = self.encode_template(self._between) + self.encode_text(f"Question: {q}") + self.encode_template(self._end)
        return Segment(ids, SegmentKind.TAIL, cacheable=False)

    def build(self, question: str, documents: Sequence[tuple[str, str | None]], *,
              question_first: bool = False) -> list[Segment]:
        """Segments for a RAG request: prefix, one per ``(text, doc_id)`` in retrieval order, tail.

        ``question_first`` puts the question before the documents, as LangChain's stock RAG prompt
        does (``Question: ... Context: ... Answer:``): ``[prefix, question text, documents...,
        tail]``. Only chunk-cache reuse serves those documents after a new question.
        """
        if not question_first:
            tail = self.tail(question)
            return [self._prefix, *(self.document(t, d) for t, d in documents), tail]
        q = question.strip()
        if not q:
            raise EmptyQueryError("the question is empty")
        head = Segment(self.encode_text(f"Question: {q}\nContext:\n\n"), SegmentKind.TEXT, cacheable=True)
        tail = Segment(self.encode_template(self._between) + self.encode_text("Answer:") + self.encode_template(self._end),
                       SegmentKind.TAIL, cacheable=False)
        return [self._prefix, head, *(self.document(t, d) for t, d in documents), tail]


@dataclass(slots=True, frozen=True)
class PromptPlan:
    """How a prompt meets the knowledge tree.

    Attributes:
        lead: segments served from / inserted into the tree, in prompt order (a prefix path).
        rest: token ids past the lead, always computed (never empty: at least the last token).
        rest_blocks: the rest starts on a block boundary of its segment (block-granular plans):
            the full blocks of what the request computes past the lead (the rest, then the
            generated tokens) may become block nodes under the lead when it finishes.
        repeat: the prompt's last, shorter block without its final token (the rest's head), or
            None: served from the tree only when it is cached after the lead (an exact repeat of
            an earlier prompt; :meth:`with_repeat`), otherwise computed with the rest.
    """

    lead: tuple[Segment, ...]
    rest: tuple[int, ...]
    rest_blocks: bool = False
    repeat: Segment | None = None

    def with_repeat(self) -> PromptPlan:
        """This plan with :attr:`repeat` joined to the lead (the tree holds it): the rest is the
        final token, and it no longer starts on a block boundary."""
        if self.repeat is None:
            return self
        return PromptPlan((*self.lead, self.repeat), self.rest[len(self.repeat):])


def split_blocks(segment: Segment, block_tokens: int, *, partial: bool = True) -> list[Segment]:
    """``segment`` as block nodes of ``block_tokens`` tokens (vLLM's block hashes, RAGCache's tree):
    every block is a segment of its own kind and salt, keyed by its tokens, so any two prompts
    that share their first ``N`` tokens of this segment share ``floor(N / block_tokens)`` block
    nodes. A document is never split (it is RAGCache's unit of reuse). ``partial``: keep the
    last, shorter block (False drops it).

    Raises:
        InvalidRequestError: ``block_tokens`` < 1.
    """
    if block_tokens < 1:
        raise InvalidRequestError(f"block_tokens must be >= 1, got {block_tokens}")
    ids = segment.token_ids
    if segment.kind is SegmentKind.DOCUMENT or (len(ids) <= block_tokens and partial):
        return [segment]
    stop = len(ids) if partial else len(ids) - len(ids) % block_tokens
    return [Segment(ids[a : a + block_tokens], segment.kind, cacheable=True, doc_id=segment.doc_id, salt=segment.salt)
            for a in range(0, stop, block_tokens)]


def plan_prompt(segments: Sequence[Segment], *, whole_prompt: bool = True, block_tokens: int | None = None) -> PromptPlan:
    """Split a prompt into its cacheable lead and the tokens always computed.

    With ``whole_prompt`` every segment joins the lead, the last one without its final token (so
    an exact repeat of a prompt reuses all but one token, RAGCache's tree extended to the
    question as vLLM's block cache does); otherwise the lead is :func:`cacheable_lead`.

    With ``block_tokens`` (block-granular reuse, the engine's default) text that no document
    marks is cut into block nodes (:func:`split_blocks`); under ``whole_prompt`` only the full
    blocks of the last segment join the lead (its last, shorter block and final token are the
    rest), so the rest starts on a block boundary and a longer prompt that continues this one
    (the next turn of a chat) finds the same blocks, and the ones its answer filled; that shorter
    block is the plan's ``repeat``, served when cached (an exact repeat still reuses all but the
    final token).

    Raises:
        InvalidRequestError: no segments, or ``block_tokens`` < 1.
    """
    if not segments:
        raise InvalidRequestError("a prompt needs at least one segment")
    if block_tokens is not None and block_tokens < 1:
        raise InvalidRequestError(f"block_tokens must be >= 1, got {block_tokens}")
    if not whole_prompt:
        lead = cacheable_lead(segments)
        rest = tuple(t for s in segments[len(lead):] for t in s.token_ids)
        if block_tokens is None:
            return PromptPlan(tuple(lead), rest)
        return PromptPlan(tuple(b for s in lead for b in split_blocks(s, block_tokens)), rest, rest_blocks=True)
    *body, last = segments
    if block_tokens is None:
        lead = list(body)
        if len(last) > 1:
            lead.append(Segment(last.token_ids[:-1], last.kind, cacheable=True, doc_id=last.doc_id, salt=last.salt))
        return PromptPlan(tuple(lead), last.token_ids[-1:])
    lead = [b for s in body for b in split_blocks(s, block_tokens)]
    full = (len(last) - 1) // block_tokens * block_tokens
    if full:
        head = Segment(last.token_ids[:full], SegmentKind.TEXT if last.kind is SegmentKind.DOCUMENT else last.kind,
                       cacheable=True, salt=last.salt)
        lead.extend(split_blocks(head, block_tokens))
    partial = last.token_ids[full:-1]
    repeat = Segment(partial, SegmentKind.TEXT if last.kind is SegmentKind.DOCUMENT else last.kind, cacheable=True,
                     salt=last.salt) if partial else None
    return PromptPlan(tuple(lead), last.token_ids[full:], rest_blocks=True, repeat=repeat)
