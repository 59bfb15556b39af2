# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Data parallelism with the mp backend (one process per replica), on real processes: DP = 2
gives DP = 1's tokens (greedy, seeded, and unseeded - seeds are drawn by the front end in
request order), both replicas serve and the `engine`-labelled metrics add up to the sum; a
replica killed before its requests produced anything: they are retried on the other replica
and still give DP = 1's tokens; `vllm serve -dp 2` behind the openai client answers like
DP = 1, /load and /metrics show both replicas, and killing one replica mid-stream fails only
its stream with an error naming the replica while the other replica keeps answering; at
DP = 2 x PP = 2 a killed stage worker of one replica fails that replica's running requests
(naming it) while the other replica finishes its own and keeps serving."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import psutil
import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts

MAX_TOKENS = 8
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4, disable_log_stats=False)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PARAMS = {"greedy": GREEDY, "seeded": SEEDED, "unseeded": UNSEEDED}
PROMPTS = make_prompts(512, [5, 17, 9, 30, 12, 3, 22, 8], seed=3)

pytestmark = pytest.mark.usefixtures("pp_forkserver")


def _gen(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], list[str]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]


def _gen_all(llm: LLM) -> dict[str, tuple[list[list[int]], list[str]]]:
    """Each sampling mode in turn on one engine (unseeded sampling depends on the engine's
    draws so far: the same order on both sides)."""
    return {name: _gen(llm, params) for name, params in PARAMS.items()}


@pytest.fixture(scope="module")
def dp1(llama_dir) -> dict[str, tuple[list[list[int]], list[str]]]:
    """DP = 1 (one in-process engine): tokens and texts per sampling mode."""
    llm = LLM(model=llama_dir, **COMMON)
    try:
        return _gen_all(llm)
    finally:
        llm.shutdown()


def _gone(pids: list[int]) -> None:
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"processes left after shutdown: {alive}"


def _generation_tokens(llm: LLM) -> tuple[dict[str, float], list[float]]:
    """vllm:generation_tokens per `engine` label, and the unlabelled sum."""
    per_engine, total = {}, []
    for m in llm.get_metrics():
        if m.name == "vllm:generation_tokens":
            if "engine" in m.labels:
                per_engine[m.labels["engine"]] = m.value
            else:
                total.append(m.value)
    return per_engine, total


def test_dp2_mp_equals_dp1(llama_dir, dp1):
    llm = LLM(model=llama_dir, data_parallel_size=2, **COMMON)
    try:
        engine = llm.llm_engine
        pids = [r.process.pid for r in engine.replicas]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        got = _gen_all(llm)
        per_engine, total = _generation_tokens(llm)
    finally:
        llm.shutdown()
    _gone(pids)
    assert got == dp1
    # Both replicas served (fewest outstanding tokens), and the sum is the whole run.
    assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0, per_engine
    assert total == [sum(per_engine.values())] == [len(PARAMS) * len(PROMPTS) * MAX_TOKENS]


def test_requests_of_a_replica_killed_before_any_output_are_retried(llama_dir, dp1):
    llm = LLM(model=llama_dir, data_parallel_size=2, **COMMON)
    try:
        engine = llm.llm_engine
        victim = engine.replicas[1].process
        # Stopped first: the requests routed to it can produce nothing before it dies.
        os.kill(victim.pid, signal.SIGSTOP)
        ids = []
        for p in PROMPTS:
            rid = engine.next_request_id()
            engine.add_request(rid, {"prompt_token_ids": p}, SEEDED)
            ids.append(rid)
        on_victim = [rid for rid in ids if engine._requests[rid].replica == 1]
        assert on_victim, "the router sent nothing to replica 1"
        victim.kill()
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        status = engine.replica_status()
        assert [s["alive"] for s in status] == [True, False]
        assert "died" in status[1]["error"]
        assert [done[rid] for rid in ids] == dp1["seeded"][0]
    finally:
        llm.shutdown()


