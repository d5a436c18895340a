"""Prompt frames and the speculation board (pipelining inside an unchanged chain), without a model."""

from __future__ import annotations

import time
from types import SimpleNamespace

from ragcache_backend.prompts.recognition import ChatTurn, DocumentRecognizer
from ragcache_backend.retrieval.documents import content_id
from ragcache_integrations._speculation import SpeculationBoard, learn_frame, speculative_retrieval

A = ("Tuples are immutable sequences and can serve as dictionary keys when hashable. " * 3).strip()
B = ("The global interpreter lock lets one thread execute Python bytecode at a time. " * 3).strip()
C = ("Generators yield values lazily and keep their frame alive between calls to next. " * 3).strip()


def recognizer() -> DocumentRecognizer:
    rec = DocumentRecognizer()
    for text in (A, B, C):
        rec.add(content_id(text), text)
    return rec


def turns(question: str, docs: list[str]) -> list[ChatTurn]:
    return [ChatTurn("system", "You answer from context."),
            ChatTurn("user", f"Question: {question}\nContext: {chr(10).join(docs)}\nAnswer:")]


def test_frame_predicts_the_next_prompt_exactly():
    retrieved = [("What is a tuple?", (content_id(A), content_id(B)))]
    frame = learn_frame(turns("What is a tuple?", [A, B]), recognizer(), retrieved, make=list, engine=None)
    assert frame is not None and frame.num_documents == 2
    assert frame.turns_for("Why the GIL?", [B, C]) == turns("Why the GIL?", [B, C])


def test_no_frame_without_the_query_or_with_other_documents():
    rec = recognizer()
    assert learn_frame(turns("WHAT IS A TUPLE?", [A, B]), rec, [("What is a tuple?", (content_id(A), content_id(B)))],
                       make=list, engine=None) is None  # the chain rewrote the question
    assert learn_frame(turns("What is a tuple?", [A, C]), rec, [("What is a tuple?", (content_id(A), content_id(B)))],
                       make=list, engine=None) is None  # not the documents that were retrieved
    assert learn_frame(turns("What is a tuple?", []), rec, [("What is a tuple?", ())], make=list, engine=None) is None


class _Hit:
    def __init__(self, text: str) -> None:
        self.text, self.doc_id = text, content_id(text)


def test_a_prediction_that_cannot_run_never_fails_the_retrieval():
    board = SpeculationBoard()
    engine = SimpleNamespace(waiting_requests=0, max_prefill_bs=1)  # the SpeculativeTarget protocol

    def make(_turns):
        raise ValueError("prompt too long")

    board.note_retrieval("q1", [content_id(A), content_id(B)])
    board.learn(turns("q1", [A, B]), recognizer(), make, engine)
    assert board.frame(2) is not None
    stages = [[_Hit(A), _Hit(C)], [_Hit(B), _Hit(C)]]
    docs = speculative_retrieval("q2", iter(stages), key=lambda h: h.doc_id, text=lambda h: h.text, board=board)
    assert [d.text for d in docs] == [B, C]
    assert board.posted == 0


class _Outcome:
    def __init__(self) -> None:
        self.discarded = False

    def discard(self) -> None:
        self.discarded = True


def test_posted_generations_expire_are_taken_once_and_are_bounded():
    board = SpeculationBoard(ttl_s=0.2, max_posted=2)
    first, second, third = _Outcome(), _Outcome(), _Outcome()
    board.post("a", first)
    board.post("b", second)
    board.post("c", third)  # over max_posted: the oldest is cancelled
    assert first.discarded and board.posted == 2
    assert board.take("b") is second and board.take("b") is None
    time.sleep(0.5)
    assert third.discarded and board.posted == 0 and not second.discarded
