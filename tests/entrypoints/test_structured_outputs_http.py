# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Structured outputs over HTTP with the real openai client against `vllm serve` (the bundled
model, MTP speculation K = 2, P = 2): response_format json_schema / json_object, vLLM's
structured_outputs extra field (regex, choice, grammar), streaming; the text equals what the
offline engine without speculation at P = 1 gives for the same grammar; a schema that does not
compile is a 400 naming the problem, and the server keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from vllm import LLM, SamplingParams
from vllm.config import DEFAULT_MODEL_DIR
from vllm.sampling_params import StructuredOutputsParams
from vllm.testing.remote_server import RemoteServer

NAME = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["list", "dict", "set"]},
    },
    "required": ["name", "size", "kind"],
    "additionalProperties": False,
}
PROMPT = "def describe(obj):\n    return "
REGEX = r"[a-z]{2,5}_[0-9]{2}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = json.dumps(
        {"method": "mtp", "num_speculative_tokens": 2, "adaptive_num_speculative_tokens": False}
    )
    # JSON without free whitespace for every request (the tiny model would otherwise fill
    # max_tokens with it), set through vLLM's dotted config flag.
    args = [
        "--served-model-name", NAME, "--max-model-len", "256", "-pp", "2",
        "--speculative-config", spec, "--disable-uvicorn-access-log",
        "--structured-outputs-config.disable_any_whitespace", "true",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("serve_so") / "server.log"
    with RemoteServer(str(DEFAULT_MODEL_DIR), args, log) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline() -> dict[str, str]:
    """The same grammars offline, P = 1, no speculation (greedy)."""
    llm = LLM(
        model=str(DEFAULT_MODEL_DIR),
        max_model_len=256,
        structured_outputs_config={"disable_any_whitespace": True},
    )
    try:
        out = {}
        for key, so, n in [
            ("schema", StructuredOutputsParams(json=SCHEMA), 64),
            ("regex", StructuredOutputsParams(regex=REGEX), 16),
        ]:
            sp = SamplingParams(temperature=0, max_tokens=n, structured_outputs=so)
            out[key] = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].text
        return out
    finally:
        llm.shutdown()


def test_response_format_json_schema(client, offline) -> None:
    res = client.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=64,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "obj", "schema": SCHEMA, "strict": True},
            }
        },
    )
    text = res.choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == offline["schema"]
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "describe a list"}],
        max_tokens=64,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "obj", "schema": SCHEMA},
        },
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)


def test_response_format_json_object(client) -> None:
    res = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = res.choices[0].message.content
    assert text.startswith("{")
    if res.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_extra_field_and_streaming(client, offline) -> None:
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    res = client.completions.create(**kw, extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, res.choices[0].text) and res.choices[0].text == offline["regex"]
    stream = client.completions.create(
        **kw, stream=True, extra_body={"structured_outputs": {"regex": REGEX}}
    )
    assert "".join(c.choices[0].text for c in stream) == offline["regex"]
    choice = client.completions.create(
        **kw, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}}
    )
    assert choice.choices[0].text in ("alpha", "beta")
    gram = client.completions.create(
        **kw, extra_body={"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}
    )
    assert re.fullmatch(r"x[0-9]{2}", gram.choices[0].text)
    seeded = client.completions.create(
        **{**kw, "temperature": 1.0}, seed=4, extra_body={"guided_regex": REGEX}
    )
    assert re.fullmatch(REGEX, seeded.choices[0].text)


@pytest.mark.parametrize(
    "body, field",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/nope"}},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_bad_grammar_is_a_400_naming_it(server, client, body, field) -> None:
    r = httpx.post(
        server.url("/v1/completions"),
        json={"model": NAME, "prompt": "a", "max_tokens": 2, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.text
    ok = client.completions.create(model=NAME, prompt="ok", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
