# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tool calling with the real openai client against `vllm serve --enable-auto-tool-choice
--tool-call-parser hermes` (the bundled model, MTP speculation; compact JSON, which this tiny
model needs to finish an object): a named function's arguments follow its parameter schema,
"required" gives calls of the request's functions with valid arguments (also with parameters
that use "$ref": "#/$defs/..."), "none" gives text, "auto" reads hermes <tool_call> blocks out
of the text. Streamed, the arguments come as deltas, and the openai client's own stream
accumulation gives the same calls as the answer in full. As vLLM: content is "" beside a named
or required call, None beside auto calls; a call cut by max_tokens is no call (content "",
finish_reason "length"), never one with broken arguments."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from vllm.config import DEFAULT_MODEL_DIR
from vllm.testing.remote_server import RemoteServer

NAME = "tiny"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = json.dumps(
        {"method": "mtp", "num_speculative_tokens": 2, "adaptive_num_speculative_tokens": False}
    )
    args = [
        "--served-model-name", NAME, "--max-model-len", "512",
        "--speculative-config", spec, "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--disable-uvicorn-access-log",
        "--structured-outputs-config", '{"disable_any_whitespace": true}',
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("serve_tools") / "server.log"
    with RemoteServer(str(DEFAULT_MODEL_DIR), args, log) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)


def _create(client, stream: bool = False, **kw):
    kw = {
        "model": NAME,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 80,
        "temperature": 0,
        **kw,
    }
    if not stream:
        return client.chat.completions.create(**kw)
    # Accumulate the stream as the openai client's users do.
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = tc.id or c["id"]
                if tc.function:
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


def _client_accumulated(client, **kw):
    """The openai client's own accumulation of a streamed answer (chat.completions.stream),
    and how many chunks carried argument text."""
    kw = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 80,
          "temperature": 0, **kw}  # fmt: skip
    arg_chunks = 0
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta" and event.arguments_delta:
                arg_chunks += 1
        final = stream.get_final_completion()
    return final.choices[0], arg_chunks


def _calls(message) -> list[tuple[str, str]]:
    return [(t.function.name, t.function.arguments) for t in message.tool_calls or []]


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_function(client) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    res = _create(client, tool_choice=choice)
    msg = res.choices[0].message
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
    assert msg.tool_calls[0].id and msg.tool_calls[0].type == "function"
    assert msg.content == "" and res.choices[0].finish_reason == "stop"
    _check_call("get_weather", msg.tool_calls[0].function.arguments)
    content, calls, finish = _create(client, stream=True, tool_choice=choice)
    assert [(c["name"], c["arguments"]) for c in calls] == _calls(msg)
    assert finish == res.choices[0].finish_reason
    streamed, arg_chunks = _client_accumulated(client, tool_choice=choice)
    assert _calls(streamed.message) == _calls(msg) and arg_chunks > 1
    assert streamed.finish_reason == "stop"


def test_required(client) -> None:
    """parallel_tool_calls=false: exactly one call (this tiny model would go on listing
    calls until max_tokens)."""
    res = _create(client, tool_choice="required", max_tokens=120, parallel_tool_calls=False)
    msg = res.choices[0].message
    assert len(msg.tool_calls) == 1 and res.choices[0].finish_reason == "tool_calls", res
    for tc in msg.tool_calls:
        _check_call(tc.function.name, tc.function.arguments)
    assert msg.content == ""
    _, calls, finish = _create(
        client, stream=True, tool_choice="required", max_tokens=120, parallel_tool_calls=False
    )
    assert [(c["name"], c["arguments"]) for c in calls] == _calls(msg)
    assert finish == "tool_calls"
    streamed, arg_chunks = _client_accumulated(
        client, tool_choice="required", max_tokens=120, parallel_tool_calls=False
    )
    assert _calls(streamed.message) == _calls(msg) and arg_chunks > 1
    assert streamed.finish_reason == "tool_calls"


DEFS_TOOL = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}},
            "required": ["unit"],
            "additionalProperties": False,
            "$defs": {"Unit": {"enum": ["c", "f"]}},
        },
    },
}


def test_required_with_defs_references(client) -> None:
    """Parameters that reference their own $defs (pydantic's schemas do) work with "required"
    (vLLM hoists the definitions to the root of the list's schema)."""
    for stream in (False, True):
        kw = dict(tool_choice="required", tools=[DEFS_TOOL, TOOLS[1]], parallel_tool_calls=False)
        if stream:
            choice, _ = _client_accumulated(client, **kw)
        else:
            choice = _create(client, **kw).choices[0]
        (call,) = choice.message.tool_calls
        schema = DEFS_TOOL["function"]["parameters"] if call.function.name == "set_unit" else TIME
        jsonschema.validate(json.loads(call.function.arguments), schema)
    with pytest.raises(openai.BadRequestError, match="tools"):
        other = json.loads(json.dumps(DEFS_TOOL))
        other["function"]["name"] = "other"
        other["function"]["parameters"]["$defs"]["Unit"] = {"enum": ["k"]}
        _create(client, tool_choice="required", tools=[DEFS_TOOL, other])


def test_call_cut_by_max_tokens_is_no_call(client) -> None:
    """A named or required call that max_tokens cuts short: no tool call with broken arguments
    (content "", finish_reason "length"), as vLLM answers a cut "required" list."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        res = _create(client, tool_choice=choice, max_tokens=3)
        ch = res.choices[0]
        assert (ch.message.tool_calls, ch.message.content, ch.finish_reason) == ([], "", "length")


def test_none_gives_text(client) -> None:
    res = _create(client, tool_choice="none", max_tokens=8)
    assert not res.choices[0].message.tool_calls and res.choices[0].message.content


def test_auto_reads_hermes_tool_calls(client) -> None:
    """The model is held to a hermes call by a grammar (a tiny model does not write one by
    itself); the parser turns the text into the call."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
    grammar = {"structured_outputs": {"choice": [call]}}
    res = _create(client, tool_choice="auto", extra_body=grammar)
    msg = res.choices[0].message
    assert msg.content is None and res.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("get_time", {"zone": "cet"})
    ]
    _, calls, finish = _create(client, stream=True, tool_choice="auto", extra_body=grammar)
    assert [c["name"] for c in calls] == ["get_time"] and finish == "tool_calls"
    plain = _create(client, tool_choice="auto", max_tokens=8)
    assert not plain.choices[0].message.tool_calls


def test_bad_tool_requests_are_400s(client) -> None:
    for kw, field in [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools"),
    ]:
        body = dict(model=NAME, messages=MESSAGES, max_tokens=4, tools=TOOLS)
        body.update(kw)
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(**body)
