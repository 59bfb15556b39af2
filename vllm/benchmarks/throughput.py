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
import time
from typing import Any

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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    check_lengths(args)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be a positive integer, got {args.num_prompts}")
    batch = args.batch_size if args.batch_size is not None else args.max_num_seqs
    if batch < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {batch}")
    batch = min(batch, args.num_prompts)
    apply_threads(args.num_threads)
    model = resolve_model(args.model)
    kwargs = engine_kwargs(args, model, max_num_seqs=batch)
    llm, startup = start_engine(kwargs)
    dtype = engine_dtype(llm)
    probe = EngineProbe(llm)
    device = probe.device_type
    env = describe_environment(device)
    bandwidth = measure_memory_bandwidth(device)
    bandwidth_cpu = measure_memory_bandwidth(device, clock=time.process_time)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(vocab, args.num_prompts, args.input_len, args.seed)
    hf = HFBaseline(model, dtype, device) if args.hf_baseline else None

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm_len = min(8, args.output_len)
    warm_sp = SamplingParams(temperature=0, max_tokens=warm_len, ignore_eos=True)
    for _ in range(args.num_iters_warmup):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], warm_sp, use_tqdm=False)
        if hf is not None:
            hf.generate(prompts[:batch], warm_len, batch)

    ours_s, hf_s, ours_cpu, hf_cpu, host, decode_steps = [], [], [], [], [], []
    decode_cpu: list[float] = []
    ours_ids: list[list[int]] = []
    hf_ids: list[list[int]] = []
    for _ in range(args.num_iters):  # interleaved: ours, HF, ours, HF, ...
        with probe.record() as rec:
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            ours_s.append(time.perf_counter() - t0)
            ours_cpu.append(time.process_time() - c0)
        ours_ids = [list(o.outputs[0].token_ids) for o in outs]
        share = rec.host_share()
        if share is not None:
            host.append(share)
        decode_steps += rec.decode_step_times()
        decode_cpu += rec.decode_step_cpu_times()
        if hf is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            hf_ids = hf.generate(prompts, args.output_len, batch)
            hf_s.append(time.perf_counter() - t0)
            hf_cpu.append(time.process_time() - c0)
    llm.shutdown()

    n_out = sum(len(x) for x in ours_ids)
    ours_tps = [n_out / s for s in ours_s]
    res: dict[str, Any] = {
        "benchmark": "throughput",
        "model": args.model or model,
        "model_path": model,
        "dtype": str(dtype).removeprefix("torch."),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "batch_size": batch,
        "environment": env,
        "startup": startup,
        "output_tokens_per_s": summary(ours_tps),
        "requests_per_s": summary([args.num_prompts / s for s in ours_s]),
        "total_tokens_per_s": summary(
            [args.num_prompts * (args.input_len + args.output_len) / s for s in ours_s]
        ),
        "cpu_s_per_output_token": summary([c / n_out for c in ours_cpu]),
        "host_overhead_share": summary(host) if host else None,
        "bandwidth_GBps": bandwidth / 1e9,
        "roofline": None,
    }
    if batch == 1 and probe.model is not None and decode_steps:
        res["roofline"] = roofline(
            weight_bytes_per_token(probe.model),
            statistics.median(decode_steps),
            bandwidth,
            statistics.median(decode_cpu) if decode_cpu else None,
            bandwidth_cpu,
        )
    if hf is not None:
        hf_tps = [n_out / s for s in hf_s]
        res["hf"] = {
            "output_tokens_per_s": summary(hf_tps),
            "cpu_s_per_output_token": summary([c / n_out for c in hf_cpu]),
            "load_s": hf.load_s,
            "outputs": compare_outputs(ours_ids, hf_ids),
        }
        res["ratio"] = summary([a / b for a, b in zip(ours_tps, hf_tps)])
        res["cpu_time_ratio"] = summary([h / o for h, o in zip(hf_cpu, ours_cpu)])
    report(res, ours_tps, res.get("hf") and [n_out / s for s in hf_s])
    write_json(args.output_json, res)
    return res


def report(res: dict[str, Any], ours_tps: list[float], hf_tps: list[float] | None) -> None:
    n = res["output_tokens_per_s"]["n"]
    print(
        f"vllm bench throughput: model={res['model']} dtype={res['dtype']} "
        f"input_len={res['input_len']} output_len={res['output_len']} "
        f"num_prompts={res['num_prompts']} batch_size={res['batch_size']}"
    )
    print(environment_line(res["environment"]))
    st = res["startup"]
    print(f"start-up: LLM() {st['init_s']:.2f} s, to first token {st['first_token_s']:.2f} s")
    print(
        f"ours: {fmt(ours_tps)} output tok/s (median [min-max] of {n} runs); "
        f"{res['requests_per_s']['median']:.2f} req/s, "
        f"{res['total_tokens_per_s']['median']:.1f} total tok/s"
    )
    if hf_tps:
        print(f"HF transformers: {fmt(hf_tps)} output tok/s (load {res['hf']['load_s']:.2f} s)")
    host = res["host_overhead_share"]
    if host is not None:
        print(
            f"host overhead (step time outside the model forward): {host['median']:.1%} "
            f"[{host['min']:.1%}-{host['max']:.1%}]"
        )
    print(roofline_line(res["roofline"]))
    if hf_tps:
        o = res["hf"]["outputs"]
        line = f"greedy outputs identical to HF: {o['identical']}/{o['total']}"
        if o["first_mismatch"]:
            m = o["first_mismatch"]
            line += f" (first difference: prompt {m['prompt']}, output token {m['token']})"
        print(line)
        c = res["cpu_time_ratio"]
        print(
            f"CPU-time ratio HF/ours (process CPU seconds per run; steadier than wall time on a "
            f"shared machine, exact work at 1 thread): {c['median']:.2f}x "
            f"[{c['min']:.2f}-{c['max']:.2f}]"
        )
        r = res["ratio"]
        print(
            f"ratio ours/HF (output tok/s, paired interleaved runs): {r['median']:.2f}x "
            f"[{r['min']:.2f}-{r['max']:.2f}]"
        )


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