def test_a_killed_worker_fails_only_its_replica(llama_dir, dp1):
    """DP = 2 x PP = 2: a stage worker of replica 1 killed mid-run fails replica 1's running
    requests with an error naming it; replica 0's requests finish with DP = 1's tokens, its
    workers keep serving new requests, and replica 1's processes are gone."""
    llm = LLM(model=llama_dir, data_parallel_size=2, pipeline_parallel_size=2, **COMMON)
    engine = llm.llm_engine
    try:
        engine.raise_failures = False  # failures handed out per request, as AsyncLLM takes them
        workers = engine.worker_pids()
        assert all(len(w) == 2 for w in workers.values()), workers
        replica1 = [engine.replicas[1].process.pid, *workers[1]]
        long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        ids = []
        for p in PROMPTS:
            rid = engine.next_request_id()
            engine.add_request(rid, {"prompt_token_ids": p}, long)
            ids.append(rid)
        on1 = {rid for rid in ids if engine._requests[rid].replica == 1}
        assert on1 and len(on1) < len(ids)
        done: dict[str, list[int]] = {}
        failed: dict[str, BaseException] = {}

        def step() -> None:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            failed.update(engine.pop_failures())

        while not any(engine._requests[rid].delivered for rid in on1):
            step()
        delivered = {rid for rid in on1 if engine._requests[rid].delivered}
        psutil.Process(workers[1][1]).kill()  # replica 1's second pipeline stage
        while engine.has_unfinished_requests():
            step()
        assert delivered <= set(failed) <= on1, (delivered, failed)
        for error in failed.values():
            assert "data-parallel replica 1 (engine 1) died" in str(error), error
        for i, rid in enumerate(ids):
            if rid not in failed:
                assert done[rid][:MAX_TOKENS] == dp1["greedy"][0][i]
        _gone(replica1)
        assert [s["alive"] for s in engine.replica_status()] == [True, False]
        # Replica 0 alone answers what DP = 1 answers.
        assert _gen(llm, GREEDY)[0] == dp1["greedy"][0]
    finally:
        llm.shutdown()
    _gone(workers[0])


def test_serve_dp2_openai_client_and_a_dead_replica(llama_dir, dp1, tmp_path):
    import openai

    from vllm.testing.remote_server import RemoteServer

    args = ["-dp", "2", "--dtype", "float32", "--max-model-len", "512",
            "--disable-uvicorn-access-log"]  # fmt: skip
    srv = RemoteServer(str(llama_dir), args, tmp_path / "serve.log")
    started: list[psutil.Process] = []
    try:
        srv.wait_ready()
        started = srv.children()
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120)
        for prompt, want, want_text in zip(PROMPTS, *dp1["greedy"]):
            res = client.completions.create(
                model=str(llama_dir),
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True},
            )
            assert len(res.choices[0].logprobs.tokens) == len(want)
            assert res.choices[0].text == want_text
        metrics = httpx.get(srv.url("/metrics")).text
        assert 'engine="0"' in metrics and 'engine="1"' in metrics
        engines = httpx.get(srv.url("/load")).json()["engines"]
        assert [e["alive"] for e in engines] == [True, True]
        victim = psutil.Process(engines[1]["pid"])

        # A long stream (replica 0, the least loaded at a tie), then one on replica 1, killed
        # mid-stream.
        body = {"model": str(llama_dir), "prompt": "for i in range(", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        first: dict[str, list[str]] = {}
        got_first = threading.Event()

        def read_first() -> None:
            with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=120) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        got_first.set()
                first["events"] = events

        t = threading.Thread(target=read_first)
        t.start()
        assert got_first.wait(120)
        with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=120) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        victim.kill()
        t.join(120)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503, error
        assert "data-parallel replica 1" in error["message"], error
        # The other replica's stream ran to its end.
        chunks = [json.loads(e) for e in first["events"][:-1]]
        assert first["events"][-1] == "[DONE]" and "error" not in chunks[-1], chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # And it keeps answering new requests, as DP = 1 does.
        res = client.completions.create(
            model=str(llama_dir), prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
            logprobs=1, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert len(res.choices[0].logprobs.tokens) == MAX_TOKENS
        health = httpx.get(srv.url("/health"))
        assert health.status_code == 200
        assert [d["engine"] for d in health.json()["dead_replicas"]] == [1]
        engines = httpx.get(srv.url("/load")).json()["engines"]
        assert [e["alive"] for e in engines] == [True, False]
        assert "data-parallel replica 1" in srv.log_tail(200)
        assert srv.stop(timeout=60) == 0, srv.log_tail()
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, f"left behind: {alive}"
    finally:
        srv.stop(timeout=30)
