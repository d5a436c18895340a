"""Chat traces for the serving benchmarks, as JSONL rows ``{"prompt": [chat messages]}`` that vLLM's
``custom`` dataset sends unchanged (``--backend openai-chat``): multi-turn chats over the Python FAQ
and context-first RAG prompts over the Python docs (documents inside the user message, no
``documents`` field), drawn by :func:`ragcache_backend.bench.workload.build_workload`.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

CHAT_SYSTEM = ("You are a patient Python tutor. The student asks one question after another about the Python "
               "language, its standard library and its C API. Answer each question accurately and concisely, "
               "in plain prose, and add a short code example only when it really helps.")


def answer_text(document: str, question: str, limit: int = 600) -> str:
    """A plausible assistant answer: the paragraphs of ``document`` after ``question`` (or from its
    start), about ``limit`` characters, cut at a paragraph boundary."""
    at = document.find(question)
    body = document[at + len(question):] if at >= 0 else document
    out = ""
    for para in (p.strip() for p in body.split("\n\n")):
        if not para:
            continue
        if out and len(out) + len(para) > limit:
            break
        out = f"{out}\n\n{para}" if out else para
    return out[: 2 * limit]


def multi_turn_trace(store, pool, num_chats: int, turns: int, seed: int) -> tuple[list[dict], dict]:
    """Turn-major requests (every chat's turn 1, then every chat's turn 2, ...): ``[{"prompt": messages}]``."""
    rng = random.Random(seed)
    usable = [q for q in pool if q.doc_ids]
    if turns > len(usable):
        raise ValueError(f"--turns {turns} > {len(usable)} FAQ questions")
    chats = []
    for _ in range(num_chats):
        chats.append([(q.text, answer_text(store.get(q.doc_ids[0]).text, q.text)) for q in rng.sample(usable, turns)])
    rows, turn_of = [], []
    for t in range(turns):
        for chat in chats:
            messages = [{"role": "system", "content": CHAT_SYSTEM}]
            for question, answer in chat[:t]:
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": chat[t][0]})
            rows.append({"prompt": messages})
            turn_of.append(t + 1)
    return rows, {"chats": num_chats, "turns": turns, "turn_of_request": turn_of}


def rag_trace(store, pool, num_requests: int, seed: int) -> tuple[list[dict], dict]:
    """Context-first RAG chats: system prompt, then documents + question in one user message."""
    from ragcache_backend.bench.workload import build_workload
    from ragcache_backend.prompts.builder import DEFAULT_SYSTEM_PROMPT

    wl = build_workload(store, pool, num_requests=num_requests, seed=seed)
    rows, seen, repeats = [], set(), []
    for r in wl.requests:
        user = ("Answer from these documents.\n\n" + "\n\n".join(wl.documents[d] for d in r.doc_ids)
                + f"\n\nQuestion: {r.question}")
        rows.append({"prompt": [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": user}]})
        repeats.append(r.doc_ids in seen)
        seen.add(r.doc_ids)
    return rows, {"requests": num_requests, "k": wl.k, "zipf_s": wl.zipf_s, "distinct_documents": len(wl.documents),
                  "distinct_document_lists": len(seen), "skew": wl.skew, "repeat_of_request": repeats}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
