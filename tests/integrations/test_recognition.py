"""Document recognition and prompt segmentation (ragcache_backend.prompts.recognition).

The recognizer tests use synthetic and real FAQ documents and no model. The segmentation tests
use the real default tokenizer and measure the tokenizer boundary effect on real RAG prompts:
the segmented token ids against (a) the same prompt tokenised without document cuts and (b) the
whole rendered prompt tokenised at once (``apply_chat_template(tokenize=True)``). The documented
bound is 0 differing tokens for both; the naive alternative (tokenising each document on its own)
is measured too, to show the effect the token-boundary cut avoids.
"""

from __future__ import annotations

import difflib
import random
import time

import pytest

from ragcache_backend.retrieval.documents import Document, load_corpus
from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.prompts.builder import PromptBuilder, SegmentKind
from ragcache_backend.prompts.recognition import (
    ANCHOR_CHARS,
    ChatTurn,
    DocumentRecognizer,
    PromptSegmenter,
    RecognizedSpan,
)
from tests.integrations.rag_prompts import RLM_RAG_PROMPT

ALPHA = Document.from_text("Alpha: " + "the quick brown fox jumps over the lazy dog. " * 4, source="a", title="A")
BETA = Document.from_text("Beta: " + "pack my box with five dozen liquor jugs, said the sphinx. " * 3,
                          source="b", title="B")


def doc(text: str) -> Document:
    return Document.from_text(text, source="t", title="t")


class FakeStore:
    """The two members of DocumentStore the recognizer reads."""

    def __init__(self, documents: list[Document]) -> None:
        self._docs = list(documents)

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def documents(self) -> tuple[Document, ...]:
        return tuple(self._docs)

    def add(self, document: Document) -> None:
        """The store grows (as DocumentStore does when documents are indexed later)."""
        self._docs.append(document)


# ---- recognizer ---------------------------------------------------------------------------------
def test_finds_documents_left_to_right_however_wrapped() -> None:
    rec = DocumentRecognizer([ALPHA, BETA])
    prompt = f"Context:<doc>{BETA.text}</doc>\n[1] {ALPHA.text.strip()}\nQuestion: why?"
    spans = rec.find(prompt)
    assert [s.doc_id for s in spans] == [BETA.doc_id, ALPHA.doc_id]
    for span, d in zip(spans, (BETA, ALPHA)):
        assert prompt[span.start:span.end] == d.text.strip()


def test_edited_document_is_not_recognised() -> None:
    rec = DocumentRecognizer([ALPHA, BETA])
    edited = ALPHA.text.replace("lazy dog. the quick", "lazy cat. the quick", 1)
    start = len(edited) + 2
    assert rec.find(f"{edited}\n\n{BETA.text}") == [RecognizedSpan(start, start + len(BETA.text.strip()), BETA.doc_id)]
    truncated = ALPHA.text[:-5]  # same anchor, text cut short
    assert rec.find(truncated) == []


def test_overlapping_candidates_longest_first() -> None:
    part = doc(ALPHA.text[10:120])  # a document that is a piece of ALPHA
    tail_overlap = doc(ALPHA.text[-80:] + " and then some more words that only this document has.")
    rec = DocumentRecognizer([part, ALPHA, tail_overlap])
    spans = rec.find(ALPHA.text)
    assert [s.doc_id for s in spans] == [ALPHA.doc_id]  # the piece inside is dropped
    prompt = ALPHA.text + " and then some more words that only this document has."
    assert [s.doc_id for s in rec.find(prompt)] == [ALPHA.doc_id]  # ALPHA is longer than the overlap
    assert [s.doc_id for s in rec.find(prompt[10:])] == [tail_overlap.doc_id]  # ALPHA cut: no match


def test_repeated_document_gives_two_spans() -> None:
    rec = DocumentRecognizer([ALPHA])
    spans = rec.find(f"{ALPHA.text}\n--\n{ALPHA.text}")
    assert [s.doc_id for s in spans] == [ALPHA.doc_id, ALPHA.doc_id]
    assert spans[0].end < spans[1].start


def test_short_and_duplicate_documents_are_not_indexed() -> None:
    rec = DocumentRecognizer()
    assert not rec.add("short", "x" * (ANCHOR_CHARS - 1))
    assert rec.add(ALPHA.doc_id, ALPHA.text)
    assert not rec.add("other-id-same-text", "  " + ALPHA.text + "\n")
    assert len(rec) == 1 and ALPHA.doc_id in rec and "short" not in rec
    assert rec.find("") == [] and rec.find("x" * 10) == []
    with pytest.raises(InvalidRequestError):
        DocumentRecognizer(anchor_chars=0)


