# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""No request can take `vllm serve` down, at P = 1 and at P = 2 with MTP on the bundled model.

Every hostile request below gets its exact status and error body, and a normal request on the
same server succeeds right after it. A property-style fuzz of both endpoints never gets a 5xx or
kills a stage. A soak at P = 2 keeps every stage's memory flat. A stage that hangs (SIGSTOP)
fails the in-flight request, turns /health to 503 and ends the server, leaving no process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from vllm.config import DEFAULT_MODEL_DIR
from vllm.testing.engine_utils import resume_and_kill
from vllm.testing.remote_server import RemoteServer, serving

API_KEY = "sk-reliability"
NAME = "tiny"
MAX_MODEL_LEN = 256
TEMPLATE_TIMEOUT_S = 4
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
COMMON = [
    "--served-model-name",
    NAME,
    "--api-key",
    API_KEY,
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--speculative-config",
    MTP,
    "--disable-uvicorn-access-log",
]
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HOSTILE_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
    "{% endfor %}{% endfor %}{% endfor %}"
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """P = 1 (accepting request chat templates) and P = 2, both the bundled model with MTP."""
    logs = tmp_path_factory.mktemp("reliability")
    env = {"VLLM_CHAT_TEMPLATE_TIMEOUT_S": str(TEMPLATE_TIMEOUT_S)}
    started = {
        "p1": RemoteServer("", [*COMMON, "--trust-request-chat-template"], logs / "p1.log", env),
        "p2": RemoteServer("", [*COMMON, "-pp", "2"], logs / "p2.log", env),
    }
    with serving(started):
        for srv in started.values():
            srv.wait_ready()
        yield started


@pytest.fixture(scope="module", params=["p1", "p2"])
def srv(request, servers) -> RemoteServer:
    return servers[request.param]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))


@pytest.fixture(scope="module")
def byte_limit(tokenizer) -> int:
    # Independent of the server's code: longest vocabulary entry, times max_model_len, times 2.
    longest = max(len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab())
    return MAX_MODEL_LEN * longest * 2


def post(srv: RemoteServer, path: str, body, headers: dict | None = None) -> httpx.Response:
    """POST a JSON body (NaN / Infinity allowed, as a raw client may send them) or raw bytes."""
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    h = {**AUTH, "content-type": "application/json", **(headers or {})}
    return httpx.post(srv.url(path), content=content, headers=h, timeout=120)


