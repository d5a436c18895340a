"""Tool calling's text side: definitions checked, choices checked, calls rendered and parsed back,
and the forcing grammar accepting exactly the Hermes call format."""

from __future__ import annotations

import json

import pytest

from ragcache_backend.model.grammar import GrammarCompiler
from ragcache_backend.prompts.tools import (
    ToolChoice,
    ToolError,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    render_tool_calls,
    tool_grammar,
    tool_instructions,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tools_are_parsed_and_offered():
    tools = parse_tools([WEATHER, TIME])
    assert [t.name for t in tools] == ["get_weather", "get_time"]
    assert tools[1].schema == {"type": "object", "properties": {}}
    text = tool_instructions(tools)
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text


@pytest.mark.parametrize("spec", [
    {"type": "retrieval"}, {"type": "function"}, {"type": "function", "function": {"name": "bad name"}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
    {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"minimum": "x"}}}}},
])
def test_bad_tools_are_refused(spec):
    with pytest.raises(ToolError):
        parse_tools([spec])


def test_a_tool_defined_twice_is_refused():
    with pytest.raises(ToolError, match="twice"):
        parse_tools([TIME, TIME])


def test_tool_choice():
    tools = parse_tools([WEATHER, TIME])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools) == ToolChoice("function", "get_time")
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}):
        with pytest.raises(ToolError):
            parse_tool_choice(bad, tools)
    with pytest.raises(ToolError):
        parse_tool_choice("required", ())


def test_calls_round_trip_through_text():
    tools = parse_tools([WEATHER, TIME])
    text = render_tool_calls([{"id": "1", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    parsed = parse_tool_calls("Let me check.\n" + text, tools)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Oslo"})]
    assert parsed.calls[0].id.startswith("call_")


def test_unreadable_calls_stay_text():
    tools = parse_tools([WEATHER])
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"name": "other", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "get_weather", "arguments": 3}</tool_call>', "no call at all"):
        parsed = parse_tool_calls(text, tools)
        assert parsed.calls == () and parsed.content == text
    with pytest.raises(ToolError):
        render_tool_calls([{"function": {"name": "f", "arguments": "[1]"}}])


def test_forcing_grammar_accepts_calls_and_nothing_else(real_model):
    tok = real_model.tokenizer
    tools = parse_tools([WEATHER, TIME])
    assert tool_grammar(tools, ToolChoice("auto")) is None
    compiler = GrammarCompiler(tok, [tok.eos_token_id], len(tok))
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    two = good + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    cases = [(ToolChoice("required"), good, True), (ToolChoice("required"), two, False),
             (ToolChoice("function", "get_time"), good, False),
             (ToolChoice("required"), '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n', False),
             (ToolChoice("required"), '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>\n', False)]
    for choice, text, ok in cases:
        matcher = compiler.matcher(tool_grammar(tools, choice))
        assert (matcher.follows(tok.encode(text, add_special_tokens=False)) and matcher.accepting) == ok, (choice, text)
    several = compiler.matcher(tool_grammar(tools, ToolChoice("required"), parallel=True))
    assert several.follows(tok.encode(two, add_special_tokens=False)) and several.accepting


def test_a_closing_tag_or_brace_inside_a_string_does_not_cut_the_call():
    tools = parse_tools([WEATHER])
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a </tool_call> } b"}}\n</tool_call>\nafter'
    parsed = parse_tool_calls(text, tools)
    assert [json.loads(c.arguments) for c in parsed.calls] == [{"city": "a </tool_call> } b"}]
    assert parsed.content == "after"
