"""Sampling: every parameter's effect on a known logits row (vLLM's order and semantics), the
ranges refused, and the log-probabilities returned."""

from __future__ import annotations

import math

import pytest
import torch

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.loader import default_device
from ragcache_backend.model.sampling import SamplingParams, choose_token

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])


def draws(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = 3000, **kw) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {choose_token(logits, params, gen, **kw).token for _ in range(n)}


def test_greedy_is_argmax_and_asks_nothing_more():
    choice = choose_token(LOGITS, SamplingParams(), None)
    assert choice.token == 0 and choice.logprob is None and choice.top == ()


def test_top_k_min_p_top_p_cut_the_tail():
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    # p = softmax: [0.61, 0.22, 0.14, 0.03, 0.004]; min_p 0.3 keeps p >= 0.18
    assert draws(SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.7)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_k=-1)) == {0, 1, 2, 3, 4}


def test_penalties_follow_vllm():
    # repetition: positive logits divided, negative multiplied, prompt and output both count
    c = choose_token(LOGITS, SamplingParams(repetition_penalty=4.0, logprobs=0), None, prompt_ids=[0], generated=[3])
    assert c.token == 1  # 2.0 / 4 = 0.5 < 1.0
    # frequency: once per occurrence; presence: once
    assert choose_token(LOGITS, SamplingParams(frequency_penalty=0.6), None, generated=[0, 0]).token == 1
    assert choose_token(LOGITS, SamplingParams(frequency_penalty=0.6), None, generated=[0]).token == 0
    assert choose_token(LOGITS, SamplingParams(presence_penalty=1.5), None, generated=[0, 0, 0]).token == 1
    assert choose_token(LOGITS, SamplingParams(presence_penalty=-2.0), None, generated=[4]).token == 0
    assert choose_token(LOGITS, SamplingParams(logit_bias={4: 100}), None).token == 4
    assert choose_token(LOGITS, SamplingParams(logit_bias={0: -100}), None).token == 1


def test_logprobs_are_the_models_own_and_sorted():
    c = choose_token(LOGITS, SamplingParams(logprobs=3, logit_bias={4: 100}), None)
    expect = torch.log_softmax(LOGITS, -1)
    assert c.token == 4 and math.isclose(c.logprob, float(expect[4]), rel_tol=1e-6)  # raw, before the bias
    assert [t.token for t in c.top] == [0, 1, 2]
    assert all(a.logprob >= b.logprob for a, b in zip(c.top, c.top[1:]))


def test_a_grammar_mask_limits_the_choice():
    allowed = torch.tensor([False, False, True, True, False])
    assert choose_token(LOGITS, SamplingParams(), None, allowed=allowed).token == 2
    assert draws(SamplingParams(temperature=1.0), allowed=allowed) == {2, 3}


@pytest.mark.parametrize("params", [
    SamplingParams(logit_bias={4: 100}),
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
    SamplingParams(logprobs=3),
    SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05, seed=5),
])
@pytest.mark.parametrize("with_mask", [False, True])
def test_every_parameter_on_the_engines_device_chooses_as_on_the_cpu(params, with_mask):
    """The engine's logits live on its device (``cuda`` where one is visible: the GPU check runs this
    there) while the grammar's mask, the history and the seeded generator are the CPU's."""
    allowed = torch.tensor([False, True, True, True, True]) if with_mask else None
    kw = {"prompt_ids": [0, 1], "generated": [1, 1, 2], "allowed": allowed}
    on_cpu = choose_token(LOGITS, params, torch.Generator().manual_seed(5), **kw)
    on_device = choose_token(LOGITS.to(default_device()), params, torch.Generator().manual_seed(5), **kw)
    assert on_device.token == on_cpu.token
    if params.logprobs:
        assert math.isclose(on_device.logprob, on_cpu.logprob, rel_tol=1e-5)
        assert [t.token for t in on_device.top] == [t.token for t in on_cpu.top]


def test_seeded_draws_repeat():
    p = SamplingParams(temperature=1.5, seed=3)
    a = [choose_token(LOGITS, p, torch.Generator().manual_seed(3)).token for _ in range(20)]
    b = [choose_token(LOGITS, p, torch.Generator().manual_seed(3)).token for _ in range(20)]
    assert a == b


@pytest.mark.parametrize("kw", [
    {"top_k": -2}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"repetition_penalty": float("inf")},
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logprobs": 21}, {"logprobs": -1},
    {"logit_bias": {-1: 1.0}}, {"logit_bias": {"5": 1.0}}, {"logit_bias": {5: 101}}, {"temperature": float("nan")},
    {"seed": 1 << 64}, {"seed": -(1 << 63) - 1},
])
def test_out_of_range_values_are_refused(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_logit_bias_is_stored_as_sorted_pairs():
    assert SamplingParams(logit_bias={9: 1, 2: -1.5}).logit_bias == ((2, -1.5), (9, 1.0))
