"""Forced tool calls: OpenAI's `tools` with `tool_choice` "required" or a named function, run as a JSON-schema
constraint on the model's output and answered as `tool_calls`.

A named function's output is its arguments object itself (constrained to its `parameters`); "required" makes the
model write a JSON array of {"name", "parameters"} calls, each item one of the given functions with arguments
valid against its schema (at most one item when parallel_tool_calls is false). `tool_choice: "auto"` would need
to tell a call from prose in the model's own tool-call syntax (a parser per model family), which pagedq does not
have: it is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from serve.errors import bad_request, unsupported

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolCalls:
    """How a request's output becomes tool calls: `name` for one named function, None for "required"."""

    name: str | None
    schema: dict[str, Any]  # the constraint on the output

    @property
    def streams_arguments(self) -> bool:
        """A named call's arguments stream as they come; a "required" array is split into calls at its end."""
        return self.name is not None

    def calls(self, text: str, job_id: str, index: int) -> list[dict]:
        """The output as OpenAI tool calls. A "required" array that does not parse (cut by max_tokens) is one call
        to no known function, with the text as its arguments, rather than nothing."""
        if self.name is not None:
            return [call(job_id, index, 0, self.name, text)]
        try:
            items = json.loads(text)
            return [call(job_id, index, i, item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                    for i, item in enumerate(items)]
        except (ValueError, TypeError, KeyError):
            return [call(job_id, index, 0, "", text)]


def call(job_id: str, index: int, i: int, name: str, arguments: str) -> dict:
    return {"id": call_id(job_id, index, i), "type": "function", "function": {"name": name, "arguments": arguments}}


def call_id(job_id: str, index: int, i: int) -> str:
    """Fixed by the job, so a retried request (Idempotency-Key) sees the same ids."""
    return "call_" + hashlib.sha256(f"{job_id}/{index}/{i}".encode()).hexdigest()[:24]


def parse_tools(body: dict) -> ToolCalls | None:
    """The request's tools and tool_choice -> how to constrain and answer it (None: no tool call). Raises APIError
    (400) naming what is wrong."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    functions = _functions(tools)
    if choice == "auto":
        raise unsupported("tool_choice", 'no "auto": pagedq has no model-specific tool-call parser; send '
                                         'tool_choice "required" or {"type": "function", "function": {"name": ...}}')
    if choice == "required":
        return ToolCalls(None, _any_call(functions, body.get("parallel_tool_calls", True)))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolCalls(name, functions[name])


def _functions(tools: Any) -> dict[str, dict]:
    """name -> parameters schema of each function tool."""
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    out = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise unsupported(where, 'function tools only ({"type": "function", "function": {...}})')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        parameters = fn.get("parameters") or _EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON Schema object",
                              f"{where}.function.parameters")
        out[name] = parameters
    return out


def _any_call(functions: dict[str, dict], parallel: bool) -> dict:
    one_call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, parameters in functions.items()]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_call}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema
