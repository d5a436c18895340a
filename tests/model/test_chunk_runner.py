"""The runner's chunk-cache path on a random tiny Llama (fp32): tokens at any positions, RoPE
re-rotation of a moved chunk, attention statistics and the KV deviation (Cache-Craft §3)."""

from __future__ import annotations

import copy

import pytest
import torch

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.runner import ForwardInput, KVRun, ModelRunner


@pytest.fixture()
def runner(tiny_model) -> ModelRunner:
    return ModelRunner(tiny_model, num_device_blocks=256, block_size=16)


def _toks(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(10, 40000, (n,), generator=g).tolist())


class Blocks:
    """Hands out fresh block ranges."""

    def __init__(self) -> None:
        self.next = 0

    def run(self, n: int) -> KVRun:
        count = -(-n // 16)
        run = KVRun(tuple(range(self.next, self.next + count)), 0, n)
        self.next += count
        return run


def _prefill(runner, runs_and_tokens, **kw):
    """Cold prefill of consecutive segments into their runs; returns the last-token logits."""
    toks = tuple(t for _, ts in runs_and_tokens for t in ts)
    # a cold prefill of several segments: the first run is the target of all tokens' KV only if
    # there is one segment, so write segment by segment over the growing context
    cached: list[KVRun] = []
    out = None
    for run, ts in runs_and_tokens:
        out = runner.forward([ForwardInput(ts, tuple(cached), (run,))], **kw)[0]
        cached.append(run)
    assert out is not None and toks
    return out


def test_tokens_at_explicit_positions_equal_an_ordinary_prefill(runner):
    b = Blocks()
    prefix, rest = _toks(40, 1), _toks(25, 2)
    p1, r1 = b.run(40), b.run(25)
    ref = _prefill(runner, [(p1, prefix), (r1, rest)])
    p2, r2 = b.run(40), b.run(25)
    runner.forward([ForwardInput(prefix, (), (p2,))])
    pos = tuple(range(40, 65))
    out = runner.forward([ForwardInput(rest, (p2, r2), (), positions=pos)])[0]
    assert (out - ref).abs().max().item() < 1e-5


def test_rerotated_keys_equal_keys_computed_at_the_new_position(runner):
    """Layer 0's K and V depend only on the token and its position, so a chunk computed at
    position 7 and moved to 50 must equal the same chunk computed at 50 (fp32, 1e-4)."""
    b = Blocks()
    chunk = _toks(30, 3)
    a_prefix, b_prefix = _toks(7, 4), _toks(50, 5)
    pa, ca = b.run(7), b.run(30)
    _prefill(runner, [(pa, a_prefix), (ca, chunk)])
    pb, cb = b.run(50), b.run(30)
    _prefill(runner, [(pb, b_prefix), (cb, chunk)])
    moved = b.run(30)
    runner.copy_rerotated(ca, moved, 50 - 7)
    sl_m, sl_b, sl_a = runner.slots([moved]), runner.slots([cb]), runner.slots([ca])
    assert (runner.k_cache[0, sl_m] - runner.k_cache[0, sl_b]).abs().max().item() < 1e-4
    assert torch.equal(runner.v_cache[0, sl_m], runner.v_cache[0, sl_a])
    assert (runner.k_cache[0, sl_a] - runner.k_cache[0, sl_b]).abs().max().item() > 1e-2  # the move mattered


def test_recomputing_every_token_of_moved_chunks_equals_full_recomputation(runner):
    """Recompute share 1: chunks reused from another context and position, every token recomputed
    over the merged context, give the cold prompt's logits (fp32)."""
    b = Blocks()
    sys_, c1, c2, q = _toks(20, 6), _toks(33, 7), _toks(41, 8), _toks(9, 9)
    ref = _prefill(runner, [(b.run(20), sys_), (b.run(33), c1), (b.run(41), c2), (b.run(9), q)])
    # variants computed elsewhere: c2 after another document, c1 first
    other = _toks(17, 10)
    ov, v2 = b.run(20 + 17), b.run(41)
    _prefill(runner, [(ov, sys_ + other), (v2, c2)])
    sv, v1 = b.run(20), b.run(33)
    _prefill(runner, [(sv, sys_), (v1, c1)])
    r1, r2, rq = b.run(33), b.run(41), b.run(9)
    runner.copy_rerotated(v1, r1, 0)
    runner.copy_rerotated(v2, r2, (20 + 33) - (20 + 17))
    new = c1 + c2 + q
    pos = tuple(range(20, 20 + 33 + 41 + 9))
    out = runner.forward([ForwardInput(new, (sv, r1, r2, rq), (), positions=pos)])[0]
    assert (out - ref).abs().max().item() < 1e-4
    # without recomputation the moved chunk gives other logits (the test is not vacuous)
    r2b, rqb = b.run(41), b.run(9)
    runner.copy_rerotated(v2, r2b, (20 + 33) - (20 + 17))
    approx = runner.forward([ForwardInput(q, (sv, v1, r2b), (rqb,))])[0]
    assert (approx - ref).abs().max().item() > 1e-3


def _eager_attentions(tiny_model, tokens: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The model's own attention weights, one ``[1, Hq, T, T]`` per layer, from an eager copy of
    it (the session's shared model keeps its attention implementation)."""
    model = copy.deepcopy(tiny_model.model)
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=tiny_model.device), output_attentions=True).attentions


def test_attention_statistics_match_the_models_own_attention_weights(runner, tiny_model):
    b = Blocks()
    sys_, c1, c2 = _toks(12, 11), _toks(20, 12), _toks(15, 13)
    ps, p1 = b.run(12), b.run(20)
    _prefill(runner, [(ps, sys_), (p1, c1)])
    p2 = b.run(15)
    step = runner.forward_step([ForwardInput(c2, (ps, p1), (p2,), stat_segments=(12, 20, 15))])
    mass = torch.tensor(step.attention[0].mass)  # [15, 3]
    assert mass.shape == (15, 3) and torch.allclose(mass.sum(1), torch.ones(15), atol=1e-5)
    att = _eager_attentions(tiny_model, sys_ + c1 + c2)
    # mean over layers and over the first query head of each KV group (heads 0 and 2 of 4)
    probs = torch.stack(att)[:, 0, ::2, 32:, :].mean(dim=(0, 1))  # [15 rows, 47 keys]
    ref = torch.stack([probs[:, :12].sum(1), probs[:, 12:32].sum(1), probs[:, 32:].sum(1)], dim=1).cpu()
    assert (mass - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_the_last_rows_attention_to_guard_segments_matches_the_models_own_weights(runner, tiny_model, monkeypatch, kernel):
    """``guard_segments``: the last new token's attention mass per segment, averaged over every
    layer and one query head per KV group, as the model's own attention weights give it (and as
    the statistics give it for that row), from the native kernel or the torch reference."""
    from ragcache_backend.model.kernels import chunk_stats

    if kernel == "torch":
        monkeypatch.setattr(chunk_stats, "segment_mass_available", lambda q, k: False)
    b = Blocks()
    sys_, c1, c2 = _toks(12, 11), _toks(20, 12), _toks(15, 13)
    ps, p1 = b.run(12), b.run(20)
    _prefill(runner, [(ps, sys_), (p1, c1)])
    step = runner.forward_step([ForwardInput(c2, (ps, p1), (b.run(15),), stat_segments=(12, 20, 15),
                                             guard_segments=(12, 20, 15))])
    last = torch.tensor(step.last_mass[0])
    assert last.shape == (3,) and abs(last.sum().item() - 1) < 1e-5
    assert (last - torch.tensor(step.attention[0].mass[-1])).abs().max().item() < 1e-5
    att = _eager_attentions(tiny_model, sys_ + c1 + c2)
    probs = torch.stack(att)[:, 0, ::2, -1, :].mean(dim=(0, 1)).cpu()  # the last row, [47 keys]
    ref = torch.stack([probs[:12].sum(), probs[12:32].sum(), probs[32:].sum()])
    assert (last - ref).abs().max().item() < 1e-4
    plain = runner.forward_step([ForwardInput(c2, (ps, p1), (b.run(15),))])
    assert plain.last_mass == [None]
    with pytest.raises(InvalidRequestError):
        runner.forward_step([ForwardInput(c2, (ps, p1), (b.run(15),), guard_segments=(12, 20))])  # does not cover
    with pytest.raises(InvalidRequestError):
        runner.forward_step([ForwardInput(c2, (ps, p1), (b.run(15),), guard_segments=(12, 0, 20, 15))])  # empty one
    with pytest.raises(InvalidRequestError):
        runner.forward_step([ForwardInput(c2, (ps, p1), (b.run(15),), guard_segments=())])  # none at all


def test_deviation_is_zero_when_nothing_moved_and_positive_when_the_context_changed(runner):
    b = Blocks()
    sys_, c1, c2 = _toks(16, 14), _toks(30, 15), _toks(30, 16)
    ps, p1, p2 = b.run(16), b.run(30), b.run(30)
    _prefill(runner, [(ps, sys_), (p1, c1), (p2, c2)])
    # recompute tokens 5, 9 and 20 of c2 in its own context: same KV
    picks = (5, 9, 20)
    pos = tuple(16 + 30 + i for i in picks)
    same = runner.forward_step([ForwardInput(tuple(c2[i] for i in picks), (ps, p1, p2), (), positions=pos, guard=True)])
    assert max(same.deviation[0]) < 1e-5
    # c2's KV computed after another document, moved next to c1: recomputation moves it
    other = _toks(30, 17)
    po, v2 = b.run(16 + 30), b.run(30)
    _prefill(runner, [(po, sys_ + other), (v2, c2)])
    r2 = b.run(30)
    runner.copy_rerotated(v2, r2, 0)
    moved = runner.forward_step([ForwardInput(tuple(c2[i] for i in picks), (ps, p1, r2), (), positions=pos, guard=True)])
    assert min(moved.deviation[0]) > 1e-3


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_deviation_from_the_native_kernel_equals_the_reference_form(runner, monkeypatch, kernel):
    """The guard's deviation (relative L2 of the recomputed rows' K/V against what the slots held,
    summed over layers) from ``chunk_stats.kv_deviation`` equals the torch form's, on rows whose
    context moved; with the kernel off, the torch form runs (and the kernel is not called)."""
    from ragcache_backend.model.kernels import chunk_stats

    if kernel == "native" and not chunk_stats.kv_deviation_available(runner.k_cache[0]):
        pytest.skip("no native deviation kernel for this runner's arena here")
    calls = []
    real = chunk_stats.kv_deviation
    monkeypatch.setattr(chunk_stats, "kv_deviation", lambda *a: calls.append(1) or real(*a))

    def measure(native: bool) -> torch.Tensor:
        b = Blocks()
        sys_, c1, c2, other = _toks(16, 14), _toks(30, 15), _toks(30, 16), _toks(30, 17)
        ps, p1, po, v2 = b.run(16), b.run(30), b.run(16 + 30), b.run(30)
        _prefill(runner, [(ps, sys_), (p1, c1), (po, sys_ + other), (v2, c2)])
        r2 = b.run(30)
        runner.copy_rerotated(v2, r2, 0)
        picks = (0, 5, 9, 20, 29)
        with monkeypatch.context() as m:
            if not native:
                m.setattr(chunk_stats, "kv_deviation_available", lambda k: False)
            step = runner.forward_step([ForwardInput(tuple(c2[i] for i in picks), (ps, p1, r2), (),
                                                     positions=tuple(46 + i for i in picks), guard=True)])
        return torch.tensor(step.deviation[0])

    got = measure(kernel == "native")
    assert bool(calls) == (kernel == "native")
    calls.clear()
    ref = measure(False)
    assert not calls and got.shape == (5,) and min(got) > 1e-3
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_bad_positions_and_segments_are_rejected(runner):
    b = Blocks()
    ctx = b.run(20)
    with pytest.raises(InvalidRequestError):
        runner.forward([ForwardInput(_toks(2, 1), (ctx,), (), positions=(5, 3))])
    with pytest.raises(InvalidRequestError):
        runner.forward([ForwardInput(_toks(1, 1), (ctx,), (), positions=(20,))])
    with pytest.raises(InvalidRequestError):
        runner.forward([ForwardInput(_toks(1, 1), (ctx,), (b.run(1),), positions=(19,))])
    with pytest.raises(InvalidRequestError):
        runner.forward_step([ForwardInput(_toks(3, 1), (ctx,), (b.run(3),), stat_segments=(10, 10))])
    with pytest.raises(InvalidRequestError):
        runner.copy_rerotated(b.run(5), b.run(6), 3)


def _moved_chunks(runner, b):
    """sys, c1, c2, q where c1 and c2 are variants computed elsewhere and moved in (no recompute yet)."""
    sys_, c1, c2, q = _toks(20, 6), _toks(33, 7), _toks(41, 8), _toks(9, 9)
    ref = _prefill(runner, [(b.run(20), sys_), (b.run(33), c1), (b.run(41), c2), (b.run(9), q)])
    other = _toks(17, 10)
    ov, v2 = b.run(20 + 17), b.run(41)
    _prefill(runner, [(ov, sys_ + other), (v2, c2)])
    sv, v1 = b.run(20), b.run(33)
    _prefill(runner, [(sv, sys_), (v1, c1)])
    r1, r2, rq = b.run(33), b.run(41), b.run(9)
    runner.copy_rerotated(v1, r1, 0)
    runner.copy_rerotated(v2, r2, (20 + 33) - (20 + 17))
    return ref, (sv, r1, r2, rq), c1 + c2 + q, tuple(range(20, 20 + 33 + 41 + 9))


def test_blend_selection_keeps_the_most_deviating_rows_after_its_layer(runner):
    from ragcache_backend.model.chunk_rows import BlendSelection

    b = Blocks()
    ref, ctx, new, pos = _moved_chunks(runner, b)
    groups = (tuple(range(33)), tuple(range(33, 74)))
    full = runner.forward_step([ForwardInput(new, ctx, (), positions=pos, blend=BlendSelection(groups, share=1.0))])
    assert set(full.depth[0]) == {2} and (full.logits[0] - ref).abs().max().item() < 1e-4  # share 1: exact
    r2_slots = runner.slots([ctx[2]])
    before = runner.k_cache[1, r2_slots].clone()
    part = runner.forward_step([ForwardInput(new, ctx, (), positions=pos, guard=True,
                                             blend=BlendSelection(groups, share=0.25, layer=0))])
    stopped = [r for r, d in enumerate(part.depth[0]) if d < 2]
    assert len(stopped) == (33 - 8) + (41 - 10) and all(r < 74 for r in stopped)  # round(0.25 n) kept per group
    assert {part.depth[0][r] for r in stopped} == {1}
    # a stopped row of c2 kept the values of layer 1 written by the full pass (not recomputed again)
    row = next(r for r in stopped if r >= 33) - 33
    assert torch.equal(runner.k_cache[1, r2_slots[row]], before[row])
    assert all(part.deviation[0][r] >= 0 for r in range(74))


def test_focus_selection_stops_unfocused_chunks_once_algorithm1_decides(runner):
    from ragcache_backend.model.chunk_rows import FocusSelection

    b = Blocks()
    ref, ctx, new, pos = _moved_chunks(runner, b)
    chunks = ((20, 53), (53, 94))
    groups = (tuple(range(0, 33, 2)), tuple(range(33, 74, 2)))
    question = tuple(range(74, 83))
    out = runner.forward_step([ForwardInput(new, ctx, (), positions=pos,
                                            focus=FocusSelection(chunks, groups, question, window=1))])
    # two chunks: Algorithm 1 keeps both (fewer than three), decided after the first layer; nothing stops
    assert out.focus_layer[0] == 1 and set(out.depth[0]) == {2}
    three = ((20, 40), (40, 53), (53, 94))
    groups3 = (tuple(range(0, 20, 2)), tuple(range(20, 33, 2)), tuple(range(33, 74, 2)))
    out3 = runner.forward_step([ForwardInput(new, ctx, (), positions=pos,
                                             focus=FocusSelection(three, groups3, question, window=1))])
    assert out3.focus_layer[0] == 1
    stopped3 = {r for r, d in enumerate(out3.depth[0]) if d < 2}
    kept_groups = {i for i, g in enumerate(groups3) if not set(g) & stopped3}
    assert kept_groups and len(kept_groups) < 3  # some chunk was unfocused and stopped
    with pytest.raises(InvalidRequestError):
        runner.forward_step([ForwardInput(new, ctx, (), positions=pos,
                                          focus=FocusSelection(chunks, ((82,), ()), question, window=1))])


def test_statistics_layers_are_spread_over_the_whole_depth(runner):
    n = runner.num_layers
    runner.sample_stat_layers(n + 4)  # more than there are: every layer, the last one included
    assert runner.stat_layers == frozenset(range(n))
    runner.sample_stat_layers(2)
    assert runner.stat_layers == frozenset({0, n - 1})
    runner.sample_stat_layers(1)
    assert runner.stat_layers == frozenset({0})


# ---- explicit positions on the native float32 kernel -------------------------------------------------

def _native_positions(runner) -> bool:
    return runner.layers.native_positions


def _scattered_recompute(new, pos, share: float, seed: int):
    """Every ``1/share``-th-ish token of the two moved chunks (rows 0..73 of ``new``), plus the question."""
    g = torch.Generator().manual_seed(seed)
    rows = sorted(r for r in range(74) if torch.rand((), generator=g).item() < share) + list(range(74, 83))
    return tuple(new[r] for r in rows), tuple(pos[r] for r in rows), rows


def _with_positions_on(runner, on: bool, *items, **kw):
    saved = runner.layers.native_positions
    runner.layers.native_positions = on
    try:
        return runner.forward_step(list(items), **kw)
    finally:
        runner.layers.native_positions = saved


def _count_masked_attention(monkeypatch):
    """Count the masked torch attention calls of the chunk rows (explicit positions off the kernel)."""
    import ragcache_backend.model.llama as llama

    calls = []
    real = llama.attention

    def counted(*args, **kw):
        calls.append(kw.get("mask") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(llama, "attention", counted)
    return calls


@pytest.mark.parametrize("share", [0.15, 0.5])
def test_explicit_positions_on_the_native_kernel_equal_the_torch_path(runner, monkeypatch, share):
    """A chunk-reuse step with recomputed tokens at scattered positions: the native kernel and the
    masked torch attention give the same logits (every row), statistics and deviation."""
    if not _native_positions(runner):
        pytest.skip("float32 native kernels unavailable here")
    b = Blocks()
    _, ctx, new, pos = _moved_chunks(runner, b)
    _, ctx2, _, _ = _moved_chunks(runner, b)  # the same moved KV again: each path overwrites its own copy
    toks, where, _ = _scattered_recompute(new, pos, share, seed=int(share * 100))
    kw = dict(stat_segments=(20, 33, 41, 9), guard=True)
    calls = _count_masked_attention(monkeypatch)
    fast = _with_positions_on(runner, True, ForwardInput(toks, ctx, (), positions=where, **kw), all_logits=True)
    assert not any(calls)  # no masked torch attention: the kernel served the explicit rows
    slow = _with_positions_on(runner, False, ForwardInput(toks, ctx2, (), positions=where, **kw), all_logits=True)
    assert any(calls)
    assert fast.logits[0].shape == (len(toks), runner.vocab_size)
    assert (fast.logits[0] - slow.logits[0]).abs().max().item() < 1e-4
    assert torch.allclose(torch.tensor(fast.attention[0].mass), torch.tensor(slow.attention[0].mass), atol=1e-5)
    assert max(fast.deviation[0]) > 1e-3  # the moved chunk's recomputed KV did move
    assert torch.allclose(torch.tensor(fast.deviation[0]), torch.tensor(slow.deviation[0]), atol=1e-5)


def test_recomputing_every_token_on_the_native_kernel_equals_full_recomputation(runner, monkeypatch):
    if not _native_positions(runner):
        pytest.skip("float32 native kernels unavailable here")
    b = Blocks()
    ref, ctx, new, pos = _moved_chunks(runner, b)
    calls = _count_masked_attention(monkeypatch)
    out = runner.forward([ForwardInput(new, ctx, (), positions=pos)])[0]
    assert not any(calls) and (out - ref).abs().max().item() < 1e-4


def test_explicit_positions_next_to_ordinary_sequences_in_one_native_step(runner):
    """One step with an ordinary prompt, a decode row and a recompute at explicit positions: each
    sequence's logits are those it has alone."""
    if not _native_positions(runner):
        pytest.skip("float32 native kernels unavailable here")
    b = Blocks()
    _, ctx, new, pos = _moved_chunks(runner, b)
    toks, where, _ = _scattered_recompute(new, pos, 0.3, seed=5)
    pa, ta = b.run(30), b.run(12)
    runner.forward([ForwardInput(_toks(30, 20), (), (pa,))])
    pd, td = b.run(50), b.run(1)
    runner.forward([ForwardInput(_toks(50, 21), (), (pd,))])
    items = [ForwardInput(_toks(12, 22), (pa,), (ta,)), ForwardInput(toks, ctx, (), positions=where),
             ForwardInput(_toks(1, 23), (pd,), (td,), decode=True)]
    together = runner.forward(items)
    for item, out in zip(items, together):
        alone = runner.forward([item])[0]
        assert (alone - out).abs().max().item() < 1e-5


def test_rows_that_stop_part_way_rebuild_the_native_batch(runner):
    """Blend and focus selections drop rows between layers; the kernel's batch is rebuilt with the
    remaining positions and matches the torch path (depths, logits)."""
    from ragcache_backend.model.chunk_rows import BlendSelection, FocusSelection

    if not _native_positions(runner):
        pytest.skip("float32 native kernels unavailable here")
    b = Blocks()
    groups = (tuple(range(33)), tuple(range(33, 74)))
    three = ((20, 40), (40, 53), (53, 94))
    groups3 = (tuple(range(0, 20, 2)), tuple(range(20, 33, 2)), tuple(range(33, 74, 2)))
    for extra in (dict(blend=BlendSelection(groups, share=0.25, layer=0)),
                  dict(focus=FocusSelection(three, groups3, tuple(range(74, 83)), window=1))):
        _, ctx, new, pos = _moved_chunks(runner, b)
        fast = _with_positions_on(runner, True, ForwardInput(new, ctx, (), positions=pos, guard=True, **extra))
        _, ctx, new, pos = _moved_chunks(runner, b)  # a fresh copy: the deviation the blend ranks by is measured again
        slow = _with_positions_on(runner, False, ForwardInput(new, ctx, (), positions=pos, guard=True, **extra))
        assert fast.depth[0] == slow.depth[0] and min(fast.depth[0]) < runner.num_layers  # some rows stopped
        assert (fast.logits[0] - slow.logits[0]).abs().max().item() < 1e-4


def test_native_positions_can_be_turned_off_but_not_on_without_the_kernel(tiny_model, monkeypatch):
    runner = ModelRunner(tiny_model, num_device_blocks=16, block_size=16)
    runner.layers.native_positions = False
    assert not runner.layers.native_positions
    monkeypatch.setattr(runner.layers, "native_attention", False)
    with pytest.raises(ValueError):
        runner.layers.native_positions = True


def test_statistics_from_the_native_kernel_equal_the_torch_reference(runner, monkeypatch):
    """The statistics of a fresh prefill over a cached prefix and of recomputed rows at scattered
    positions come from the float32 kernel (keys read in place; the torch reference is not called)
    and equal the reference's."""
    import ragcache_backend.model.chunk_rows as chunk_rows
    from ragcache_backend.model.kernels import chunk_stats

    if not runner.layers.native_attention or not chunk_stats.segment_mass_available(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64)):
        pytest.skip("float32 native kernels unavailable here (or the runner is on another device)")
    b = Blocks()
    _, ctx, new, pos = _moved_chunks(runner, b)
    toks, where, _ = _scattered_recompute(new, pos, 0.3, seed=5)
    sys_, c1 = _toks(20, 21), _toks(33, 22)
    ps = b.run(20)
    _prefill(runner, [(ps, sys_)])
    p1 = b.run(33)
    steps = {
        "suffix": lambda: runner.forward_step([ForwardInput(c1, (ps,), (p1,), stat_segments=(20, 33))]),
        "explicit": lambda: runner.forward_step([ForwardInput(toks, ctx, (), positions=where,
                                                              stat_segments=(20, 33, 41, 9))]),
    }
    real, calls = chunk_rows.segment_attention_mass, []

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(chunk_rows, "segment_attention_mass", counted)
    for name, step in steps.items():
        calls.clear()
        fast = torch.tensor(step().attention[0].mass)
        assert not calls, name
        monkeypatch.setattr(chunk_stats, "segment_mass_available", lambda q, k: False)
        slow = torch.tensor(step().attention[0].mass)
        monkeypatch.undo()
        monkeypatch.setattr(chunk_rows, "segment_attention_mass", counted)
        assert calls, name
        assert torch.allclose(fast.sum(1), torch.ones(fast.shape[0]), atol=1e-5)
        assert (fast - slow).abs().max().item() < 1e-5, name
