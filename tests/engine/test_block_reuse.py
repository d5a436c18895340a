"""Every shared prefix reused: block nodes under the knowledge tree (issue 20).

Text that no document marks is cached in block nodes of ``block_size`` tokens; documents keep their
own nodes; a finished request's full tail blocks (its answer) join the tree; the prompt's last,
shorter block is kept for an exact repeat. All on the tiny random Llama in fp32: reused logits
equal a cold prefill's to 1e-4.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load as st_load

from ragcache_backend.cache.kv_file import FileHeader, KVFileFormat, read_metadata
from ragcache_backend.model.sampling import SamplingParams
from ragcache_backend.prompts import builder
from ragcache_backend.prompts.builder import Segment, SegmentKind, plan_prompt, split_blocks
from tests.engine.test_engine import DOCS, assert_no_leak, make_engine

B = 16  # the engines' block size (EngineConfig default)
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def text_ids(seed: int, n: int) -> tuple[int, ...]:
    """``n`` ordinary token ids (no special tokens), seeded."""
    rng = random.Random(seed)
    return tuple(rng.randrange(1000, 40000) for _ in range(n))


def raw(ids) -> list[Segment]:
    """A prompt no document marks: one segment, as a plain chat message or completion is."""
    return [Segment(tuple(ids), SegmentKind.TAIL, cacheable=False)]


def cold(engine, segments) -> torch.Tensor:
    return engine.first_token_logits(segments, use_cache=False)[0]


@pytest.fixture()
def engine(tiny_model, fixed_profile):
    return make_engine(tiny_model, fixed_profile)


# ---- the plan -----------------------------------------------------------------------------------
def test_plan_cuts_text_into_blocks_and_keeps_documents_whole():
    prefix = Segment(text_ids(1, 2 * B + 5), SegmentKind.PREFIX, cacheable=True)
    doc = Segment(text_ids(2, 3 * B + 7), SegmentKind.DOCUMENT, cacheable=True, doc_id="d")
    tail = Segment(text_ids(3, B + 4), SegmentKind.TAIL, cacheable=False)
    plan = plan_prompt([prefix, doc, tail], block_tokens=B)
    assert [len(s) for s in plan.lead] == [B, B, 5, 3 * B + 7, B]  # the document is one node
    assert plan.lead[3].doc_id == "d" and plan.rest_blocks
    assert plan.rest == tail.token_ids[B:] and plan.repeat.token_ids == tail.token_ids[B:-1]
    again = plan.with_repeat()
    assert again.rest == tail.token_ids[-1:] and again.lead[-1] == plan.repeat and not again.rest_blocks
    flat = [t for s in again.lead for t in s.token_ids] + list(again.rest)
    assert flat == [t for s in (prefix, doc, tail) for t in s.token_ids]


@pytest.mark.parametrize("n", [1, B - 1, B, B + 1])
def test_plan_of_short_prompts(n):
    plan = plan_prompt(raw(text_ids(4, n)), block_tokens=B)
    assert sum(len(s) for s in plan.lead) == (n - 1) // B * B and len(plan.rest) == n - (n - 1) // B * B
    assert (plan.repeat is None) == ((n - 1) % B == 0)


def test_split_blocks_keeps_the_salt_and_rejects_a_bad_size():
    seg = Segment(text_ids(5, 40), SegmentKind.TEXT, cacheable=True, salt="t")
    blocks = split_blocks(seg, B)
    assert [len(b) for b in blocks] == [B, B, 8] and all(b.salt == "t" for b in blocks)
    assert len({b.key for b in blocks} | {b.key for b in split_blocks(Segment(seg.token_ids, SegmentKind.TEXT, cacheable=True), B)}) == 6
    with pytest.raises(Exception, match="block_tokens"):
        split_blocks(seg, 0)


# ---- reuse through the engine ---------------------------------------------------------------------
@pytest.mark.parametrize("shared", [1, B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 5 * B + 3])
def test_unrelated_prompts_share_every_full_block_of_their_common_prefix(engine, shared):
    base = text_ids(10 + shared, shared)
    first = base + text_ids(100, 40)
    second = base + text_ids(200, 40)  # differs from the first right after `shared` tokens
    assert first[shared] != second[shared]
    engine.first_token_logits(raw(first))
    logits, cached = engine.first_token_logits(raw(second))
    assert cached == shared // B * B
    torch.testing.assert_close(logits, cold(engine, raw(second)), rtol=1e-4, atol=1e-4)
    assert_no_leak(engine)


@pytest.mark.parametrize("n", [1, 2, B - 1, B, B + 1, 3 * B])
def test_an_exact_repeat_reuses_all_but_the_last_token(engine, n):
    ids = text_ids(20 + n, n)
    _, cached = engine.first_token_logits(raw(ids))
    assert cached == 0
    logits, cached = engine.first_token_logits(raw(ids))
    assert cached == n - 1  # the full blocks and the shorter last block (kept on host for a repeat)
    torch.testing.assert_close(logits, cold(engine, raw(ids)), rtol=1e-4, atol=1e-4)
    assert_no_leak(engine)


def test_the_next_turn_reuses_the_prompt_and_the_answer(engine):
    """A chat's next prompt continues the last one with its answer: the answer's full blocks were
    kept when it finished (decode KV, fp32), so reuse runs past the earlier prompt."""
    turn1 = text_ids(30, 3 * B + 5)
    r1 = engine.generate_segments(raw(turn1), SamplingParams(max_tokens=2 * B + 3, temperature=0.0))
    answer = r1.token_ids
    assert len(answer) == 2 * B + 3
    turn2 = turn1 + answer + text_ids(31, 20)
    logits, cached = engine.first_token_logits(raw(turn2))
    fed = len(turn1) + len(answer) - 1  # tokens whose KV the first request wrote
    assert cached == fed // B * B > len(turn1)
    torch.testing.assert_close(logits, cold(engine, raw(turn2)), rtol=1e-4, atol=1e-4)
    assert_no_leak(engine)


def test_answers_are_kept_only_where_decode_kv_equals_prefill_kv(tiny_model, fixed_profile):
    e = make_engine(tiny_model, fixed_profile, block_reuse=False)
    turn1 = text_ids(32, 3 * B + 5)
    r1 = e.generate_segments(raw(turn1), SamplingParams(max_tokens=2 * B, temperature=0.0))
    _, cached = e.first_token_logits(raw(turn1 + r1.token_ids))
    assert cached == 0  # segment-level nodes only: a longer prompt is another segment


def test_block_and_document_nodes_interleave_on_one_path(engine):
    segs, _ = engine.segments_for("What is the GIL?", DOCS[:2], GREEDY)
    plan = engine.prompt_plan(segs)
    kinds = [s.kind for s in plan.lead]
    assert kinds.count(SegmentKind.DOCUMENT) == 2 and kinds[0] is SegmentKind.PREFIX
    assert all(len(s) <= B for s in plan.lead if s.kind is not SegmentKind.DOCUMENT)
    engine.first_token_logits(segs)
    path, node = [], engine.cache.tree.root
    for s in plan.lead:
        node = node.children[s.key]
        path.append(node)
    assert [n.num_tokens for n in path] == [len(s) for s in plan.lead]
    assert all(n.tokens == s.token_ids for n, s in zip(path, plan.lead))
    # another question after the same documents: every node up to the question reused
    other, _ = engine.segments_for("Why are tuples hashable?", DOCS[:2], GREEDY)
    logits, cached = engine.first_token_logits(other)
    docs_end = sum(len(s) for s in segs if s.kind is not SegmentKind.TAIL)
    assert cached >= docs_end
    torch.testing.assert_close(logits, cold(engine, other), rtol=1e-4, atol=1e-4)


def test_a_block_that_hashes_equal_but_holds_other_tokens_is_never_served(engine, monkeypatch):
    """Keys are hashes; a node is served only when its tokens equal the request's."""
    real = builder.segment_key
    monkeypatch.setattr(builder, "segment_key", lambda ids, salt="": real(tuple(ids)[:4], salt))  # collide
    first = text_ids(40, 3 * B)
    second = first[:4] + text_ids(41, 3 * B - 4)  # same first 4 tokens: every block key collides
    engine.first_token_logits(raw(first))
    logits, cached = engine.first_token_logits(raw(second))
    assert cached == 0
    torch.testing.assert_close(logits, cold(engine, raw(second)), rtol=1e-4, atol=1e-4)
    logits, cached = engine.first_token_logits(raw(first))  # the first prompt's nodes are intact
    assert cached == len(first) - 1
    assert_no_leak(engine)


