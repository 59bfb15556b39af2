# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Fuzzing `vllm serve` (the tiny Llama at P = 2, mp worker processes) from its own
/openapi.json with schemathesis - every route: completions, chat, tokenize, detokenize, models,
health, ping, load, version, metrics, tokenizer_info, invocations - in positive (schema-valid)
and negative (schema-violating) modes, plus hypothesis strategies for SamplingParams (offline)
and for chat requests with images, tools and grammars. Every answer is a 2xx with a valid body
or a 4xx with an error body (a 400 naming the field it refuses, or the body as a whole);
never a 5xx. Throughout, /health answers 200 (polled from a thread, each poll with a deadline),
no worker process is lost, and the resident memory of the server and its workers stays flat
between the first and second half of the run.

Examples per route and mode: VLLM_FUZZ_EXAMPLES (default 12, a couple of minutes on 2 cores);
a longer hunt: VLLM_FUZZ_EXAMPLES=500 python -m pytest -s tests/entrypoints/test_fuzz_openapi.py.
The counts (examples run per route, server errors found) are printed."""

from __future__ import annotations

import base64
import collections
import contextlib
import io
import json
import math
import os
import sys
import threading

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from vllm import SamplingParams
from vllm.testing.remote_server import RemoteServer

schemathesis = pytest.importorskip("schemathesis")

NAME = "tiny"
EXAMPLES = int(os.environ.get("VLLM_FUZZ_EXAMPLES", "12"))
RSS_GROWTH_MIB = 64.0


@pytest.fixture
def report(request):
    """Print past pytest's output capture (the run's counts belong in the CI log)."""
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    capman = request.config.pluginmanager.getplugin("capturemanager")

    def write(text: str) -> None:
        # The test's output is captured (and dropped when it passes): write around it.
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            if reporter is not None:
                reporter.write_line(text)
            else:
                sys.stdout.write(text + "\n")

    return write


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    args = ["--served-model-name", NAME, "--max-model-len", "128", "--dtype", "float32",
            "-pp", "2", "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]  # fmt: skip
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    with RemoteServer(str(llama_dir), args, log) as srv:
        srv.wait_ready()
        yield srv


class HealthWatch:
    """Polls /health from a thread while the fuzz runs; every poll must be a 200 within its
    deadline."""

    def __init__(self, srv: RemoteServer) -> None:
        self.srv = srv
        self.polls = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10.0) as http:
            while not self._stop.wait(0.5):
                try:
                    r = http.get(self.srv.url("/health"))
                    if r.status_code != 200:
                        self.failures.append(f"status {r.status_code}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.polls += 1

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _field_named(body: object, err: dict) -> bool:
    """A 400 names what it refuses: its param, a field of the request in its message, or the
    body as a whole."""
    if err.get("param"):
        return True
    msg = str(err.get("message", "")).lower()
    if any(w in msg for w in ("body", "json", "request", "prompt", "messages")):
        return True
    return isinstance(body, dict) and any(str(k).lower() in msg for k in body)


def check_answer(status: int, headers: dict, text: str, body: object = None) -> str | None:
    """What is wrong with one answer (None: nothing)."""
    if status >= 500:
        return f"server error {status}: {text[:300]}"
    ctype = headers.get("content-type", "")
    if 200 <= status < 300:
        if ctype.startswith("text/event-stream"):
            events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return f"a stream without [DONE]: {text[-200:]}"
            for e in events[:-1]:
                if "error" in json.loads(e):
                    return f"an error event in a stream: {e[:300]}"
        elif ctype.startswith("application/json"):
            json.loads(text)
        return None
    if not ctype.startswith("application/json"):
        return f"{status} without a JSON error body: {text[:200]}"
    err = json.loads(text).get("error")
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"{status} with a malformed error body: {text[:300]}"
    if err["code"] != status or "Traceback" in err["message"]:
        return f"{status} error body: {text[:300]}"
    if status == 400 and not _field_named(body, err):
        return f"a 400 that names no field: {text[:300]}"
    return None


def _bounded(case) -> None:
    """Generation length is not what is fuzzed (max_model_len bounds it anyway): keep the
    default and oversized lengths short so the run stays within its budget."""
    body = getattr(case, "body", None)
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 8):
                body[key] = 4
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 4:
            body["n"] = 2


def test_schemathesis_every_route(server, report):
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    stages = [psutil.Process(p) for p in server.stage_pids()]
    assert len(stages) == 2
    counts: collections.Counter[str] = collections.Counter()
    problems: list[tuple[str, str]] = []
    rss: list[dict[str, float]] = []
    ops = [r.ok() for r in schema.get_all_operations()]
    labels = {op.label for op in ops}
    for route in ["POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
                  "POST /detokenize", "GET /v1/models", "GET /health", "GET /load"]:  # fmt: skip
        assert route in labels, sorted(labels)

    def runner(http: httpx.Client, op, mode, first: bool):
        @settings(
            max_examples=max(1, EXAMPLES // 2),
            deadline=None,
            database=None,
            derandomize=first,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.generate],
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case) -> None:
            _bounded(case)
            kw = case.as_transport_kwargs(base_url=server.base_url)
            r = http.request(
                kw["method"],
                kw["url"],
                headers=kw.get("headers"),
                params=kw.get("params"),
                json=kw.get("json"),
                content=kw.get("data") if "json" not in kw else None,
            )
            counts[op.label] += 1
            body = getattr(case, "body", None)
            issue = check_answer(r.status_code, dict(r.headers), r.text, body)
            if issue:
                problems.append((op.label, issue))

        return run

    with HealthWatch(server) as health, httpx.Client(timeout=120) as http:
        for half in range(2):
            for op in ops:
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    try:
                        runner(http, op, mode, half == 0)()
                    except Exception as e:
                        if type(e).__name__ != "Unsatisfiable":  # nothing to violate: fine
                            raise
            rss.append(server.rss_mib())
    errors = sum(1 for _, p in problems if p.startswith("server error"))
    report(
        f"\nschemathesis fuzz: {sum(counts.values())} requests; per route: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + f"; server errors: {errors}; other problems: {len(problems) - errors}; "
        f"/health polls: {health.polls}"
    )
    assert not problems, problems[:10]
    assert not health.failures, health.failures[:5]
    assert server.proc.poll() is None
    for p in stages:
        assert p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    growth = {k: rss[1][k] - rss[0][k] for k in rss[0]}
    assert all(g < RSS_GROWTH_MIB for g in growth.values()), (growth, rss)


# ---- hypothesis: SamplingParams ---------------------------------------------------------------
_floats = st.one_of(
    st.floats(-3, 3), st.sampled_from([0.0, 1.0, math.nan, math.inf, -math.inf, 1e300])
)
_ints = st.one_of(st.integers(-3, 40), st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, True]))
SAMPLING_FIELDS = {
    "n": _ints,
    "temperature": _floats,
    "top_p": _floats,
    "top_k": _ints,
    "min_p": _floats,
    "seed": _ints,
    "max_tokens": st.one_of(st.none(), _ints),
    "min_tokens": _ints,
    "presence_penalty": _floats,
    "frequency_penalty": _floats,
    "repetition_penalty": _floats,
    "stop": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": st.one_of(st.none(), st.lists(_ints, max_size=3)),
    "logprobs": st.one_of(st.none(), _ints),
    "prompt_logprobs": st.one_of(st.none(), _ints),
    "logit_bias": st.one_of(st.none(), st.dictionaries(_ints, _floats, max_size=2)),
    "allowed_token_ids": st.one_of(st.none(), st.lists(_ints, max_size=3)),
    "ignore_eos": st.one_of(st.booleans(), _ints),
}


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(kwargs=st.fixed_dictionaries({}, optional=SAMPLING_FIELDS))
def test_sampling_params_accept_or_name_the_field(kwargs):
    """Any combination either builds (and verifies) or is a ValueError / TypeError naming one
    of the fields it was given."""
    try:
        SamplingParams(**kwargs).verify()
    except (ValueError, TypeError) as e:
        named = getattr(e, "parameter", None)
        assert named in kwargs or any(k in str(e) for k in kwargs), (kwargs, e)


# ---- hypothesis: chat requests with images, tools and grammars -----------------------------------
def _png(w: int, h: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (w % 256, h % 256, 7)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


_image_urls = st.one_of(
    st.builds(_png, st.integers(1, 40), st.integers(1, 40)),
    st.sampled_from(["data:image/png;base64,AAAA", "data:image/png;base64,", "http://x.invalid/a.png",
                     "data:text/plain;base64,aGk=", "not a url"]),
)  # fmt: skip
_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)}),
        st.fixed_dictionaries(
            {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _image_urls})}
        ),
        st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "video_url", "x"])}),
    ),
    max_size=3,
)
_json_schemas = st.recursive(
    st.sampled_from(
        [{"type": "string", "maxLength": 4}, {"type": "integer"}, {"enum": ["a", "b"]},
         {"type": "boolean"}, {"$ref": "#/$defs/A"}, {"type": "nope"}, {}]
    ),
    lambda inner: st.one_of(
        st.builds(lambda p: {"type": "object", "properties": p, "additionalProperties": False},
                  st.dictionaries(st.sampled_from(["x", "y", "z"]), inner, max_size=2)),
        st.builds(lambda i: {"type": "array", "items": i, "maxItems": 2}, inner),
    ),
    max_leaves=4,
)  # fmt: skip
_tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "function", "code"]),
            "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["f", "g", ""])},
                optional={
                    "parameters": st.one_of(
                        _json_schemas.map(
                            lambda s: {
                                "type": "object",
                                "properties": {"a": s},
                                "$defs": {"A": {"type": "integer"}},
                            }  # fmt: skip
                        ),
                        st.just("not a schema"),
                    )
                },
            ),
        }
    ),
    max_size=2,
)
_named = st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "h"])})
_tool_choice = st.one_of(
    st.sampled_from(["auto", "none", "required", "sometimes"]),
    st.fixed_dictionaries({"type": st.just("function"), "function": _named}),
)
_grammars = st.one_of(
    st.fixed_dictionaries({"regex": st.sampled_from(["[a-z]{1,3}", "[", "(a|b)*c", ""])}),
    st.fixed_dictionaries({"choice": st.lists(st.text(max_size=3), max_size=3)}),
    st.fixed_dictionaries({"json": _json_schemas}),
    st.fixed_dictionaries(
        {"grammar": st.sampled_from(['root ::= "a" | "b"', "root ::= (", 'start: "x"'])}
    ),
    st.fixed_dictionaries({"json_object": st.booleans()}),
)
CHAT_FIELDS = {
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": st.booleans(),
    "structured_outputs": _grammars,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "yaml"])}),
        st.builds(
            lambda s: {"type": "json_schema", "json_schema": {"name": "s", "schema": s}},
            _json_schemas,
        ),
    ),  # fmt: skip
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**32),
    "n": st.integers(1, 2),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 3),
    "stream": st.booleans(),
    "stop": st.lists(st.text(max_size=3), max_size=2),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "x"]), st.booleans()
    ),
}


def chat_bodies():
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"]),
         "content": st.one_of(st.text(max_size=16), _parts)}
    )  # fmt: skip
    return st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=3)}, optional=CHAT_FIELDS
    ).map(lambda b: {**b, "model": NAME, "max_tokens": 4})


def test_chat_images_tools_grammars_never_5xx(server, report):
    stages = [psutil.Process(p) for p in server.stage_pids()]
    statuses: collections.Counter[int] = collections.Counter()
    problems: list[str] = []
    with HealthWatch(server) as health, httpx.Client(timeout=120) as http:

        @settings(
            max_examples=max(10, EXAMPLES * 3),
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(body=chat_bodies())
        def run(body) -> None:
            r = http.post(server.url("/v1/chat/completions"), json=body)
            statuses[r.status_code] += 1
            issue = check_answer(r.status_code, dict(r.headers), r.text, body)
            if issue:
                problems.append(issue)

        run()
    report(
        f"\nchat fuzz (images, tools, grammars): {sum(statuses.values())} requests, statuses "
        f"{dict(sorted(statuses.items()))}; server errors: "
        f"{sum(v for k, v in statuses.items() if k >= 500)}"
    )
    assert not problems, problems[:10]
    assert not health.failures, health.failures[:5]
    for p in stages:
        assert p.is_running() and p.status() != psutil.STATUS_ZOMBIE
