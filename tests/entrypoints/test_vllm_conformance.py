# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What a vLLM client, dashboard or script touches, through the real `vllm serve` (the bundled
model) and the real openai client: every field of vLLM's request models is honoured or refused
with a 400 naming it, vLLM's extra endpoints and response content, the stream layout with
n > 1, usage details, and the Prometheus metrics with vLLM's names, types, labels and buckets.

The field lists below are vLLM's own (its CompletionRequest / ChatCompletionRequest, current
and 0.10-era fields together), written here rather than read from our code, so a field we
drop silently fails the walk."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jinja2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from vllm.config import DEFAULT_MODEL_DIR
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from vllm.entrypoints.openai.protocol import CompletionRequest
from vllm.testing.remote_server import RemoteServer

NAME = "tiny"
MAX_MODEL_LEN = 256
MAX_LOGPROBS = 8
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)

# ---- vLLM's request fields ------------------------------------------------------------------
COMPLETION_FIELDS = """
model prompt best_of echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty
seed stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p
repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output
ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens
truncation_side allowed_token_ids prompt_logprobs logprob_token_ids bad_words prompt_embeds
add_special_tokens response_format structured_outputs guided_json guided_regex guided_choice
guided_grammar guided_decoding_backend guided_whitespace_pattern priority request_id session_id
logits_processors return_tokens_as_token_ids return_token_ids routed_experts_prompt_start
return_token_offsets return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params
vllm_xargs repetition_detection thinking_token_budget stream_interval early_stopping
""".split()  # early_stopping: vLLM 0.6's beam-search field
CHAT_FIELDS = """
messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens
max_completion_tokens n presence_penalty response_format seed stop stream stream_options
temperature top_p tools tool_choice reasoning_effort thinking_token_budget include_reasoning
parallel_tool_calls user best_of use_beam_search top_k min_p repetition_penalty watermarking
length_penalty early_stopping stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt
continue_final_message add_special_tokens documents chat_template chat_template_kwargs
media_io_kwargs mm_processor_kwargs structured_outputs guided_json guided_regex guided_choice
guided_grammar structural_tag guided_decoding_backend guided_whitespace_pattern priority
request_id session_id logits_processors return_tokens_as_token_ids return_token_ids
routed_experts_prompt_start return_token_offsets return_prompt_text return_mm_kwargs cache_salt
kv_transfer_params ec_transfer_params vllm_xargs repetition_detection stream_interval
""".split()

