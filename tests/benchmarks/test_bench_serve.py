# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm bench serve` against real `vllm serve` processes of the bundled model with MTP, at
P = 1 and P = 2: the run completes, its token counts are the server's own (its /metrics moved
by exactly as much), its spec-decode acceptance is the server's over the run (the same at
P = 1 and P = 2, greedy), and its JSON carries vLLM's keys. No timing is asserted."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm.config import DEFAULT_MODEL_DIR
from vllm.entrypoints.cli.main import main
from vllm.testing.remote_server import RemoteServer, serving

# K fixed: the adaptive K follows start-up timings, and the counts are compared across P.
MTP = json.dumps(
    {"method": "mtp", "num_speculative_tokens": 2, "adaptive_num_speculative_tokens": False}
)
ARGS = ["--max-model-len", "128", "--speculative-config", MTP, "--disable-uvicorn-access-log"]
VLLM_KEYS = """duration completed total_input_tokens total_output_tokens request_throughput
output_throughput total_token_throughput input_lens output_lens ttfts itls generated_texts errors
mean_ttft_ms median_ttft_ms std_ttft_ms p50_ttft_ms p99_ttft_ms mean_tpot_ms median_tpot_ms
p99_tpot_ms mean_itl_ms p99_itl_ms mean_e2el_ms p99_e2el_ms""".split()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, pp_forkserver):
    logs = tmp_path_factory.mktemp("bench-serve")
    started = {
        p: RemoteServer(str(DEFAULT_MODEL_DIR), [*ARGS, "-pp", str(p)], logs / f"p{p}.log")
        for p in (1, 2)
    }
    with serving(started):
        for srv in started.values():
            srv.wait_ready()
        yield started


def counters(srv: RemoteServer) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(srv.url("/metrics")).text):
        for s in fam.samples:
            if s.name.endswith("_total"):
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_bench_serve_counts_the_servers_tokens_at_p1_and_p2(servers, tmp_path):
    results = {}
    for p, srv in servers.items():
        before = counters(srv)
        out = tmp_path / f"p{p}.json"
        argv = ["bench", "serve", "--base-url", srv.base_url, "--dataset-name", "random"]
        argv += ["--random-input-len", "12", "--random-output-len", "10", "--num-prompts", "6"]
        argv += ["--max-concurrency", "3", "--ignore-eos", "--seed", "3", "--save-result"]
        argv += ["--result-filename", str(out), "--percentile-metrics", "ttft,tpot,itl,e2el"]
        assert main([*argv, "--metric-percentiles", "50,99"]) == 0
        res = json.loads(out.read_text())
        after = counters(srv)
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        assert set(VLLM_KEYS) <= set(res), set(VLLM_KEYS) - set(res)
        assert res["completed"] == 6 and not any(res["errors"])
        assert res["total_output_tokens"] == d["vllm:generation_tokens_total"] == 60
        assert res["total_input_tokens"] == d["vllm:prompt_tokens_total"] == 72
        assert res["output_lens"] == [10] * 6 and res["input_lens"] == [12] * 6
        assert res["spec_decode_num_drafts"] == d["vllm:spec_decode_num_drafts_total"] > 0
        accepted = d["vllm:spec_decode_num_accepted_tokens_total"]
        assert res["spec_decode_num_accepted_tokens"] == accepted
        assert res["spec_decode_acceptance_length"] == pytest.approx(
            1 + accepted / d["vllm:spec_decode_num_drafts_total"]
        )
        per_pos = [d[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in (0, 1)]
        assert sum(per_pos) == accepted
        results[p] = res
    # Greedy with the same prompts: pipeline parallelism changes neither text nor acceptance.
    assert results[1]["generated_texts"] == results[2]["generated_texts"]
    assert (
        results[1]["spec_decode_num_accepted_tokens"]
        == results[2]["spec_decode_num_accepted_tokens"]
    )


def test_bench_serve_chat_backend_with_a_custom_dataset(servers, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os"]))
    out = tmp_path / "chat.json"
    srv = servers[1]
    before = counters(srv)
    argv = ["bench", "serve", "--backend", "openai-chat", "--base-url", srv.base_url]
    argv += ["--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "2"]
    argv += ["--custom-output-len", "5", "--ignore-eos", "--save-result"]
    assert main([*argv, "--result-filename", str(out)]) == 0
    res = json.loads(out.read_text())
    after = counters(srv)
    assert res["completed"] == 2 and res["total_output_tokens"] == 10
    assert res["total_input_tokens"] == after["vllm:prompt_tokens_total"] - before.get(
        "vllm:prompt_tokens_total", 0.0
    )


def test_fcfs_server_refuses_a_priority(servers):
    r = httpx.post(
        servers[1].url("/v1/completions"), json={"prompt": "a", "max_tokens": 1, "priority": 2}
    )
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]


def test_bench_serve_bad_flag_is_one_line(capsys):
    assert main(["bench", "serve", "--percentile-metrics", "ttft,nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--percentile-metrics" in err
