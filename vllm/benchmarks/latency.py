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
import time
from typing import Any

import numpy as np

from vllm.benchmarks.common import (
    EngineProbe,
    HFBaseline,
    apply_threads,
    check_lengths,
    compare_outputs,
    describe_environment,
    engine_dtype,
    engine_kwargs,
    environment_line,
    fmt,
    measure_memory_bandwidth,
    random_prompts,
    resolve_model,
    roofline,
    roofline_line,
    start_engine,
    summary,
    weight_bytes_per_token,
    write_json,
)

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
    apply_threads(args.num_threads)
    model = resolve_model(args.model)
    kwargs = engine_kwargs(args, model, max_num_seqs=args.batch_size * args.n)
    llm, startup = start_engine(kwargs)
    dtype = engine_dtype(llm)
    probe = EngineProbe(llm)
    env = describe_environment(probe.device_type)
    bandwidth = measure_memory_bandwidth(probe.device_type)
    bandwidth_cpu = measure_memory_bandwidth(probe.device_type, clock=time.process_time)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(vocab, args.batch_size, args.input_len, args.seed)
    hf = HFBaseline(model, dtype, probe.device_type) if args.hf_baseline else None
    sp = SamplingParams(n=args.n, temperature=0, max_tokens=args.output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]

    for _ in range(args.num_iters_warmup):
        llm.generate(batch, sp, use_tqdm=False)
        if hf is not None:
            hf.generate(prompts, args.output_len, args.batch_size)

    lat, ttft, decode_steps, host, hf_lat, cpu, hf_cpu = [], [], [], [], [], [], []
    decode_cpu: list[float] = []
    ours_ids: list[list[int]] = []
    hf_ids: list[list[int]] = []
    for _ in range(args.num_iters):  # interleaved: ours, HF, ours, HF, ...
        with probe.record() as rec:
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(batch, sp, use_tqdm=False)
            lat.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        ours_ids = [list(o.outputs[0].token_ids) for o in outs]
        if rec.steps:
            ttft.append(rec.steps[0].end_s - t0)
        decode_steps += rec.decode_step_times()
        decode_cpu += rec.decode_step_cpu_times()
        share = rec.host_share(decode_only=True)
        if share is not None:
            host.append(share)
        if hf is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            hf_ids = hf.generate(prompts, args.output_len, args.batch_size)
            hf_lat.append(time.perf_counter() - t0)
            hf_cpu.append(time.process_time() - c0)
    llm.shutdown()

    res: dict[str, Any] = {
        "benchmark": "latency",
        "model": args.model or model,
        "model_path": model,
        "dtype": str(dtype).removeprefix("torch."),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batch_size": args.batch_size,
        "n": args.n,
        "environment": env,
        "startup": startup,
        "avg_latency": statistics.mean(lat),
        "latencies": lat,
        "percentiles": {str(p): float(np.percentile(lat, p)) for p in PERCENTILES},
        "latency": summary(lat),
        "cpu_s": summary(cpu),
        "ttft": summary(ttft) if ttft else None,
        "decode_step_s": summary(decode_steps) if decode_steps else None,
        "host_overhead_share_decode": summary(host) if host else None,
        "bandwidth_GBps": bandwidth / 1e9,
        "roofline": None,
    }
    if args.batch_size * args.n == 1 and probe.model is not None and decode_steps:
        res["roofline"] = roofline(
            weight_bytes_per_token(probe.model),
            statistics.median(decode_steps),
            bandwidth,
            statistics.median(decode_cpu) if decode_cpu else None,
            bandwidth_cpu,
        )
    if hf is not None:
        res["hf"] = {
            "latency": summary(hf_lat),
            "cpu_s": summary(hf_cpu),
            "load_s": hf.load_s,
            "outputs": compare_outputs(ours_ids, hf_ids),
        }
        res["speedup"] = summary([h / o for h, o in zip(hf_lat, lat)])
        res["cpu_time_ratio"] = summary([h / o for h, o in zip(hf_cpu, cpu)])
    report(res, lat, decode_steps, hf_lat)
    write_json(args.output_json, res)
    return res


def report(res: dict[str, Any], lat: list[float], steps: list[float], hf_lat: list[float]):
    print(
        f"vllm bench latency: model={res['model']} dtype={res['dtype']} "
        f"input_len={res['input_len']} output_len={res['output_len']} "
        f"batch_size={res['batch_size']} n={res['n']}"
    )
    print(environment_line(res["environment"]))
    st = res["startup"]
    print(f"start-up: LLM() {st['init_s']:.2f} s, to first token {st['first_token_s']:.2f} s")
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
        print(
            f"host overhead (decode step time outside the model forward): {host['median']:.1%} "
            f"[{host['min']:.1%}-{host['max']:.1%}]"
        )
    print(roofline_line(res["roofline"]))
    if hf_lat:
        print(f"HF transformers latency: {fmt(hf_lat, 3)} s (load {res['hf']['load_s']:.2f} s)")
        o = res["hf"]["outputs"]
        print(f"greedy outputs identical to HF: {o['identical']}/{o['total']}")
        c = res["cpu_time_ratio"]
        print(
            f"CPU-time ratio HF/ours (process CPU seconds per run): {c['median']:.2f}x "
            f"[{c['min']:.2f}-{c['max']:.2f}]"
        )
        s = res["speedup"]
        print(
            f"ratio HF latency / ours (paired interleaved runs): {s['median']:.2f}x "
            f"[{s['min']:.2f}-{s['max']:.2f}]"
        )


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