# A non-default value for every field (with what it needs beside it), and what must happen:
# "ok" = 200 and parsed by our model (its effect is tested below), "refuse" = 400 naming it,
# "either" = the sampling-controls / structured-output fields another change implements.
OK, REFUSE, EITHER = "ok", "refuse", "either"
EXAMPLES: dict[str, tuple[dict, str]] = {
    "model": ({"model": NAME}, OK),
    "prompt": ({}, OK),
    "messages": ({}, OK),
    "best_of": ({"best_of": 2, "n": 2, "temperature": 1.0}, OK),
    "echo": ({"echo": True}, OK),
    "frequency_penalty": ({"frequency_penalty": 0.5}, OK),
    "presence_penalty": ({"presence_penalty": 0.5}, OK),
    "repetition_penalty": ({"repetition_penalty": 1.2}, OK),
    "logit_bias": ({"logit_bias": {"5": 1.0}}, OK),
    "allowed_token_ids": ({"allowed_token_ids": [5, 6]}, OK),
    "bad_words": ({"bad_words": ["x"]}, OK),
    "min_p": ({"min_p": 0.1}, OK),
    "logprobs": ({"logprobs": 2}, OK),  # chat: replaced by True below
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, OK),
    "max_tokens": ({"max_tokens": 1}, OK),
    "max_completion_tokens": ({"max_completion_tokens": 1}, OK),
    "n": ({"n": 2, "temperature": 1.0}, OK),
    "seed": ({"seed": 3, "temperature": 1.0}, OK),
    "stop": ({"stop": ["xyz"]}, OK),
    "stream": ({"stream": True}, OK),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, OK),
    "suffix": ({"suffix": "x"}, REFUSE),
    "temperature": ({"temperature": 0.5}, OK),
    "top_p": ({"top_p": 0.9, "temperature": 1.0}, OK),
    "top_k": ({"top_k": 5, "temperature": 1.0}, OK),
    "user": ({"user": "u1"}, OK),
    "session_id": ({"session_id": "s1"}, OK),
    "use_beam_search": ({"use_beam_search": True, "n": 2}, OK),
    "length_penalty": ({"use_beam_search": True, "length_penalty": 1.5}, OK),
    "early_stopping": ({"use_beam_search": True, "early_stopping": True}, OK),
    "watermarking": ({"watermarking": True}, REFUSE),
    "stop_token_ids": ({"stop_token_ids": [5]}, OK),
    "include_stop_str_in_output": ({"include_stop_str_in_output": True}, OK),
    "ignore_eos": ({"ignore_eos": True}, OK),
    "min_tokens": ({"min_tokens": 1}, OK),
    "skip_special_tokens": ({"skip_special_tokens": False}, OK),
    "spaces_between_special_tokens": ({"spaces_between_special_tokens": False}, OK),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 2}, OK),
    "truncation_side": ({"truncate_prompt_tokens": 2, "truncation_side": "right"}, OK),
    "prompt_logprobs": ({"prompt_logprobs": 1}, OK),
    "logprob_token_ids": ({"logprobs": 1, "logprob_token_ids": [5]}, REFUSE),
    "prompt_embeds": ({"prompt_embeds": "AAAA"}, REFUSE),
    "add_special_tokens": ({"add_special_tokens": None}, OK),  # set per endpoint below
    "response_format": ({"response_format": {"type": "json_object"}}, OK),
    "structured_outputs": ({"structured_outputs": {"regex": "a+"}}, OK),
    "guided_json": ({"guided_json": {"type": "object"}}, OK),
    "guided_regex": ({"guided_regex": "a+"}, OK),
    "guided_choice": ({"guided_choice": ["a", "b"]}, OK),
    "guided_grammar": ({"guided_grammar": 'root ::= "a"'}, OK),
    "structural_tag": ({"structural_tag": "{}"}, EITHER),
    "guided_decoding_backend": ({"guided_decoding_backend": "xgrammar"}, EITHER),
    "guided_whitespace_pattern": ({"guided_whitespace_pattern": " "}, EITHER),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, OK),
    "tool_choice": ({"tool_choice": "none"}, OK),
    "parallel_tool_calls": ({"parallel_tool_calls": False}, OK),  # no effect without tools
    "priority": ({"priority": 1}, OK),  # the server runs --scheduling-policy priority
    "request_id": ({"request_id": "walk"}, OK),
    "logits_processors": ({"logits_processors": ["a.b"]}, REFUSE),
    "return_tokens_as_token_ids": ({"return_tokens_as_token_ids": True}, OK),
    "return_token_ids": ({"return_token_ids": True}, OK),
    "routed_experts_prompt_start": ({"routed_experts_prompt_start": 1}, REFUSE),
    "return_token_offsets": ({"return_token_offsets": True}, OK),  # vLLM: /render only
    "return_mm_kwargs": ({"return_mm_kwargs": False}, OK),  # vLLM: /render only
    "return_prompt_text": ({"return_prompt_text": True}, OK),
    "cache_salt": ({"cache_salt": "tenant"}, OK),
    "kv_transfer_params": ({"kv_transfer_params": {"a": 1}}, REFUSE),
    "ec_transfer_params": ({"ec_transfer_params": {"a": 1}}, REFUSE),
    "vllm_xargs": ({"vllm_xargs": {"a": 1}}, REFUSE),
    "repetition_detection": ({"repetition_detection": {"max_pattern_size": 2}}, REFUSE),
    "thinking_token_budget": ({"thinking_token_budget": 10}, REFUSE),
    "stream_interval": ({"stream": True, "stream_interval": 2}, REFUSE),
    "reasoning_effort": ({"reasoning_effort": "low"}, OK),
    "include_reasoning": ({"include_reasoning": False}, OK),
    "add_generation_prompt": ({"add_generation_prompt": False}, OK),
    "continue_final_message": (
        {"add_generation_prompt": False, "continue_final_message": True},
        OK,
    ),
    "documents": ({"documents": [{"title": "t", "text": "x"}]}, OK),
    "chat_template": ({"chat_template": "{{ 'x' }}"}, REFUSE),  # no --trust-request-...
    "chat_template_kwargs": ({"chat_template_kwargs": {"flag": True}}, OK),
    "media_io_kwargs": ({"media_io_kwargs": {"image": {"a": 1}}}, REFUSE),
    "mm_processor_kwargs": ({"mm_processor_kwargs": {"a": 1}}, REFUSE),
}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory, template_file):
    args = [
        "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN),
        "--scheduling-policy", "priority", "--max-logprobs", str(MAX_LOGPROBS),
        "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
        "--enable-prompt-tokens-details", "--chat-template", template_file,
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with RemoteServer(str(DEFAULT_MODEL_DIR), args, log) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=120)


