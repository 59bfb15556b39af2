# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""--reasoning-parser with the real openai client against `vllm serve` of a tiny Llama whose
tokenizer has <think> / </think> tokens and whose greedy answer closes its thinking a few tokens
in (vllm.testing.reasoning_checkpoints). The reference is the offline engine without a parser:
its raw text, split at </think> by the test; with a grammar, the reference content is the
offline engine's constrained continuation of the prompt plus the reasoning and </think>.

qwen3 (served with prompt-lookup speculation, so drafts run through the end marker too):
reasoning_content and content, streamed and not, include_reasoning false, enable_thinking
false; a regex / JSON schema applies only after the reasoning. deepseek_v3: no reasoning
unless chat_template_kwargs thinking is true."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.testing.reasoning_checkpoints import make_thinking_llama
from vllm.testing.remote_server import RemoteServer, serving

NAME = "thinker"
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
MAX_TOKENS = 24
REGEX = r"[a-z]{3,6}-[0-9]{2}"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer"],
    "additionalProperties": False,
}
NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_thinking_llama(tmp_path_factory.mktemp("thinker"), MESSAGES)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory, request):
    logs = tmp_path_factory.mktemp("serve_reasoning")
    common = ["--served-model-name", NAME, "--max-model-len", "256", "--dtype", "float32",
              "--disable-uvicorn-access-log"]  # fmt: skip
    started = {
        "qwen3": RemoteServer(
            model_dir,
            [*common, "--reasoning-parser", "qwen3", "--speculative-config", NGRAM],
            logs / "qwen3.log",
        ),
        "deepseek_v3": RemoteServer(
            model_dir, [*common, "--reasoning-parser", "deepseek_v3"], logs / "v3.log"
        ),
    }
    with serving(started):
        request.getfixturevalue("offline")  # loads while the servers start
        for srv in started.values():
            srv.wait_ready()
        yield started


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256)
    yield llm
    llm.shutdown()


def _client(srv: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120)


def _prompt_ids(llm: LLM, **template_kwargs) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    return tok.encode(text, add_special_tokens=False)


def _raw(llm: LLM, ids: list[int], so: StructuredOutputsParams | None = None, n=MAX_TOKENS):
    sp = SamplingParams(temperature=0, max_tokens=n, structured_outputs=so)
    out = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].outputs[0]
    return out.text, list(out.token_ids)


def _chat(client, stream: bool = False, **kw):
    kw = {"model": NAME, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0].message
        return getattr(msg, "reasoning_content", None), msg.content
    reasoning, content = None, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            r = getattr(ch.delta, "reasoning_content", None)
            if r is not None:
                reasoning = (reasoning or "") + r
            if ch.delta.content:
                content = (content or "") + ch.delta.content
    return reasoning, content


def test_reasoning_split_streamed_and_not(servers, offline):
    raw, _ = _raw(offline, _prompt_ids(offline))
    assert "</think>" in raw, raw  # the fixture's model closes its thinking
    reasoning, _, content = raw.partition("</think>")
    assert reasoning and content
    client = _client(servers["qwen3"])
    assert _chat(client) == (reasoning, content)
    assert _chat(client, stream=True) == (reasoning, content)
    assert _chat(client, extra_body={"include_reasoning": False}) == (None, content)
    assert _chat(client, stream=True, extra_body={"include_reasoning": False}) == (None, content)


def test_qwen3_enable_thinking_false_is_all_content(servers, offline):
    raw, _ = _raw(offline, _prompt_ids(offline, enable_thinking=False))
    client = _client(servers["qwen3"])
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _chat(client, extra_body=body) == (None, raw)
    assert _chat(client, stream=True, extra_body=body) == (None, raw)


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_grammar_applies_after_the_reasoning(servers, offline, kind):
    """The reasoning is what the model says unconstrained; the content is the grammar's
    continuation from the end marker on (also with drafts crossing it: the server speculates)."""
    ids = _prompt_ids(offline)
    raw, raw_ids = _raw(offline, ids)
    end = offline.get_tokenizer().convert_tokens_to_ids("</think>")
    cut = raw_ids.index(end) + 1
    if kind == "regex":
        so = StructuredOutputsParams(regex=REGEX)
        extra = {"extra_body": {"structured_outputs": {"regex": REGEX}}}
    else:  # without free whitespace: this tiny model would fill its budget with spaces
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        body = {"json": SCHEMA, "disable_any_whitespace": True}
        extra = {"extra_body": {"structured_outputs": body}}
    content, _ = _raw(offline, ids + raw_ids[:cut], so, MAX_TOKENS - cut)
    reasoning = raw.partition("</think>")[0]
    if kind == "regex":
        assert re.fullmatch(REGEX, content), content
    else:
        jsonschema.validate(json.loads(content), SCHEMA)
    client = _client(servers["qwen3"])
    assert _chat(client, **extra) == (reasoning, content)
    assert _chat(client, stream=True, **extra) == (reasoning, content)


def test_deepseek_v3_thinking_switch(servers, offline):
    client = _client(servers["deepseek_v3"])
    plain, _ = _raw(offline, _prompt_ids(offline, thinking=False))
    assert _chat(client, extra_body={"chat_template_kwargs": {"thinking": False}}) == (None, plain)
    default, _ = _raw(offline, _prompt_ids(offline))
    assert _chat(client) == (None, default)  # thinking is off unless asked for
    thought, _ = _raw(offline, _prompt_ids(offline, thinking=True))
    assert "</think>" not in thought  # this prompt's answer never closes its thinking
    body = {"chat_template_kwargs": {"thinking": True}}
    assert _chat(client, extra_body=body) == (thought, None)
    assert _chat(client, stream=True, extra_body=body) == (thought, None)
    # Thinking off: a grammar constrains the answer from its first token.
    res = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )  # fmt: skip
    assert re.fullmatch(REGEX, res.choices[0].message.content)


def test_unknown_reasoning_parser_is_refused(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="unknown reasoning parser 'bogus'"):
        EngineArgs(model=model_dir, reasoning_parser="bogus").create_engine_config()