def test_salts_isolate_block_nodes(engine):
    ids = text_ids(50, 4 * B)
    a1 = engine.generate_segments(raw(ids), GREEDY, cache_salt="a")
    b1 = engine.generate_segments(raw(ids), GREEDY, cache_salt="b")
    a2 = engine.generate_segments(raw(ids), GREEDY, cache_salt="a")
    plain = engine.generate_segments(raw(ids), GREEDY)
    assert (a1.cached_tokens, b1.cached_tokens, plain.cached_tokens) == (0, 0, 0)
    assert a2.cached_tokens == len(ids) - 1
    first_level = engine.cache.tree.root.children.values()
    assert len(first_level) == 3  # one first block per salt (and none shared)


def test_eviction_never_leaves_a_block_without_its_parent(tiny_model, fixed_profile):
    e = make_engine(tiny_model, fixed_profile, device_budget_bytes=96 * 1024, host_budget_bytes=64 * 1024)
    shared = text_ids(60, 2 * B)
    for i in range(12):  # more blocks than both tiers hold: evictions in both
        ids = shared + text_ids(61 + i, 3 * B + i)
        e.generate_segments(raw(ids), SamplingParams(max_tokens=B, temperature=0.0))
        e.cache.check_invariants()
        for node in e.cache.tree:
            assert node.parent is not None and (node.parent.is_root or node.parent.resident or not node.resident)
    assert e.cache.stats.device_evictions > 0
    logits, cached = e.first_token_logits(raw(shared + text_ids(99, 10)))
    torch.testing.assert_close(logits, cold(e, raw(shared + text_ids(99, 10))), rtol=1e-4, atol=1e-4)
    assert_no_leak(e)