def assert_serves(srv: RemoteServer) -> None:
    """A normal request succeeds and the server is healthy."""
    r = post(srv, "/v1/completions", {"model": NAME, "prompt": "def f(x):", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(srv.url("/health"), timeout=30).status_code == 200
    for pid in srv.stage_pids():
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def err(message: str, status: int = 400, param: str | None = None) -> dict:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}
    return {"error": {"message": message, "type": kinds[status], "param": param, "code": status}}


def _le(field: str) -> str:
    return f"{field}: Input should be less than or equal to {INT64_MAX}"


def _ge(field: str) -> str:
    return f"{field}: Input should be greater than or equal to {INT64_MIN}"


MSGS = [{"role": "user", "content": "hi"}]
# (name, body fields beyond the prompt / messages, expected message, param)
NUMERIC_CASES = [
    ("seed>int64", {"seed": INT64_MAX + 1}, _le("seed"), "seed"),
    ("seed<int64", {"seed": INT64_MIN - 1}, _ge("seed"), "seed"),
    ("top_k>int64", {"top_k": INT64_MAX + 1}, _le("top_k"), "top_k"),
    (
        "min_tokens>int64",
        {"min_tokens": INT64_MAX + 1, "max_tokens": None},
        _le("min_tokens"),
        "min_tokens",
    ),
    ("max_tokens>int64", {"max_tokens": 2**64}, _le("max_tokens"), "max_tokens"),
    ("stop_token_id>int64", {"stop_token_ids": [2**63]}, _le("stop_token_ids.0"), "stop_token_ids"),
    (
        "stop_token_id bool",
        {"stop_token_ids": [True]},
        "stop_token_ids.0: must be an integer, not a boolean",
        "stop_token_ids",
    ),
    (
        "temperature NaN",
        {"temperature": math.nan},
        "temperature: Input should be a finite number",
        "temperature",
    ),
    ("top_p inf", {"top_p": math.inf}, "top_p: Input should be a finite number", "top_p"),
    ("min_p -inf", {"min_p": -math.inf}, "min_p: Input should be a finite number", "min_p"),
    ("n=17", {"n": 17}, "n: Input should be less than or equal to 16", "n"),
    ("n bool", {"n": True}, "n: must be an integer, not a boolean", "n"),
    (
        "min_tokens>max_tokens",
        {"min_tokens": 5, "max_tokens": 2},
        "SamplingParams.min_tokens must be <= max_tokens=2, got 5",
        "min_tokens",  # a VLLMValidationError names its field
    ),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "name, fields, message, param", NUMERIC_CASES, ids=[c[0] for c in NUMERIC_CASES]
)
def test_out_of_range_numbers_get_400(srv, path, name, fields, message, param):
    base = {"prompt": "a"} if path == "/v1/completions" else {"messages": MSGS}
    r = post(srv, path, {"model": NAME, "max_tokens": 2, **base, **fields})
    assert (r.status_code, r.json()) == (400, err(message, 400, param))
    assert_serves(srv)


def test_seed_at_int64_max_with_n2(srv):
    """seed = 2**63 - 1 with n = 2 works: the second completion's seed wraps to -2**63, so it
    is the completion a request with that seed and n = 1 gets."""
    body = {"model": NAME, "prompt": "import os", "max_tokens": 6, "temperature": 1.0}
    r = post(srv, "/v1/completions", {**body, "seed": INT64_MAX, "n": 2})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    again = post(srv, "/v1/completions", {**body, "seed": INT64_MAX, "n": 2}).json()
    assert [c["text"] for c in sorted(again["choices"], key=lambda c: c["index"])] == texts
    wrapped = post(srv, "/v1/completions", {**body, "seed": INT64_MIN}).json()
    assert wrapped["choices"][0]["text"] == texts[1]
    assert_serves(srv)


def test_bad_prompts_get_400(srv, byte_limit):
    cases = [
        (
            {"prompt": [True, False]},
            err("prompt[0] must be a token id (an integer), got a boolean", 400, "prompt"),
        ),
        (
            {"prompt": [[1, 2], [3, False]]},
            err("prompt[1][1] must be a token id (an integer), got a boolean", 400, "prompt"),
        ),
        (
            {"prompt": [1, "a"]},
            err(
                "prompt: must be a string, a list of strings, a list of token ids (integers) "
                "or a list of token-id lists",
                400,
                "prompt",
            ),
        ),
        ({"prompt": []}, err("prompt: must not be empty", 400, "prompt")),
        (
            {"prompt": [2**64]},
            err(f"token id {2**64} is out of vocabulary (vocab_size=2048)", 400, "prompt"),
        ),
        (
            {"prompt": "\ud800 lone surrogate"},
            err("the prompt is not valid Unicode text: surrogates not allowed at position 0"),
        ),
        (
            {"prompt": "x" * (10 << 20)},
            err(
                f"the prompt has {10 << 20} bytes; at most {byte_limit} bytes are accepted "
                f"(max_model_len={MAX_MODEL_LEN} tokens)"
            ),
        ),
    ]
    for fields, body in cases:
        r = post(srv, "/v1/completions", {"model": NAME, "max_tokens": 2, **fields})
        assert (r.status_code, r.json()) == (400, body), fields.get("prompt", "")[:20]
        assert_serves(srv)
    big_chat = {"model": NAME, "messages": [{"role": "user", "content": "y" * (10 << 20)}]}
    size = (10 << 20) + len("roleuser") + len("content")
    r = post(srv, "/v1/chat/completions", big_chat)
    assert (r.status_code, r.json()) == (
        400,
        err(
            f"the messages have {size} bytes; at most {byte_limit} bytes are accepted "
            f"(max_model_len={MAX_MODEL_LEN} tokens)",
            400,
            "messages",
        ),
    )
    assert_serves(srv)


def test_big_prompt_does_not_stall_other_streams(srv):
    """A stream keeps going, to its last token, while a 10 MB prompt is refused."""
    body = {
        "model": NAME,
        "prompt": "for i in range(",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = {}
    refused = {}

    def on_first_event() -> None:
        r = post(srv, "/v1/completions", {"model": NAME, "prompt": "z" * (10 << 20)})
        refused["status"] = r.status_code

    with httpx.Client(timeout=120, headers=AUTH) as http:
        with http.stream("POST", srv.url("/v1/completions"), json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "status" not in refused:
                    on_first_event()
                if chunk.get("usage"):
                    usage = chunk["usage"]
    assert refused["status"] == 400
    assert usage["completion_tokens"] == 24
    assert_serves(srv)


def test_unknown_model_is_404_and_auth_covers_unknown_routes(srv):
    r = post(srv, "/v1/completions", {"model": "no-such-model", "prompt": "a"})
    assert (r.status_code, r.json()) == (
        404,
        err("The model `no-such-model` does not exist.", 404, "model"),
    )
    client = openai.OpenAI(base_url=srv.url("/v1"), api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="a", max_tokens=1)
    for method, path in [("GET", "/v1/no-such-route"), ("POST", "/v1/a/b/c"), ("GET", "/v1")]:
        r = httpx.request(method, srv.url(path), timeout=30)
        assert (r.status_code, r.json()) == (
            401,
            err("Unauthorized: missing or wrong API key", 401),
        ), path
        r = httpx.request(method, srv.url(path), headers=AUTH, timeout=30)
        assert r.status_code in (404, 405), (path, r.status_code)
    assert httpx.get(srv.url("/health"), timeout=30).status_code == 200  # not under /v1
    assert_serves(srv)


def test_chat_template_in_request(servers, tokenizer):
    """Refused unless the server trusts request templates; then rendered in the sandbox, and a
    template that would run for hours is stopped at the time limit while the server serves."""
    simple = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    body = {"model": NAME, "messages": MSGS, "max_tokens": 2, "chat_template": simple}
    r = post(servers["p2"], "/v1/chat/completions", body)
    assert (r.status_code, r.json()) == (
        400,
        err(
            "chat_template is not accepted in requests: this server renders only its own chat "
            "template (start it with --trust-request-chat-template to allow request-supplied "
            "templates)",
            400,
            "chat_template",
        ),
    )
    assert_serves(servers["p2"])

    p1 = servers["p1"]
    r = post(p1, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    expected = tokenizer.encode("[user]hi", add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(expected)

    for kwargs, key in [({"tokenize": False}, "'tokenize'"), ({"chat_template": "x"}, None)]:
        r = post(p1, "/v1/chat/completions", {**body, "chat_template_kwargs": kwargs})
        key = key or "'chat_template'"
        assert (r.status_code, r.json()) == (
            400,
            err(f"chat_template_kwargs may not set {key}", 400, "chat_template_kwargs"),
        )
    r = post(p1, "/v1/chat/completions", {**body, "chat_template": "{{ ''.__class__.__mro__ }}"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "could not apply the chat template: SecurityError: access to attribute '__class__'"
    )

    hostile: dict = {}

    def send_hostile() -> None:
        hostile["r"] = post(p1, "/v1/chat/completions", {**body, "chat_template": HOSTILE_TEMPLATE})

    t = threading.Thread(target=send_hostile)
    t.start()
    try:
        # Served while the hostile template renders: the event loop is not blocked.
        assert httpx.get(p1.url("/health"), timeout=60).status_code == 200
        assert_serves(p1)
    finally:
        t.join(timeout=120)
    assert (hostile["r"].status_code, hostile["r"].json()) == (
        400,
        err(f"the chat template did not finish rendering within {TEMPLATE_TIMEOUT_S} s"),
    )
    r = post(p1, "/v1/chat/completions", body)  # a fresh sandbox renders the next one
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)
    assert_serves(p1)


def _metrics(srv: RemoteServer) -> list:
    text = httpx.get(srv.url("/metrics"), timeout=30).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _abort_count(srv: RemoteServer) -> float:
    return sum(
        s.value
        for s in _metrics(srv)
        if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort"
    )


def test_metrics_label_and_aborts(srv):
    labelled = [s for s in _metrics(srv) if "model_name" in s.labels]
    assert labelled and {s.labels["model_name"] for s in labelled} == {NAME}
    before = _abort_count(srv)
    body = {"model": NAME, "prompt": "while True:", "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(timeout=60, headers=AUTH) as http:
        with http.stream("POST", srv.url("/v1/completions"), json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for n, _ in enumerate(ln for ln in r.iter_lines() if ln.startswith("data: {")):
                if n >= 1:
                    break  # closing the connection mid-stream aborts the request

    def idle() -> bool:
        gauges = {
            s.name: s.value
            for s in _metrics(srv)
            if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        }
        return not any(gauges.values()) and _abort_count(srv) > before

    _wait_until(idle, "the aborted request to be counted")
    assert _abort_count(srv) == before + 1
    assert_serves(srv)


def _wait_until(cond, what: str, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_port_out_of_range_exits_with_one_line():
    res = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "vllm serve: error: argument --port: must be an integer in [0, 65535], got '99999'"
    ]


# ---- fuzz -----------------------------------------------------------------------------------
_INT_EDGES = [0, 1, -1, 2, 16, 17, 20, 21, 2**31, 2**53 + 1, INT64_MAX, INT64_MAX + 1]
_INT_EDGES += [INT64_MIN, INT64_MIN - 1, 2**64, -(2**64), 10**30]
_ints = st.one_of(st.sampled_from(_INT_EDGES), st.integers(-5, 40))
_floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-300, 1e308, 3.5e38, 0.5, 1.0, 2.0]),
    st.floats(-3, 3),
)
_texts = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "<|im_start|>", "\u202e", "😀" * 20]),
)
_junk = st.one_of(
    st.none(),
    st.booleans(),
    _ints,
    _floats,
    _texts,
    st.lists(_ints, max_size=4),
    st.dictionaries(_texts, _ints, max_size=2),
)
_token_lists = st.lists(st.one_of(st.integers(0, 2047), st.sampled_from([True, -1, 2048, 2**63])))
_prompts = st.one_of(
    _texts,
    st.lists(_texts, max_size=3),
    _token_lists.filter(lambda x: len(x) < 40),
    st.lists(st.lists(st.integers(0, 2047), max_size=8), max_size=3),
    st.just("w " * 30000),
    _junk,
)
_content = st.one_of(
    _texts,
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": _texts}),
        max_size=2,
    ),
    _junk,
)
_messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), _junk)},
            optional={"content": _content, "name": _texts},
        ),
        max_size=3,
    ),
    _junk,
)
_COMMON_FIELDS = {
    "model": st.one_of(st.just(NAME), _junk),
    "n": st.one_of(st.sampled_from([1, 2, 16]), _junk),
    "temperature": st.one_of(_floats, _junk),
    "top_p": st.one_of(_floats, _junk),
    "top_k": st.one_of(_ints, _junk),
    "min_p": st.one_of(_floats, _junk),
    "seed": st.one_of(_ints, _junk),
    "stop": st.one_of(_texts, st.lists(_texts, max_size=3), _junk),
    "stop_token_ids": st.one_of(_token_lists.filter(lambda x: len(x) < 5), _junk),
    "ignore_eos": st.one_of(st.booleans(), _junk),
    "min_tokens": st.one_of(_ints, _junk),
    "max_tokens": st.one_of(st.sampled_from([1, 3, INT64_MAX]), _ints, _junk),
    "stream": st.one_of(st.booleans(), _junk),
    "stream_options": st.one_of(
        st.fixed_dictionaries(
            {}, optional={"include_usage": _junk, "continuous_usage_stats": _junk}
        ),
        _junk,
    ),
    "logit_bias": st.one_of(st.dictionaries(_texts, _floats, max_size=2), _junk),
    "presence_penalty": st.one_of(_floats, _junk),
    "best_of": st.one_of(_ints, _junk),
    "skip_special_tokens": st.one_of(st.booleans(), _junk),
}
_ENDPOINT_FIELDS = {
    "/v1/completions": {
        "prompt": _prompts,
        "logprobs": st.one_of(_ints, _junk),
        "echo": st.one_of(st.booleans(), _junk),
        "suffix": _junk,
    },
    "/v1/chat/completions": {
        "messages": _messages,
        "logprobs": st.one_of(st.booleans(), _junk),
        "top_logprobs": st.one_of(_ints, _junk),
        "max_completion_tokens": st.one_of(_ints, _junk),
        "add_generation_prompt": st.one_of(st.booleans(), _junk),
        "continue_final_message": st.one_of(st.booleans(), _junk),
        "chat_template_kwargs": st.one_of(st.dictionaries(_texts, _junk, max_size=2), _junk),
        "response_format": _junk,
    },
}


