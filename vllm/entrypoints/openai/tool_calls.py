# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tool calling: the grammar a tool_choice imposes, and reading tool calls out of the text.

tool_choice "required" constrains the output to a JSON array of {"name", "parameters"} objects,
one of the request's functions each; a named function constrains it to that function's
parameter schema (vLLM's formats). "auto" leaves the text free and a tool-call parser
(--tool-call-parser hermes: <tool_call>{"name": ..., "arguments": ...}</tool_call>) reads the
calls out of it. "none" does neither."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameter schema of each function tool; 400 naming tools on a bad entry."""
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not fn:
            raise VLLMValidationError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", parameter="tools"
            )
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise VLLMValidationError(f"tools[{i}].function.name is required", parameter="tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise VLLMValidationError(
                f"tools[{i}].function.parameters must be a JSON schema object", parameter="tools"
            )
        out[name] = params
    return out


def tool_choice_mode(tool_choice: str | dict[str, Any] | None, has_tools: bool) -> str:
    """ "none", "auto", "required" or "named" (OpenAI's default: auto with tools)."""
    if tool_choice is None:
        return "auto" if has_tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise VLLMValidationError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                f"got {tool_choice!r}",
                parameter="tool_choice",
            )
        return tool_choice
    return "named"


def named_function(tool_choice: dict[str, Any]) -> str:
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise VLLMValidationError(
            "a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
            parameter="tool_choice",
        )
    return name


def tool_grammar(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None = None,
) -> StructuredOutputsParams | None:
    """The structured output tool_choice imposes (None for none / auto); "required" with
    parallel_tool_calls false allows exactly one call."""
    mode = tool_choice_mode(tool_choice, bool(tools))
    if mode in ("none", "auto"):
        return None
    if not tools:
        raise VLLMValidationError(
            f"tool_choice {tool_choice!r} needs tools", parameter="tool_choice"
        )
    schemas = check_tools(tools)
    if mode == "named":
        assert isinstance(tool_choice, dict)
        name = named_function(tool_choice)
        if name not in schemas:
            raise VLLMValidationError(
                f"tool_choice names function {name!r}, which is not in tools",
                parameter="tool_choice",
            )
        return StructuredOutputsParams(json=schemas[name], _source="tool_choice")
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
            "required": ["name", "parameters"],
        }
        for n, p in schemas.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, _source="tool_choice")


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _args_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def parse_tool_calls(
    text: str, mode: str, named: str | None, parser: str | None
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a generated text under the request's tool mode."""
    if mode == "named":
        assert named is not None
        return None, [new_call(named, text)]
    if mode == "required":
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut off by max_tokens: no complete call
        return None, [new_call(c["name"], _args_text(c.get("parameters", {}))) for c in calls]
    if mode == "auto" and parser == "hermes":
        return _hermes(text)
    return text, []


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append(new_call(obj["name"], _args_text(obj.get("arguments", {}))))
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls
