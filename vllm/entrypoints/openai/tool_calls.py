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
    # Each function's parameters sit inside the array's items, so their "#/$defs/..." (and
    # "#/definitions/...") references are resolved from the root: the definitions move there
    # (as vLLM does; one name defined differently by two tools is refused).
    hoisted: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    items = []
    for n, p in schemas.items():
        p = dict(p)
        for key, defs in hoisted.items():
            own = p.pop(key, None)
            if own is None:
                continue
            if not isinstance(own, dict):
                raise VLLMValidationError(
                    f"tools: function {n!r} parameters.{key} must be an object", parameter="tools"
                )
            for name, d in own.items():
                if name in defs and defs[name] != d:
                    raise VLLMValidationError(
                        f"tools: {key}/{name} is defined differently by two functions "
                        "(not supported with tool_choice 'required')",
                        parameter="tools",
                    )
                defs[name] = d
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    schema.update({key: defs for key, defs in hoisted.items() if defs})
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
    """(content, tool calls) of a generated text under the request's tool mode, as vLLM
    answers: a named or required call leaves content "" (also when the output was cut before
    a call completed: then there is no call, never one with broken arguments); auto tool calls
    leave the text before them as content (None when it is only whitespace)."""
    if mode == "named":
        assert named is not None
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return "", []  # cut off by max_tokens: no complete call
        return "", [new_call(named, text)]
    if mode == "required":
        calls = [c for c in scan_required(text) if c.complete]
        if not calls or not _closed_array(text):
            return "", []  # cut off by max_tokens: no complete list of calls
        return "", [new_call(c.name or "", canonical_json(c.params_raw, True)) for c in calls]
    if mode == "auto" and parser == "hermes":
        return _hermes(text)
    return text, []


def _closed_array(text: str) -> bool:
    try:
        return isinstance(json.loads(text), list)
    except json.JSONDecodeError:
        return False


# ---- streaming: tool calls read from a growing text ---------------------------------------------
class RequiredCall:
    """One call of a tool_choice "required" answer as far as the text has come."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.params_raw = ""  # the raw JSON text of "parameters" so far
        self.params_done = False
        self.complete = False  # its object closed


_WS = " \t\n\r"


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


_DECODER = json.JSONDecoder()


def _value_end(text: str, i: int) -> int | None:
    """End of the complete JSON value at text[i:] (None: not complete yet). A number that
    reaches the end of the text may still grow."""
    try:
        _, j = _DECODER.raw_decode(text, i)
    except (json.JSONDecodeError, ValueError):
        return None
    if j == len(text) and text[i] in "-0123456789":
        return None
    return j


def scan_required(text: str) -> list[RequiredCall]:
    """The calls of a (possibly unfinished) JSON array of {"name", "parameters"} objects."""
    calls: list[RequiredCall] = []
    i = _ws(text, 0)
    if i >= len(text) or text[i] != "[":
        return calls
    i += 1
    while True:
        i = _ws(text, i)
        if i >= len(text) or text[i] == "]":
            return calls
        if text[i] == ",":
            i += 1
            continue
        if text[i] != "{":
            return calls
        call = RequiredCall()
        calls.append(call)
        i += 1
        while True:
            i = _ws(text, i)
            if i >= len(text):
                return calls
            if text[i] == ",":
                i += 1
                continue
            if text[i] == "}":
                call.complete = True
                i += 1
                break
            key_end = _value_end(text, i)
            if key_end is None or text[i] != '"':
                return calls
            key = json.loads(text[i:key_end])
            i = _ws(text, key_end)
            if i >= len(text) or text[i] != ":":
                return calls
            i = _ws(text, i + 1)
            end = _value_end(text, i)
            if key == "parameters":
                call.params_raw = text[i:end] if end is not None else text[i:]
                call.params_done = end is not None
            elif key == "name" and end is not None:
                name = json.loads(text[i:end])
                call.name = name if isinstance(name, str) else str(name)
            if end is None:
                return calls
            i = end


_NUMBER_CHARS = "-+.eE0123456789"


def _char_json(ch: str) -> str:
    """ch as it appears inside a JSON string written with ensure_ascii=False (a lone surrogate
    stays an escape: it has no UTF-8 form)."""
    if 0xD800 <= ord(ch) <= 0xDFFF:
        return f"\\u{ord(ch):04x}"
    return json.dumps(ch, ensure_ascii=False)[1:-1]


def canonical_json(raw: str, complete: bool) -> str:
    """The JSON text raw (a value, or while not complete the beginning of one) written as
    json.dumps(value, ensure_ascii=False) writes it: the canonical text of a prefix of raw is a
    prefix of the canonical text of raw, so a streamed call's argument deltas add up to the
    arguments of the same call answered whole. While not complete, a number, literal or escape
    that may still grow is held back."""
    out: list[str] = []
    i, n = 0, len(raw)
    while i < n:
        ch = raw[i]
        if ch in _WS:
            i += 1
        elif ch in "{}[]":
            out.append(ch)
            i += 1
        elif ch == ",":
            out.append(", ")
            i += 1
        elif ch == ":":
            out.append(": ")
            i += 1
        elif ch == '"':
            out.append('"')
            i += 1
            while i < n:
                c = raw[i]
                if c == '"':
                    out.append('"')
                    i += 1
                    break
                if c != "\\":
                    out.append(_char_json(c))
                    i += 1
                    continue
                if i + 1 >= n:
                    return "".join(out)  # an escape still arriving
                e = raw[i + 1]
                if e != "u":
                    out.append(_char_json(json.loads(f'"\\{e}"')))
                    i += 2
                    continue
                if i + 6 > n:
                    return "".join(out)
                code = int(raw[i + 2 : i + 6], 16)
                i += 6
                if 0xD800 <= code <= 0xDBFF:  # a high surrogate: its pair may follow
                    if raw.startswith("\\u", i) and i + 6 <= n:
                        low = int(raw[i + 2 : i + 6], 16)
                        if 0xDC00 <= low <= 0xDFFF:
                            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                            i += 6
                    elif i + 6 > n and (n - i == 0 or "\\u".startswith(raw[i : i + 2])):
                        if not complete:
                            return "".join(out)  # the pair's second half may be arriving
                out.append(_char_json(chr(code)))
            else:
                if not complete:
                    return "".join(out)
        else:
            j = i
            while j < n and (raw[j] in _NUMBER_CHARS or raw[j].isalpha()):
                j += 1
            if j == n and not complete:
                return "".join(out)  # a number or literal that may still grow
            out.append(json.dumps(json.loads(raw[i:j]), ensure_ascii=False))
            i = j
    return "".join(out)


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
    content = text[:start]
    return content if content.strip() else None, calls