def sse_chunks(server: RemoteServer, path: str, body: dict) -> list[dict]:
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- the field rule ----------------------------------------------------------------------
def _walk_case(path: str, model: type, base: dict, name: str) -> tuple[str, dict, str]:
    assert name in EXAMPLES, f"no example for vLLM's field {name!r}"
    extra, expect = EXAMPLES[name]
    if name == "add_special_tokens":
        extra = {name: model is ChatCompletionRequest}  # the non-default value
    if name == "logprobs" and model is ChatCompletionRequest:
        extra = {"logprobs": True}
    return path, {"model": NAME, "max_tokens": 1, "temperature": 0, **base, **extra}, expect


def test_every_vllm_request_field_is_honoured_or_refused(server):
    chat_base = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (name, model, _walk_case(path, model, base, name))
        for path, model, fields, base in [
            ("/v1/completions", CompletionRequest, COMPLETION_FIELDS, {"prompt": "def f(x):"}),
            ("/v1/chat/completions", ChatCompletionRequest, CHAT_FIELDS, chat_base),
        ]
        for name in fields
    ]
    # Concurrent, so the engine batches them; each answer is checked on its own.
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda c: post(server, c[2][0], c[2][1]), cases))
    for (name, model, (path, body, expect)), r in zip(cases, responses):
        where = f"{path} {name} ({body})"
        if r.status_code == 200:
            assert expect in (OK, EITHER), f"{where}: accepted, expected a 400 naming it"
            # Accepted means parsed by our request model, never dropped as unknown.
            assert name in model.model_fields, f"{where}: accepted but not implemented"
        else:
            assert r.status_code == 400, (where, r.status_code, r.text)
            assert expect in (REFUSE, EITHER), f"{where}: refused: {r.text}"
            assert name in r.json()["error"]["message"], (where, r.text)
    # Our request models declare no field vLLM does not define.
    for model, fields in [
        (CompletionRequest, COMPLETION_FIELDS),
        (ChatCompletionRequest, CHAT_FIELDS),
    ]:
        assert set(model.model_fields) <= set(fields), set(model.model_fields) - set(fields)


def test_unknown_fields_are_ignored_with_a_warning(server):
    r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 1, "no_such_field_x": 1})
    assert r.status_code == 200
    # A field vLLM knows, sent with its "unused" value, is accepted without a warning.
    r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 1, "watermarking": False})
    assert r.status_code == 200
    log = server.log_path.read_text()
    warned = [ln for ln in log.splitlines() if "present in the request but ignored" in ln]
    assert any("no_such_field_x" in ln for ln in warned), warned
    assert not any("watermarking" in ln for ln in warned), warned


