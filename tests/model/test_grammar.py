"""Constrained decoding over the real tokenizer: every kind of grammar holds greedy decoding of
random logits to a valid output, and bad grammars are refused with the library's message."""

from __future__ import annotations

import json

import pytest
import torch
from jsonschema import validate

from ragcache_backend.model.grammar import Grammar, GrammarCompiler, GrammarError
from ragcache_backend.model.sampling import SamplingParams, choose_token


@pytest.fixture(scope="module")
def compiler(real_model):
    tok = real_model.tokenizer
    return GrammarCompiler(tok, [tok.eos_token_id], len(tok)), tok


def run(compiler, grammar: Grammar, seed: int, limit: int = 200) -> str:
    comp, tok = compiler
    matcher = comp.matcher(grammar)
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(limit):
        logits = torch.randn(len(tok), generator=gen)
        token = choose_token(logits, SamplingParams(), None, allowed=matcher.allowed(len(tok))).token
        if token == tok.eos_token_id:
            break
        matcher.advance(token)
        ids.append(token)
        if matcher.done:
            break
    assert matcher.accepting
    return tok.decode(ids)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "kind": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "kind"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(compiler, seed):
    text = run(compiler, Grammar.json_schema(SCHEMA, whitespace="" if seed % 2 else r"[ \n]{0,4}"), seed)
    validate(json.loads(text), SCHEMA)


def test_choice_regex_and_lark(compiler):
    assert run(compiler, Grammar.choice(["yes", "no", "maybe"]), 0) in {"yes", "no", "maybe"}
    assert len(run(compiler, Grammar.regex(r"[0-9]{3}-[a-z]{2}"), 1)) == 6
    assert run(compiler, Grammar.lark('start: "A" | "B"'), 2) in {"A", "B"}


@pytest.mark.parametrize("grammar", [
    Grammar("json_schema", '{"type": "objec"}'), Grammar.regex("(("), Grammar.lark("start: ???"),
])
def test_bad_grammars_are_refused_with_the_reason(compiler, grammar):
    with pytest.raises(GrammarError, match="cannot be compiled"):
        compiler[0].matcher(grammar)


def test_bad_schema_text_and_choices():
    with pytest.raises(GrammarError, match="not JSON"):
        Grammar.json_schema("{nope")
    with pytest.raises(GrammarError):
        Grammar.json_schema("[1, 2]")
    with pytest.raises(GrammarError):
        Grammar.choice([])


def test_a_token_the_grammar_refuses_raises(compiler):
    comp, tok = compiler
    matcher = comp.matcher(Grammar.choice(["yes"]))
    with pytest.raises(GrammarError):
        matcher.advance(tok.encode("no", add_special_tokens=False)[0])
