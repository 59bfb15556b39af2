# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tool calling with the real openai client against `vllm serve --enable-auto-tool-choice
--tool-call-parser hermes` (the bundled model, MTP speculation): a named function's arguments
follow its parameter schema, "required" gives calls of the request's functions with valid
arguments, "none" gives text, "auto" reads hermes <tool_call> blocks out of the text; streamed
answers carry the same tool calls."""

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


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_function(client) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    res = _create(client, tool_choice=choice)
    msg = res.choices[0].message
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
    assert msg.tool_calls[0].id and msg.tool_calls[0].type == "function"
    _check_call("get_weather", msg.tool_calls[0].function.arguments)
    content, calls, finish = _create(client, stream=True, tool_choice=choice)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", msg.tool_calls[0].function.arguments)
    ]
    assert finish == res.choices[0].finish_reason


def test_required(client) -> None:
    """parallel_tool_calls=false: exactly one call (this tiny model would go on listing
    calls until max_tokens)."""
    res = _create(client, tool_choice="required", max_tokens=120, parallel_tool_calls=False)
    msg = res.choices[0].message
    assert len(msg.tool_calls) == 1 and res.choices[0].finish_reason == "tool_calls", res
    for tc in msg.tool_calls:
        _check_call(tc.function.name, tc.function.arguments)
    _, calls, finish = _create(
        client, stream=True, tool_choice="required", max_tokens=120, parallel_tool_calls=False
    )
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (tc.function.name, tc.function.arguments) for tc in msg.tool_calls
    ]
    assert finish == "tool_calls"


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
