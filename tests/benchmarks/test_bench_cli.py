# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm bench throughput|latency`: a tiny run end to end, with the HF baseline on the same
prompts; the report carries what the methodology promises (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from vllm.entrypoints.cli.main import main

TINY = ["--input-len", "8", "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1"]


def test_bench_throughput_with_hf_baseline(llama_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", "--model", llama_dir, *TINY, "--num-prompts", "3"]
    argv += ["--batch-size", "2", "--num-threads", "1", "--hf-baseline", "--output-json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    # vLLM's keys, which scripts parse: 3 requests of 8 prompt + 4 output tokens.
    assert res["num_requests"] == 3 and res["total_num_tokens"] == 3 * (8 + 4)
    assert res["elapsed_time"] > 0
    assert res["requests_per_second"] == pytest.approx(3 / res["elapsed_time"])
    assert res["tokens_per_second"] == pytest.approx(36 / res["elapsed_time"])
    # Greedy outputs of both engines on the same prompts are identical, every prompt.
    assert res["hf"]["outputs"] == {"identical": 3, "total": 3, "first_mismatch": None}
    assert res["batch_size"] == 2 and res["environment"]["intra_op_threads"] == 1
    assert res["output_tokens_per_s"]["n"] == 2 and res["hf"]["output_tokens_per_s"]["n"] == 2
    assert 0 < res["host_overhead_share"]["median"] < 1
    assert 0 < res["startup"]["init_s"] <= res["startup"]["first_token_s"]
    assert res["ratio"]["min"] <= res["ratio"]["median"] <= res["ratio"]["max"]
    assert res["cpu_time_ratio"]["n"] == 2 and res["cpu_s_per_output_token"]["median"] > 0
    printed = capsys.readouterr().out
    assert "greedy outputs identical to HF: 3/3" in printed
    assert printed.rstrip().splitlines()[-1].startswith("ratio ours/HF")


def test_bench_latency_reports_the_roofline(llama_dir, tmp_path):
    out = tmp_path / "l.json"
    argv = ["bench", "latency", "--model", llama_dir, *TINY, "--batch-size", "1"]
    assert main([*argv, "--num-threads", "1", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["percentiles"]) == {"10", "25", "50", "75", "90", "99"}  # vLLM's keys
    assert res["avg_latency"] == pytest.approx(sum(res["latencies"]) / len(res["latencies"]))
    r = res["roofline"]
    # 4 layers of a tiny Llama: every parameter read once per decode token.
    assert r["weight_bytes_per_token"] > 0 and r["percent"] > 0
    assert r["decode_step_s"] == res["decode_step_s"]["median"]
    assert len(res["latencies"]) == 2 and res["ttft"]["median"] > 0


def test_bench_bad_value_is_one_line(llama_dir, capsys):
    assert main(["bench", "throughput", "--model", llama_dir, "--num-prompts", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--num-prompts" in err
