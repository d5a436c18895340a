"""What holds a request's output to a shape: ``response_format``, vLLM's ``structured_outputs``,
and ``tools`` with ``tool_choice``, checked and turned into one grammar and the tools to parse.

Every refusal is a 400 naming the field (a JSON Schema that does not compile is refused when the
engine compiles it, also with a 400 and the grammar library's message).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ragcache_backend.model.grammar import Grammar, GrammarError
from ragcache_backend.prompts.tools import Tool, ToolChoice, ToolError, parse_tool_choice, parse_tools, tool_grammar
from ragcache_backend.server.errors import APIError
from ragcache_backend.server.schema import ChatCompletionRequest, CompletionRequest

__all__ = ["OutputConstraints", "output_constraints"]


@dataclass(slots=True, frozen=True)
class OutputConstraints:
    """A request's output shape.

    Attributes:
        grammar: what constrained decoding holds the output to (None: free text).
        tools: the functions offered (empty: none).
        tool_choice: ``none``, ``auto``, ``required`` or one function.
    """

    grammar: Grammar | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")

    @property
    def calls_tools(self) -> bool:
        """The answer may hold tool calls (they are parsed out of it)."""
        return bool(self.tools) and self.tool_choice.mode != "none"


def _structured_outputs(value: Mapping[str, Any]) -> Grammar | None:
    """vLLM's ``structured_outputs``: exactly one of json, json_object, regex, choice, grammar."""
    given = {k: v for k, v in value.items() if k in ("json", "json_object", "regex", "choice", "grammar")
             and v not in (None, False)}
    if len(given) != 1:
        raise GrammarError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar")
    (key, spec), = given.items()
    if key == "json":
        return Grammar.json_schema(spec if isinstance(spec, (str, Mapping)) else json.dumps(spec))
    if key == "json_object":
        return Grammar.json_object()
    if key == "choice":
        if not isinstance(spec, list):
            raise GrammarError("structured_outputs choice is a list of strings")
        return Grammar.choice(spec)
    if not isinstance(spec, str):
        raise GrammarError(f"structured_outputs {key} is a string")
    return Grammar.regex(spec) if key == "regex" else Grammar.lark(spec)


def output_constraints(body: ChatCompletionRequest | CompletionRequest) -> OutputConstraints:
    """The output shape ``body`` asks for.

    Raises:
        APIError: 400 for a tool that is not a valid function definition, a ``tool_choice``
            naming no tool, a malformed ``response_format`` or ``structured_outputs``.
    """
    field = "structured_outputs"
    try:
        grammar = _structured_outputs(body.structured_outputs) if body.structured_outputs else None
        if isinstance(body, CompletionRequest):
            return OutputConstraints(grammar)
        field = "response_format"
        if body.response_format:
            grammar = Grammar.response_format(body.response_format)
        field = "tools"
        tools = parse_tools(body.tools or ())
        field = "tool_choice"
        choice = parse_tool_choice(body.tool_choice, tools)
        forced = tool_grammar(tools, choice, parallel=body.parallel_tool_calls is True)
    except (GrammarError, ToolError) as exc:
        raise APIError(400, str(exc), param=field, code="invalid_value") from None
    return OutputConstraints(forced or grammar, tools, choice)
