# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm bench latency`: end-to-end latency of one batch of requests (prefill + output_len
tokens), with time to first token, the decode step time, the batch-1 memory roofline and the
host-overhead share; optionally HF transformers generate on the same batch (--hf-baseline).

    vllm bench latency --model smollm2 --input-len 128 --output-len 128 --batch-size 1 \
        --hf-baseline
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np

from vllm.benchmarks.common import (
    BenchSession,
    check_lengths,
    fmt,
    ratio_text,
    roofline_line,
    run_interleaved,
    share_text,
    startup_lines,
    summary,
    write_json,
)
from vllm.benchmarks.probe import compare_outputs

PERCENTILES = (10, 25, 50, 75, 90, 99)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    check_lengths(args)
    if args.batch_size < 1 or args.n < 1:
        raise ValueError(
            f"--batch-size and --n must be positive integers, got {args.batch_size} and {args.n}"
        )
    if args.hf_baseline and args.n != 1:
        raise ValueError("--hf-baseline compares greedy outputs and needs --n 1")
    session = BenchSession.open(args, args.batch_size * args.n, args.batch_size)
    llm, hf, prompts = session.llm, session.hf, session.prompts
    sp = SamplingParams(n=args.n, temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for _ in range(args.num_iters_warmup):
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        if hf is not None:
            hf.generate(prompts, args.output_len, args.batch_size)
    runs = run_interleaved(
        session, sp, args.output_len, args.batch_size, args.num_iters, decode_only_host=True
    )
    llm.shutdown()

    lat = runs.ours_s
    res: dict[str, Any] = {
        **session.result_header("latency", args),
        "batch_size": args.batch_size,
        "n": args.n,
        "avg_latency": statistics.mean(lat),
        "latencies": lat,
        "percentiles": {str(p): float(np.percentile(lat, p)) for p in PERCENTILES},
        "latency": summary(lat),
        "cpu_s": summary(runs.ours_cpu),
        "ttft": summary(runs.ttft) if runs.ttft else None,
        "decode_step_s": summary(runs.decode_steps) if runs.decode_steps else None,
        "host_overhead_share_decode": summary(runs.host) if runs.host else None,
        **session.result_footer(runs, batch_one=args.batch_size * args.n == 1),
    }
    if hf is not None:
        res["hf"] = {
            "latency": summary(runs.hf_s),
            "cpu_s": summary(runs.hf_cpu),
            "load_s": hf.load_s,
            "outputs": compare_outputs(runs.ours_ids, runs.hf_ids),
        }
        res["speedup"] = summary([h / o for h, o in zip(runs.hf_s, lat)])
        res["cpu_time_ratio"] = summary([h / o for h, o in zip(runs.hf_cpu, runs.ours_cpu)])
    report(res, lat, runs.decode_steps, runs.hf_s)
    write_json(args.output_json, res)
    return res


def report(res: dict[str, Any], lat: list[float], steps: list[float], hf_lat: list[float]):
    print(
        f"vllm bench latency: model={res['model']} dtype={res['dtype']} "
        f"input_len={res['input_len']} output_len={res['output_len']} "
        f"batch_size={res['batch_size']} n={res['n']}"
    )
    print(startup_lines(res))
    print(f"Avg latency: {res['avg_latency']:.4f} seconds")
    for p, v in res["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    print(f"latency: {fmt(lat, 3)} s (median [min-max] of {len(lat)} runs)")
    if res["ttft"] is not None:
        print(f"time to first token: {res['ttft']['median'] * 1e3:.1f} ms (median)")
    if steps:
        toks = res["batch_size"] * res["n"]
        med = statistics.median(steps)
        print(
            f"decode step: {fmt(steps, 1, 1e3)} ms -> {toks / med:.1f} tok/s ({len(steps)} steps)"
        )
    host = res["host_overhead_share_decode"]
    if host is not None:
        print(f"host overhead (decode step time outside the model forward): {share_text(host)}")
    print(roofline_line(res["roofline"]))
    if hf_lat:
        print(f"HF transformers latency: {fmt(hf_lat, 3)} s (load {res['hf']['load_s']:.2f} s)")
        o = res["hf"]["outputs"]
        print(f"greedy outputs identical to HF: {o['identical']}/{o['total']}")
        c = ratio_text(res["cpu_time_ratio"])
        print(f"CPU-time ratio HF/ours (process CPU seconds per run): {c}")
        print(f"ratio HF latency / ours (paired interleaved runs): {ratio_text(res['speedup'])}")


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