def _bodies(path: str):
    required_key = "prompt" if path == "/v1/completions" else "messages"
    optional = {**_COMMON_FIELDS, **_ENDPOINT_FIELDS[path]}
    value = optional.pop(required_key)
    return st.one_of(
        st.fixed_dictionaries({required_key: value}, optional=optional).map(_bounded),
        st.sampled_from([b"", b"{", b"[]", b"null", b'{"prompt": NaN}', b"\xff\xfe", b"1e999"]),
    )


def _bounded(body: dict) -> dict:
    # Generation length is not what is fuzzed: without a length, stop after a few tokens
    # (the unbounded defaults are exercised by the explicit cases above).
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 3
    return body


def _check_fuzz_response(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        err_body = r.json()["error"]
        assert set(err_body) == {"message", "type", "param", "code"}
        assert err_body["code"] == r.status_code and "Traceback" not in err_body["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            assert "error" not in json.loads(e), e


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzz_never_5xx_never_a_dead_stage(srv, path):
    stages = [psutil.Process(p) for p in srv.stage_pids()]
    with httpx.Client(timeout=120, headers={**AUTH, "content-type": "application/json"}) as http:

        @settings(
            max_examples=60,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(body=_bodies(path))
        def check(body) -> None:
            content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True)
            _check_fuzz_response(http.post(srv.url(path), content=content))

        check()
    assert srv.proc.poll() is None
    for p in stages:
        assert p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    assert_serves(srv)


# ---- memory under load at P = 2 ---------------------------------------------------------------
_load_ids = itertools.count()  # every load request of the module gets its own prompt


def _run_load(srv: RemoteServer, num_requests: int, prompt_len: int) -> None:
    """num_requests greedy requests, 8 at a time, each with a prompt no earlier one started with
    (no prefix-cache hits: every token goes through every stage)."""
    ids = [next(_load_ids) for _ in range(num_requests)]
    assert ids[-1] < 2000  # distinct first tokens

    async def main() -> None:
        sem = asyncio.Semaphore(8)

        async def one(client: httpx.AsyncClient, i: int) -> None:
            body = {
                "model": NAME,
                "prompt": [(i * 7 + j) % 2000 + 10 for j in range(prompt_len)],
                "max_tokens": 2,
                "ignore_eos": True,
                "temperature": 0,
            }
            async with sem:
                r = await client.post(srv.url("/v1/completions"), json=body)
            assert r.status_code == 200, r.text

        async with httpx.AsyncClient(timeout=300, headers=AUTH) as client:
            await asyncio.gather(*(one(client, i) for i in ids))

    asyncio.run(main())


def test_soak_p2_memory_stays_flat(servers):
    """Long-prompt requests through two stages with MTP: after a warm-up, no process grows.
    Leaks this has caught: stage 0 keeping every step's hidden states (~0.3 MiB a request
    here), and oneDNN's / ideep's per-GEMM-shape caches filling for thousands of requests
    (~200 MiB a stage here, bf16; now bounded by VLLM_CPU_ONEDNN_CACHE_CAPACITY).

    Start-up makes the pools resident and runs a warm-up step (tests/v1/worker/
    test_resident_memory.py holds that), so what remains is allocator noise (freed pages kept
    or returned), which does not grow with the load; a leak does. Memory is sampled after each
    of three short rounds before and after a long load, and the lower sample of each side is
    compared: a one-off bump does not count, the long load's leak does."""
    srv = servers["p2"]
    prompt_len = MAX_MODEL_LEN - 8
    _run_load(srv, 30, prompt_len)  # warm-up: allocator pools, caches, lazy imports

    def sample_min() -> dict[str, float]:
        samples = []
        for _ in range(3):
            _run_load(srv, 16, prompt_len)
            samples.append(srv.rss_mib())
        assert all(len(s) == 3 for s in samples), samples  # the API server and both stages
        return {p: min(s[p] for s in samples) for p in samples[0]}

    before = sample_min()
    _run_load(srv, 120, prompt_len)  # ~30k new tokens through stage 0
    after = sample_min()
    growth = {p: after[p] - before[p] for p in before}
    # Measured (AMD EPYC, AVX512-BF16): within +-10 MiB now; with the
    # hidden-states leak back stage 0 grew by 50-63 MiB, with unbounded oneDNN caches 200+.
    assert all(g < 20.0 for g in growth.values()), (growth, before, after)
    assert_serves(srv)


# ---- a hung stage -----------------------------------------------------------------------------
def test_stopped_stage_fails_requests_and_server_exits(llama_dir, tmp_path):
    """SIGSTOP the last stage mid-stream: after VLLM_PP_STEP_TIMEOUT_S the stream gets a short
    503 error event, /health is 503 (or the server is gone), the server exits 1 and no stage
    process is left."""
    srv = RemoteServer(
        str(llama_dir),
        ["-pp", "2", "--max-model-len", "128", "--dtype", "float32"],
        tmp_path / "hang.log",
        env={"VLLM_PP_STEP_TIMEOUT_S": "3"},
    )
    stages: list[psutil.Process] = []
    try:
        srv.wait_ready()
        stages = [psutil.Process(p) for p in srv.stage_pids()]
        assert len(stages) == 2
        body = {
            "prompt": "for i in range(",
            "max_tokens": 100,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        events = []
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", srv.url("/v1/completions"), json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:
                            os.kill(stages[1].pid, signal.SIGSTOP)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        message = error["message"]
        assert "VLLM_PP_STEP_TIMEOUT_S" in message and f"pid {stages[1].pid}) is stopped" in message
        assert "Traceback" not in message and ".py" not in message and "\n" not in message
        try:
            assert httpx.get(srv.url("/health"), timeout=30).status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert srv.proc.wait(timeout=60) == 1, srv.log_tail()
        _, alive = psutil.wait_procs(stages, timeout=30)
        assert not alive, f"orphans left behind: {alive}"
    finally:
        resume_and_kill(stages)
        srv.stop(timeout=30)
