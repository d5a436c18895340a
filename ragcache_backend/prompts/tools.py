"""Tool (function) calling: the tools in the prompt, the grammar that keeps calls well-formed,
and the parser that reads them back.

The format is Hermes' (used by Qwen 2.5/3, Hermes and many templates since, and parsed by vLLM's
``hermes`` tool parser): the tools' JSON signatures inside ``<tools></tools>`` in the system
turn, each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the
assistant's turn, each result as ``<tool_response>...</tool_response>`` in a user turn. It is
rendered as plain text in every model's template, so a chat with tools keeps a stable prefix
(the tool block) that the knowledge tree reuses from one request to the next.

``tool_choice`` ``required`` or a named function constrains the output with a grammar (Lark with
an embedded JSON Schema per tool, :mod:`ragcache_backend.model.grammar`), so the call parses
and its arguments validate against the function's schema whatever the model's size; a forced
answer is one call unless ``parallel_tool_calls`` is true (where OpenAI's default is true: a small
model allowed more keeps writing calls). ``auto`` lets the model choose and parses what it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.model.grammar import Grammar
from ragcache_backend.prompts.recognition import ChatTurn

__all__ = [
    "ParsedOutput", "Tool", "ToolCall", "ToolChoice", "ToolError", "parse_tool_calls", "parse_tool_choice",
    "parse_tools", "render_tool_calls", "render_tool_result", "tool_grammar", "tool_instructions", "with_tools",
]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class ToolError(InvalidRequestError):
    """A tool definition, a tool choice or a tool message that cannot be used (what and why)."""


@dataclass(slots=True, frozen=True)
class Tool:
    """One function the model may call.

    Attributes:
        name: 1-64 characters of letters, digits, ``_``, ``.``, ``-``.
        description: what it does ("" when not given).
        parameters: its arguments' JSON Schema, as canonical JSON text (an object schema).
    """

    name: str
    description: str
    parameters: str

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.parameters)


@dataclass(slots=True, frozen=True)
class ToolCall:
    """A call the model made: ``id`` (``call_...``), the function's name and its arguments as
    JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True, frozen=True)
class ToolChoice:
    """OpenAI's ``tool_choice``: ``none``, ``auto``, ``required``, or ``function`` with its ``name``."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None


@dataclass(slots=True, frozen=True)
class ParsedOutput:
    """An answer split into its text (None when it held only calls) and its tool calls."""

    content: str | None
    calls: tuple[ToolCall, ...]


def parse_tools(specs: Sequence[Mapping[str, Any]]) -> tuple[Tool, ...]:
    """OpenAI ``tools`` (``{"type": "function", "function": {"name", "description", "parameters"}}``)
    as :class:`Tool`.

    Raises:
        ToolError: a tool that is not a function, a bad or repeated name, parameters that are not
            a valid JSON Schema of an object (the validator's message).
    """
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    tools: list[Tool] = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or spec.get("type", "function") != "function":
            raise ToolError(f"tools[{i}]: only tools of type 'function' are supported")
        fn = spec.get("function")
        if not isinstance(fn, Mapping):
            raise ToolError(f"tools[{i}]: a function tool needs a 'function' object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}]: function name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if any(t.name == name for t in tools):
            raise ToolError(f"tools[{i}]: function {name!r} is defined twice")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise ToolError(f"tools[{i}]: parameters of {name!r} must be a JSON Schema object")
        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as exc:
            raise ToolError(f"tools[{i}]: parameters of {name!r} are not a valid JSON Schema: {exc.message}") from None
        if parameters.get("type", "object") != "object":
            raise ToolError(f"tools[{i}]: parameters of {name!r} must describe an object")
        description = fn.get("description") or ""
        tools.append(Tool(name, str(description), json.dumps(parameters, sort_keys=True)))
    return tuple(tools)


def parse_tool_choice(value: str | Mapping[str, Any] | None, tools: Sequence[Tool]) -> ToolChoice:
    """OpenAI ``tool_choice`` checked against ``tools`` (None: ``auto`` with tools, ``none`` without).

    Raises:
        ToolError: an unknown mode, a function no tool defines, ``required`` without tools.
    """
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {value!r}")
        if value != "none" and not tools:
            raise ToolError(f"tool_choice {value!r} needs tools")
        return ToolChoice(value)  # type: ignore[arg-type]
    fn = value.get("function") if isinstance(value, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ToolError("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if not any(t.name == name for t in tools):
        raise ToolError(f"tool_choice names function {name!r}, which no tool defines "
                        f"(tools: {', '.join(t.name for t in tools) or 'none'})")
    return ToolChoice("function", name)


def tool_instructions(tools: Sequence[Tool]) -> str:
    """The system-turn text that offers ``tools`` to the model (Hermes' wording)."""
    signatures = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.schema}}) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{signatures}\n</tools>\n\nFor each function call, return a json object with function name "
            "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def with_tools(turns: Sequence[ChatTurn], tools: Sequence[Tool]) -> list[ChatTurn]:
    """``turns`` with the tools' instructions (:func:`tool_instructions`) at the end of the first
    system turn (one is added at the start when there is none)."""
    instructions = tool_instructions(tools)
    if turns and turns[0].role == "system":
        first = turns[0].content
        return [ChatTurn("system", f"{first}\n\n{instructions}" if first else instructions), *turns[1:]]
    return [ChatTurn("system", instructions), *turns]