# ---- endpoints ---------------------------------------------------------------------------
def test_models_retrieve_invocations_load_and_tokenizer_info(server, client, tok):
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    # /invocations routes by the body: the same answers as the endpoints themselves.
    comp = {"prompt": "import os", "max_tokens": 4, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    direct_comp = post(server, "/v1/completions", comp).json()["choices"][0]["text"]
    direct_chat = post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]
    r = post(server, "/invocations", comp).json()
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == direct_comp
    r = post(server, "/invocations", chat).json()
    assert r["object"] == "chat.completion" and r["choices"][0]["message"] == direct_chat
    r = post(server, "/invocations", {"neither": 1})
    assert r.status_code == 400 and "Cannot find suitable handler" in r.json()["error"]["message"]
    assert httpx.get(server.url("/ping")).status_code == 200

    # /load counts the requests in flight (a stream until its last byte).
    assert httpx.get(server.url("/load")).json() == {"server_load": 0}
    seen: list[int] = []
    # Long enough that the stream is still being sent when its first chunk has arrived.
    body = {"prompt": "while True:", "max_tokens": 96, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server.url("/v1/completions"), json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {") and not seen:
                    seen.append(httpx.get(server.url("/load")).json()["server_load"])
    assert seen == [1]
    assert httpx.get(server.url("/load")).json() == {"server_load": 0}

    info = httpx.get(server.url("/tokenizer_info")).json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == TEMPLATE


def test_tokenize_detokenize_and_the_server_chat_template(server, client, tok):
    text = "def heappush(heap, item):"
    r = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    bad = post(server, "/detokenize", {"tokens": [10**6]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]

    # Chat form: rendered with --chat-template (not the tokenizer's ChatML), then tokenised.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]

    rendered = jinja2.Template(TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert rendered != tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    r = post(server, "/tokenize", {"messages": messages}).json()
    assert r["tokens"] == tok.encode(rendered, add_special_tokens=False)
    res = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=2,
        temperature=0,
        extra_body={"return_prompt_text": True, "return_token_ids": True},
    )
    assert res.model_extra["prompt_text"] == rendered
    assert res.model_extra["prompt_token_ids"] == r["tokens"]
    assert res.usage.prompt_tokens == r["count"]


# ---- response content --------------------------------------------------------------------
def test_return_token_ids(server, client, tok):
    prompt = "class Stack:"
    res = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = res.choices[0].model_extra
    assert choice["prompt_token_ids"] == tok.encode(prompt)
    assert len(choice["token_ids"]) == res.usage.completion_tokens == 5
    assert tok.decode(choice["token_ids"]) == res.choices[0].text
    chunks = sse_chunks(
        server,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 5, "temperature": 0, "return_token_ids": True},
    )
    firsts = [c["choices"][0]["prompt_token_ids"] for c in chunks]
    assert firsts[0] == tok.encode(prompt) and all(p is None for p in firsts[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]

    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    ids = chat.choices[0].model_extra["token_ids"]
    assert (
        len(ids) == chat.usage.completion_tokens
        and tok.decode(ids) == chat.choices[0].message.content
    )
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens


def test_prompt_logprobs_equal_the_logprobs_of_generating_those_tokens(server, client):
    """prompt_logprobs (computed in the prefill) of tokens the model generated earlier equal
    the logprobs it reported when sampling them (computed in decode steps)."""
    prompt = [318, 288, 10, 90, 311]
    gen = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=1,
        extra_body={"return_token_ids": True},
    )
    gen_ids = gen.choices[0].model_extra["token_ids"]
    full = prompt + gen_ids
    res = client.completions.create(
        model=NAME, prompt=full, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    plp = res.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(full) and plp[0] is None
    for pos, tid in zip(plp[1:], full[1:]):
        assert str(tid) in pos and len(pos) >= 2  # the token itself + the top 2 (ranks 1, 2)
    want = gen.choices[0].logprobs.token_logprobs
    got = [plp[len(prompt) + i][str(t)]["logprob"] for i, t in enumerate(gen_ids)]
    assert got == pytest.approx(want, abs=2e-3)
    r = post(server, "/v1/completions", {"prompt": "a", "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_logprobs_are_raw_by_default(client):
    """vLLM's default logprobs_mode, raw_logprobs: the reported logprobs are the model's own,
    before temperature (and the other controls), so the top logprobs of the first position
    are the same at temperature 0.3 and 1.7 (processed_logprobs would scale them)."""
    kw = dict(model=NAME, prompt=[318, 288, 10, 90, 311], max_tokens=1, logprobs=5, seed=3)
    low = client.completions.create(temperature=0.3, **kw).choices[0].logprobs.top_logprobs[0]
    high = client.completions.create(temperature=1.7, **kw).choices[0].logprobs.top_logprobs[0]
    # Each holds the top 5 plus the sampled token when that one is not among them (at 1.7 it
    # may well not be), keyed by text (two tokens of one text share a key): the tokens in both
    # are at least the top 5 less a collision or two.
    common = low.keys() & high.keys()
    assert len(low) >= 4 and len(common) >= 4, (low, high)
    for t in common:
        assert low[t] == pytest.approx(high[t], abs=1e-4)


def test_json_allows_whitespace_by_default(client, tok):
    """As vLLM (xgrammar): a JSON schema allows free whitespace between tokens unless the
    request (or the server's --structured-outputs-config) sets disable_any_whitespace. A
    logit bias toward a space makes the model write spaces where the grammar lets it."""
    space = tok.encode(" ", add_special_tokens=False)
    assert len(space) == 1
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    kw = dict(model=NAME, prompt="x", max_tokens=6, temperature=0, logit_bias={space[0]: 100})

    def text(**so) -> str:
        body = {"structured_outputs": {"json": schema, **so}}
        return client.completions.create(extra_body=body, **kw).choices[0].text

    free, tight = text(), text(disable_any_whitespace=True)
    assert free.startswith("{ ") and free.strip(" ") == "{", free
    assert tight.startswith('{"a":'), tight


def test_completions_echo(server, client, tok):
    prompt = "import heapq"
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0)
    res = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    assert res.choices[0].text == prompt + plain.choices[0].text
    lp = res.choices[0].logprobs
    n_prompt = len(tok.encode(prompt))
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == res.choices[0].text
    only = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True)
    assert only.choices[0].text == prompt
    chunks = sse_chunks(
        server,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True},
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == res.choices[0].text


def test_chat_echo_continues_the_final_message(server, client):
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    kw = dict(
        model=NAME,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    plain = client.chat.completions.create(**kw)
    kw["extra_body"] = {**kw["extra_body"], "echo": True}
    echoed = client.chat.completions.create(**kw)
    assert echoed.choices[0].message.role == "assistant"
    assert echoed.choices[0].message.content == "The colour is" + plain.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == echoed.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"


# ---- streaming layout and usage ----------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_with_n_sends_one_choice_per_chunk(server, path):
    base = (
        {"prompt": "def f(x):"}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body = {**base, "n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    full = post(server, path, body).json()
    chunks = sse_chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    finished: dict[int, int] = {}
    for c in chunks[:-1]:
        assert len(c["choices"]) == 1, c  # vLLM's layout: each choice in its own chunk
        ch = c["choices"][0]
        piece = ch["text"] if "chat" not in path else ch["delta"].get("content") or ""
        texts[ch["index"]] = texts.get(ch["index"], "") + piece
        if ch["finish_reason"]:
            finished[ch["index"]] = finished.get(ch["index"], 0) + 1
    assert finished == {0: 1, 1: 1, 2: 1}
    key = "text" if "chat" not in path else "message"
    want = {c["index"]: c[key] if key == "text" else c[key]["content"] for c in full["choices"]}
    assert texts == want
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_continuous_usage_stats_only_with_include_usage(server):
    body = {"prompt": "x = 1", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    off = sse_chunks(
        server,
        "/v1/completions",
        {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
    )
    assert all(c.get("usage") is None for c in off)
    on = sse_chunks(
        server,
        "/v1/completions",
        {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    counts = [c["usage"]["completion_tokens"] for c in on[:-1]]
    assert (
        counts == sorted(counts) and counts[-1] == 4 and on[-1]["usage"]["completion_tokens"] == 4
    )


def test_usage_reports_cached_prompt_tokens(server, client):
    prompt = list(range(100, 140))  # 40 tokens: two full KV blocks can come from the cache
    kw = dict(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
    client.completions.create(**kw)
    res = client.completions.create(**kw)
    assert res.usage.prompt_tokens_details.cached_tokens == 32
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


# ---- errors, stop conditions, beam search ------------------------------------------------
def test_errors_name_the_field_and_the_server_keeps_serving(server, client):
    cases = [
        ({"prompt": "a", "structured_outputs": {"regex": "a["}}, "structured_outputs"),
        ({"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format"),
        ({"prompt": "a", "guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
        ({"prompt": "a", "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"prompt": "a", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"prompt": "a", "logprobs": -1}, "logprobs"),  # the whole vocabulary > max_logprobs
        ({"prompt": "a", "use_beam_search": True, "stream": True}, "use_beam_search"),
        ({"prompt": "a", "length_penalty": 2.0}, "length_penalty"),  # only for beam search
        ({"prompt": "a", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ]
    for body, field in cases:
        r = post(server, "/v1/completions", {"max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert field in r.json()["error"]["message"], (body, r.text)
    r = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",  # this server has no --enable-auto-tool-choice
        },
    )
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"], r.text
    res = client.completions.create(model=NAME, prompt="ok", max_tokens=2, logprobs=MAX_LOGPROBS)
    assert res.usage.completion_tokens == 2


def test_sampling_controls_over_http(server, client, tok):
    """The controls reach the sampler (their exact effect is tested against a brute-force
    reference in tests/e2e/test_logit_controls.py), and bad values are 400s naming them."""
    kw = dict(model=NAME, prompt="def f(x):", max_tokens=12, temperature=0)
    free = client.completions.create(**kw, extra_body={"return_token_ids": True})
    first = free.choices[0].token_ids[0]
    allowed = client.completions.create(
        **kw, extra_body={"allowed_token_ids": [5, 6], "return_token_ids": True}
    )
    assert set(allowed.choices[0].token_ids) <= {5, 6}
    banned = client.completions.create(
        **kw, logit_bias={str(first): -100}, extra_body={"return_token_ids": True}
    )
    assert banned.choices[0].token_ids[0] != first
    pen = client.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0)
    assert pen.choices[0].text != free.choices[0].text
    for body, field in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {str(10**6): 1}}, "logit_bias"),
    ]:
        r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, **body})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)


def test_min_tokens_holds_back_stop_strings(client):
    """Regression: a stop string used to end generation before min_tokens."""
    kw = dict(model=NAME, prompt="def f(x):", max_tokens=40, temperature=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True})
    stop = free.choices[0].text.split()[1][:4]  # text the model writes within a few tokens
    early = client.completions.create(**kw, stop=[stop])
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens < 15
    held = client.completions.create(**kw, stop=[stop], extra_body={"min_tokens": 15})
    assert held.usage.completion_tokens > 15
    assert held.choices[0].finish_reason in ("stop", "length")


def test_beam_search_over_http(server, client):
    body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    greedy = post(server, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]
    one = post(server, "/v1/completions", {**body, "use_beam_search": True, "n": 1}).json()
    assert one["choices"][0]["text"] == greedy["text"]  # a single beam is greedy search
    res = post(
        server, "/v1/completions", {**body, "use_beam_search": True, "n": 3, "logprobs": 1}
    ).json()
    texts = [c["text"] for c in res["choices"]]
    assert len(set(texts)) == 3 and res["usage"]["completion_tokens"] == 12
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in res["choices"]]
    assert scores == sorted(scores, reverse=True)  # best beam first
    # Beams scored by prefill steps, greedy by decode steps: equal up to bf16 rounding.
    assert scores[0] >= sum(greedy["logprobs"]["token_logprobs"]) - 2e-3


# ---- metrics -----------------------------------------------------------------------------
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
LATENCY += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKENS_1_2_5 = [1, 2, 5, 10, 20, 50, 100, 200]  # up to max_model_len = 256
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25]
    + [0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4]
    + [0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    + [16384],
    "vllm:e2e_request_latency_seconds": LATENCY,
    "vllm:request_queue_time_seconds": LATENCY,
    "vllm:request_inference_time_seconds": LATENCY,
    "vllm:request_prefill_time_seconds": LATENCY,
    "vllm:request_decode_time_seconds": LATENCY,
    "vllm:request_prompt_tokens": TOKENS_1_2_5,
    "vllm:request_generation_tokens": TOKENS_1_2_5,
    "vllm:request_max_num_generation_tokens": TOKENS_1_2_5,
    "vllm:request_params_max_tokens": TOKENS_1_2_5,
    "vllm:request_params_n": [1, 2, 5, 10, 20],
}
VLLM_TYPES = {
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
} | {name: "histogram" for name in VLLM_HISTOGRAMS}


def scrape(server: RemoteServer) -> tuple[dict, dict]:
    """(family name -> type, sample (name, sorted labels) -> value) of /metrics."""
    text = httpx.get(server.url("/metrics"), timeout=30).text
    types, samples = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    want = {"model_name": NAME, "engine": "0", **labels}
    key = (name, tuple(sorted(want.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_names_types_labels_buckets_and_counts(server):
    types, before = scrape(server)
    for name, kind in VLLM_TYPES.items():
        assert types.get(name) == kind, (name, types.get(name))
    for (name, labels), _ in before.items():
        if name.startswith("vllm:") and not name.startswith("vllm:cache_config_info"):
            assert dict(labels).get("model_name") == NAME and dict(labels)["engine"] == "0"
    for name, edges in VLLM_HISTOGRAMS.items():
        les = sorted(
            float(dict(lb)["le"]) for (n, lb) in before if n == name + "_bucket" and dict(lb)
        )
        assert les == [float(e) for e in edges] + [float("inf")], name
    info = [dict(lb) for (n, lb) in before if n == "vllm:cache_config_info"]
    assert info and info[0]["block_size"] == "16" and info[0]["engine"] == "0"

    # A known workload on the idle server: 1 sequence of 4 tokens from a 5-token prompt, then
    # n = 2 sequences of 3 tokens from a 3-token prompt (one engine token per step, no spec).
    common = {"temperature": 1.0, "seed": 1, "ignore_eos": True}
    post(server, "/v1/completions", {"prompt": [11, 12, 13, 14, 15], "max_tokens": 4, **common})
    post(server, "/v1/completions", {"prompt": [21, 22, 23], "max_tokens": 3, "n": 2, **common})
    _, after = scrape(server)
    d = lambda name, **lb: delta(before, after, name, **lb)
    assert d("vllm:request_success_total", finished_reason="length") == 3
    assert d("vllm:prompt_tokens_total") == 11 and d("vllm:generation_tokens_total") == 10
    for name in ("e2e_request_latency", "request_queue_time", "request_inference_time"):
        assert d(f"vllm:{name}_seconds_count") == 3, name
    for name in ("request_prefill_time", "request_decode_time", "time_to_first_token"):
        assert d(f"vllm:{name}_seconds_count") == 3, name
    assert d("vllm:inter_token_latency_seconds_count") == 3 + 2 * 2
    assert d("vllm:request_prompt_tokens_count") == 3 and d("vllm:request_prompt_tokens_sum") == 11
    assert d("vllm:request_prompt_tokens_bucket", le="2.0") == 0
    assert d("vllm:request_prompt_tokens_bucket", le="5.0") == 3
    assert d("vllm:request_generation_tokens_sum") == 10
    assert d("vllm:request_generation_tokens_bucket", le="2.0") == 0
    assert d("vllm:request_params_max_tokens_sum") == 10
    assert d("vllm:request_params_n_count") == 2 and d("vllm:request_params_n_sum") == 3
    assert d("vllm:request_params_n_bucket", le="1.0") == 1
    assert d("vllm:request_params_n_bucket", le="2.0") == 2
    assert d("vllm:request_max_num_generation_tokens_sum") == 4 + 3
    assert d("vllm:iteration_tokens_total_sum") == 11 + 10
    assert d("vllm:iteration_tokens_total_count") >= 4


def test_chat_template_flag_takes_a_file_or_the_template_itself(template_file):
    assert load_chat_template(template_file) == TEMPLATE
    inline = "{% for m in messages %}{{ m['content'] }}\\n{% endfor %}"  # escapes decoded
    assert load_chat_template(inline) == inline.replace("\\n", "\n")
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template("/no/such/chat_template.jinja")


def test_dtype_half_serves_in_bfloat16(tmp_path):
    """vLLM's harness starts a CPU server with --dtype half: it becomes ready, answers through
    the openai client, and says in its log that the model runs in bfloat16 (no fast fp16
    kernels on a CPU), as vLLM's CPU platform does."""
    log = tmp_path / "server.log"
    args = ["--dtype", "half", "--max-model-len", "128", "--served-model-name", NAME]
    with RemoteServer(str(DEFAULT_MODEL_DIR), args, log) as srv:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120)
        out = client.completions.create(model=NAME, prompt="hello", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
        assert "running the model in bfloat16" in log.read_text(errors="replace")