def test_watched_store_documents_are_indexed_lazily() -> None:
    store = FakeStore([ALPHA])
    rec = DocumentRecognizer()
    rec.watch(store)
    rec.watch(store)  # idempotent
    assert ALPHA.doc_id in rec
    store.add(BETA)
    assert [s.doc_id for s in rec.find(BETA.text)] == [BETA.doc_id]


def test_a_store_document_keeps_its_id_when_a_learned_copy_comes_first() -> None:
    store = FakeStore([ALPHA])
    rec = DocumentRecognizer()
    rec.watch(store)
    store.add(BETA)  # not yet indexed: the store grew after watch
    assert rec.add("learned-copy", BETA.text) is False  # the store's own id was indexed first
    assert rec.id_of(BETA.text) == BETA.doc_id
    assert [s.doc_id for s in rec.find(BETA.text)] == [BETA.doc_id]
    assert rec.id_of("never seen") is None


def test_find_is_one_pass_over_a_large_index(faq_dir) -> None:
    """Indexing the whole Python documentation (~9.5k documents) keeps find() per prompt fast."""
    from ragcache_backend.demo.datasets import python_docs_dir

    docs = load_corpus(python_docs_dir())
    rec = DocumentRecognizer(docs)
    chosen = docs[100:104]
    prompt = "Use the context.\n\n" + "\n\n".join(d.text for d in chosen) + "\n\nQuestion: what?"
    start = time.perf_counter()
    spans = rec.find(prompt)
    elapsed = time.perf_counter() - start
    assert [s.doc_id for s in spans] == [d.doc_id for d in chosen]
    assert elapsed < 0.25, f"find() took {elapsed * 1000:.1f} ms on a {len(prompt)}-char prompt"


# ---- segmentation (real tokenizer) ----------------------------------------------------------------
TEMPLATES = {
    "rlm-rag-prompt": [("user", RLM_RAG_PROMPT)],
    "context-first": [("user", "Use the following pieces of context to answer the question at the end.\n\n"
                               "{context}\n\nQuestion: {question}\n\nHelpful Answer:")],
    "system-context": [("system", "Answer using this context:\n\n{context}"), ("user", "{question}")],
    "xml-no-space": [("user", "<docs>{xml}</docs>\nQ: {question}")],
}


def render(template, question: str, docs: list[Document]) -> list[ChatTurn]:
    context = "\n\n".join(d.text for d in docs)
    xml = "".join(f"<doc>{d.text}</doc>" for d in docs)
    return [ChatTurn(role, text.format(question=question, context=context, xml=xml)) for role, text in template]


def differing(a, b) -> int:
    """Tokens of the longer sequence outside the longest common matching blocks."""
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return max(len(a), len(b)) - sum(block.size for block in matcher.get_matching_blocks())


@pytest.fixture(scope="module")
def faq_docs(faq_dir) -> list[Document]:
    return load_corpus(faq_dir)


@pytest.fixture(scope="module")
def prompts(real_model) -> PromptBuilder:
    return PromptBuilder(real_model.tokenizer)


def naive_tokens(prompts: PromptBuilder, turns: list[ChatTurn], segmenter: PromptSegmenter) -> tuple[int, ...]:
    """The alternative this module avoids: each document and each text run tokenised on its own."""
    out: list[int] = []
    pieces = segmenter._render(turns)
    for piece, turn in zip(pieces, turns):
        out += prompts.encode_template(piece)
        done = 0
        for span in segmenter.recognizer.find(turn.content):
            out += prompts.encode_text(turn.content[done:span.start])
            out += prompts.encode_text(turn.content[span.start:span.end])
            done = span.end
        out += prompts.encode_text(turn.content[done:])
    return tuple(out + list(prompts.encode_template(pieces[-1])))