def render_tool_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant message's OpenAI ``tool_calls`` as the text the model would have written.

    Raises:
        ToolError: a call without a function name, or with arguments that are not a JSON object.
    """
    parts = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ToolError(f"tool_calls[{i}] needs a function with a name")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise ToolError(f"tool_calls[{i}]: arguments are not JSON") from None
        if not isinstance(parsed, Mapping):
            raise ToolError(f"tool_calls[{i}]: arguments must be a JSON object")
        parts.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": parsed}) + "\n</tool_call>")
    return "\n".join(parts)


def render_tool_result(content: str) -> str:
    """A tool message's content as the model reads it."""
    return f"<tool_response>\n{content}\n</tool_response>"


def _closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others
    (``additionalProperties: false`` where unset), as OpenAI's strict mode and vLLM's
    ``disable_additional_properties`` do: a call's arguments are the function's, nothing more."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if isinstance(out.get("properties"), Mapping) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_grammar(tools: Sequence[Tool], choice: ToolChoice, *, parallel: bool = False) -> Grammar | None:
    """The grammar that forces a call (``required``: any tool; ``function``: that one): exactly
    one, or one or more in a row when ``parallel`` (small models given the choice keep writing
    calls until ``max_tokens``, so several calls are opt-in: ``parallel_tool_calls=true``); None
    for ``auto`` and ``none`` (the model writes freely).
    The arguments are held to each tool's schema with its objects closed (:func:`_closed`)."""
    if choice.mode in ("none", "auto"):
        return None
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    body = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _closed(t.schema)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in chosen],
            # json.dumps' spacing, as the instructions show calls and as earlier calls are rendered
            "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    repeat = "+" if parallel else ""
    return Grammar.lark(f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>\\n"\n'
                        f"body: %json {json.dumps(body)}")


def parse_tool_calls(text: str, tools: Sequence[Tool]) -> ParsedOutput:
    """Split the model's answer into text and calls. Each ``<tool_call>`` is read as one JSON
    value (so a ``</tool_call>`` or a brace inside a string does not cut it short); a block that is
    not JSON, names no known tool or has non-object arguments stays in the text (as vLLM's hermes
    parser leaves what it cannot read)."""
    names = {t.name for t in tools}
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = start = 0
    while (start := text.find(_OPEN, start)) >= 0:
        body = len(text) - len(text[start + len(_OPEN):].lstrip())
        try:
            data, end = decoder.raw_decode(text, body)
        except json.JSONDecodeError:
            start += len(_OPEN)
            continue
        close = len(text) - len(text[end:].lstrip())
        if text.startswith(_CLOSE, close):
            end = close + len(_CLOSE)
        args = data.get("arguments", data.get("parameters", {})) if isinstance(data, Mapping) else None
        if not (isinstance(data, Mapping) and data.get("name") in names and isinstance(args, Mapping)):
            start = end
            continue
        kept.append(text[last:start])
        last = start = end
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], json.dumps(args)))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return ParsedOutput((content or None) if calls else text, tuple(calls))
