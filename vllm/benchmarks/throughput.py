# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm bench throughput`: offline generation throughput of random-token prompts, optionally
side by side with HF transformers generate (--hf-baseline) in the same process.

    vllm bench throughput --model smollm2 --input-len 128 --output-len 128 --num-prompts 16 \
        --batch-size 16 --dtype bfloat16 --hf-baseline
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    check_lengths(args)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be a positive integer, got {args.num_prompts}")
    batch = args.batch_size if args.batch_size is not None else args.max_num_seqs
    if batch < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {batch}")
    batch = min(batch, args.num_prompts)
    session = BenchSession.open(args, batch, args.num_prompts)
    llm, hf, prompts = session.llm, session.hf, session.prompts

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm_len = min(8, args.output_len)
    warm_sp = SamplingParams(temperature=0, max_tokens=warm_len, ignore_eos=True)
    for _ in range(args.num_iters_warmup):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], warm_sp, use_tqdm=False)
        if hf is not None:
            hf.generate(prompts[:batch], warm_len, batch)
    runs = run_interleaved(
        session, sp, args.output_len, batch, args.num_iters, decode_only_host=False
    )
    llm.shutdown()

    n_out = sum(len(x) for x in runs.ours_ids)
    ours_tps = [n_out / s for s in runs.ours_s]
    # vLLM's keys (scripts parse them), from the median run; our statistics sit beside them.
    elapsed = statistics.median(runs.ours_s)
    total_tokens = sum(len(p) for p in prompts) + n_out
    res: dict[str, Any] = {
        "elapsed_time": elapsed,
        "num_requests": args.num_prompts,
        "total_num_tokens": total_tokens,
        "requests_per_second": args.num_prompts / elapsed,
        "tokens_per_second": total_tokens / elapsed,
        **session.result_header("throughput", args),
        "num_prompts": args.num_prompts,
        "batch_size": batch,
        "output_tokens_per_s": summary(ours_tps),
        "requests_per_s": summary([args.num_prompts / s for s in runs.ours_s]),
        "total_tokens_per_s": summary(
            [args.num_prompts * (args.input_len + args.output_len) / s for s in runs.ours_s]
        ),
        "cpu_s_per_output_token": summary([c / n_out for c in runs.ours_cpu]),
        "host_overhead_share": summary(runs.host) if runs.host else None,
        **session.result_footer(runs, batch_one=batch == 1),
    }
    hf_tps = [n_out / s for s in runs.hf_s]
    if hf is not None:
        res["hf"] = {
            "output_tokens_per_s": summary(hf_tps),
            "cpu_s_per_output_token": summary([c / n_out for c in runs.hf_cpu]),
            "load_s": hf.load_s,
            "outputs": compare_outputs(runs.ours_ids, runs.hf_ids),
        }
        res["ratio"] = summary([a / b for a, b in zip(ours_tps, hf_tps)])
        res["cpu_time_ratio"] = summary([h / o for h, o in zip(runs.hf_cpu, runs.ours_cpu)])
    report(res, ours_tps, hf_tps or None)
    write_json(args.output_json, res)
    return res


def report(res: dict[str, Any], ours_tps: list[float], hf_tps: list[float] | None) -> None:
    n = res["output_tokens_per_s"]["n"]
    print(
        f"vllm bench throughput: model={res['model']} dtype={res['dtype']} "
        f"input_len={res['input_len']} output_len={res['output_len']} "
        f"num_prompts={res['num_prompts']} batch_size={res['batch_size']}"
    )
    print(startup_lines(res))
    print(
        f"Throughput: {res['requests_per_second']:.2f} requests/s, "
        f"{res['tokens_per_second']:.2f} total tokens/s, "
        f"{res['output_tokens_per_s']['median']:.2f} output tokens/s"
    )
    print(
        f"ours: {fmt(ours_tps)} output tok/s (median [min-max] of {n} runs); "
        f"{res['requests_per_s']['median']:.2f} req/s, "
        f"{res['total_tokens_per_s']['median']:.1f} total tok/s"
    )
    if hf_tps:
        print(f"HF transformers: {fmt(hf_tps)} output tok/s (load {res['hf']['load_s']:.2f} s)")
    host = res["host_overhead_share"]
    if host is not None:
        print(f"host overhead (step time outside the model forward): {share_text(host)}")
    print(roofline_line(res["roofline"]))
    if hf_tps:
        o = res["hf"]["outputs"]
        line = f"greedy outputs identical to HF: {o['identical']}/{o['total']}"
        if o["first_mismatch"]:
            m = o["first_mismatch"]
            line += f" (first difference: prompt {m['prompt']}, output token {m['token']})"
        print(line)
        print(
            "CPU-time ratio HF/ours (process CPU seconds per run; steadier than wall time on a "
            f"shared machine, exact work at 1 thread): {ratio_text(res['cpu_time_ratio'])}"
        )
        r = ratio_text(res["ratio"])
        print(f"ratio ours/HF (output tok/s, paired interleaved runs): {r}")


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