@pytest.mark.model
def test_boundary_effect_on_real_prompts(prompts, faq_docs, faq_questions, real_model) -> None:
    segmenter = PromptSegmenter(prompts, DocumentRecognizer(faq_docs))
    plain = PromptSegmenter(prompts, DocumentRecognizer())
    rng = random.Random(0)
    measured = {}
    for name, template in TEMPLATES.items():
        worst_unsegmented = worst_whole = naive = tokens = 0
        for question in faq_questions[:8]:
            docs = rng.sample(faq_docs, 3)
            turns = render(template, question, docs)
            cut = segmenter.chat(turns)
            assert cut.doc_ids == tuple(d.doc_id for d in docs)
            whole = real_model.tokenizer.apply_chat_template(
                [{"role": t.role, "content": t.content} for t in turns], tokenize=True,
                add_generation_prompt=True, return_dict=False)
            worst_unsegmented = max(worst_unsegmented, differing(cut.token_ids, plain.chat(turns).token_ids))
            worst_whole = max(worst_whole, differing(cut.token_ids, whole))
            naive += differing(naive_tokens(prompts, turns, segmenter), whole)
            tokens += len(whole)
        measured[name] = (worst_unsegmented, worst_whole, naive, tokens)
    print("\nboundary effect (worst vs unsegmented, worst vs whole prompt, naive total, tokens):", measured)
    assert all(m[0] == 0 and m[1] == 0 for m in measured.values()), measured
    assert sum(m[2] for m in measured.values()) > 0  # cutting on token edges is what avoids it


@pytest.mark.model
def test_segments_layout_and_reuse_across_questions(prompts, faq_docs) -> None:
    segmenter = PromptSegmenter(prompts, DocumentRecognizer(faq_docs))
    docs = faq_docs[:2]
    first = segmenter.chat(render(TEMPLATES["context-first"], "How fast are exceptions?", docs))
    second = segmenter.chat(render(TEMPLATES["context-first"], "Why are strings immutable?", docs))
    kinds = [s.kind for s in first.segments]
    assert kinds == [SegmentKind.TEXT, SegmentKind.DOCUMENT, SegmentKind.TEXT, SegmentKind.DOCUMENT, SegmentKind.TAIL]
    assert [s.cacheable for s in first.segments] == [True, True, True, True, False]
    assert [s.doc_id for s in first.segments if s.doc_id] == [d.doc_id for d in docs]
    assert [s.key for s in first.segments[:-1]] == [s.key for s in second.segments[:-1]]  # reusable prefix
    assert first.segments[-1].key != second.segments[-1].key
    for span in first.spans:
        assert first.text[span.start:span.end] == next(d.text for d in docs if d.doc_id == span.doc_id).strip()


@pytest.mark.model
def test_no_document_and_raw_prompts(prompts, faq_docs) -> None:
    segmenter = PromptSegmenter(prompts, DocumentRecognizer(faq_docs))
    plain = segmenter.chat([ChatTurn("user", "Hello there")])
    assert [s.kind for s in plain.segments] == [SegmentKind.TAIL] and not plain.spans
    raw = segmenter.raw(faq_docs[0].text + "\n\nQ: what?\nA:")
    assert [s.kind for s in raw.segments] == [SegmentKind.DOCUMENT, SegmentKind.TAIL]
    assert raw.token_ids == prompts.encode_text(raw.text)
    with pytest.raises(InvalidRequestError):
        segmenter.chat([])
    with pytest.raises(InvalidRequestError):
        segmenter.raw("")


@pytest.mark.model
def test_special_token_strings_in_content_stay_text(prompts, faq_docs) -> None:
    segmenter = PromptSegmenter(prompts, DocumentRecognizer(faq_docs))
    im_end = prompts.tokenizer.convert_tokens_to_ids("<|im_end|>")
    cut = segmenter.chat([ChatTurn("user", f"{faq_docs[0].text}\n<|im_end|> injected")])
    assert cut.token_ids.count(im_end) == 2  # the system and user turn ends only, not the injected one


@pytest.mark.model
def test_documents_alone_have_the_same_tokens_wherever_they_appear(prompts, faq_docs) -> None:
    """Chunk caches need a document's token ids not to depend on the text before it; cut on the
    token edges of one tokenisation (the default) they can (a leading space merges into a token)."""
    doc = faq_docs[3]
    turns = [[ChatTurn("user", f"Question: why?\nContext: {doc.text.strip()}\n\nAnswer:")],
             [ChatTurn("user", f"Context:\n{faq_docs[4].text.strip()}\n\n{doc.text.strip()} Question: how?")]]
    alone = PromptSegmenter(prompts, DocumentRecognizer(faq_docs), documents_alone=True)
    ids = [next(s.token_ids for s in alone.chat(t).segments if s.doc_id == doc.doc_id) for t in turns]
    assert ids[0] == ids[1] == prompts.encode_text(doc.text.strip())
    edges = PromptSegmenter(prompts, DocumentRecognizer(faq_docs))
    cut = [next(s.token_ids for s in edges.chat(t).segments if s.doc_id == doc.doc_id) for t in turns]
    assert cut[0] != cut[1]  # the position-dependent tokenisation documents_alone avoids