def test_a_disk_file_whose_tokens_differ_is_never_served(tiny_model, fixed_profile, tmp_path):
    """A file of the right name, checksum and shape whose recorded tokens differ (a colliding key, a
    foreign writer) is not read back: the match stops before it."""
    ids = text_ids(70, 3 * B)
    with make_engine(tiny_model, fixed_profile, disk_dir=tmp_path) as e:
        e.first_token_logits(raw(ids))
        assert e.cache.disk.flush(30)
        folder = e.cache.disk.directory
        first_block = e.cache.tree.root.children[split_blocks(raw(ids)[0], B)[0].key]
        target = folder / f"{first_block.path_key}.kv.safetensors"
    meta = read_metadata(target)
    tensors = st_load(target.read_bytes())
    k, v = tensors["k"], tensors["v"]
    fmt = KVFileFormat(meta["fingerprint"], (k.shape[0], k.shape[2], k.shape[3]), k.dtype)
    wrong = tuple(t + 1 for t in ids[:B])
    header = FileHeader(meta["path_key"], meta["parent"], meta["key"], B, 1, 0.0, None, wrong)
    target.write_bytes(fmt.encode(header, k, v))  # a well-formed file with other tokens
    with make_engine(tiny_model, fixed_profile, disk_dir=tmp_path) as e:
        logits, cached = e.first_token_logits(raw(ids))
        assert cached == 0 and e.cache.stats.disk_hits == 0
        torch.testing.assert_close(logits, cold(e, raw(ids)), rtol=1e-4, atol=1e-4)
