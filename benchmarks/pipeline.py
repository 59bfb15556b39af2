# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Pipeline parallelism: tokens/s at P = 1, P = 2 (mp) and P = 2 (ray) on the same model and
prompts in one run, with the per-step stage-to-stage communication time; ratios printed last.

    python -m benchmarks.pipeline [--model PATH] --num-prompts 64 --input-len 64 --output-len 64

Without --model a random Llama (8 layers, H=512) is built on the fly. On CPU each stage process
gets cores / P intra-op threads; P = 1 uses all cores.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import CACHE, parse_workload, timer


def bench_llama() -> str:
    from vllm.testing.checkpoints import make_llama

    out = CACHE / "pp-llama-8l-h512"
    if not (out / "config.json").exists():
        make_llama(
            str(out),
            num_hidden_layers=8,
            hidden_size=512,
            intermediate_size=1408,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        )
    return str(out)


def _comm_delta(before: list[dict], after: list[dict]) -> list[dict]:
    return [
        {k: a[k] - b[k] for k in a if isinstance(a[k], float)}
        | {"rank": a["rank"]}
        | {"steps": a["steps"] - b["steps"]}
        for a, b in zip(after, before)
    ]


def run(model: str, prompts: list[list[int]], args, pp: int, backend: str | None) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=1024,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
    )
    try:
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warm, use_tqdm=False)
        executor = llm.llm_engine.executor
        before = executor.comm_stats() if pp > 1 else None
        c0 = time.process_time()
        with timer() as t:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        engine_cpu = time.process_time() - c0
        comm = _comm_delta(before, executor.comm_stats()) if pp > 1 else None
    finally:
        llm.shutdown()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tok_s": n / t["s"],
        "seconds": t["s"],
        "ids": [o.outputs[0].token_ids for o in outs],
        "comm": comm,
        "engine_cpu": engine_cpu,
    }


def _print(name: str, r: dict) -> None:
    print(
        f"{name:12s} {r['tok_s']:9.1f} tok/s  ({r['seconds']:.2f} s; engine process on a CPU "
        f"{100 * r['engine_cpu'] / r['seconds']:.0f}% of the time)",
        flush=True,
    )
    comm = r["comm"] or []
    steps = max((c["steps"] for c in comm), default=0) or 1  # receives on a non-first stage
    for c in comm:
        busy = 100 * c["run_s"] / r["seconds"]
        cpu = 100 * c["run_cpu_s"] / r["seconds"]
        line = (
            f"{'':12s} stage {c['rank']}: running {busy:.0f}% of the time (on a CPU {cpu:.0f}%), "
            f"send posting "
            f"{1e3 * c['send_s'] / steps:.3f} ms/step"
        )
        if c["rank"] > 0:
            line += (
                f", receive transfer {1e3 * c['recv_payload_s'] / steps:.3f} ms/step"
                f", waiting for upstream {1e3 * c['recv_wait_s'] / steps:.2f} ms/step"
            )
        line += f", waiting for broadcasts {1e3 * c['broadcast_wait_s'] / steps:.3f} ms/step"
        print(line, flush=True)
    if comm:
        per_step = sum(c["send_s"] + c["recv_payload_s"] for c in comm) / steps
        print(f"{'':12s} communication {1e3 * per_step:.3f} ms/step over {steps} steps", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-ray", action="store_true")
    args, model, prompts = parse_workload(ap, bench_llama, "built on the fly", input_len=64)
    print(
        f"model={model} prompts={args.num_prompts} in={args.input_len} out={args.output_len} "
        f"max_num_seqs={args.max_num_seqs} cores={os.cpu_count()} P=1 threads="
        f"{torch.get_num_threads()}",
        flush=True,
    )
    cores = torch.get_num_threads()
    results = {"P=1": run(model, prompts, args, 1, None)}
    _print("P=1", results["P=1"])
    if cores > 1:
        # The same cores as one thread per stage of P = 2 (CPU intra-op threads contend badly on
        # a loaded machine, so both P = 1 baselines are shown).
        torch.set_num_threads(1)
        results["P=1 1thr"] = run(model, prompts, args, 1, None)
        torch.set_num_threads(cores)
        _print("P=1 1thr", results["P=1 1thr"])
    results["P=2 mp"] = run(model, prompts, args, 2, "mp")
    _print("P=2 mp", results["P=2 mp"])
    if not args.skip_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            results["P=2 ray"] = run(model, prompts, args, 2, "ray")
        finally:
            ray.shutdown()
        _print("P=2 ray", results["P=2 ray"])
    bases = [k for k in results if k.startswith("P=1")]
    for name, r in results.items():
        if name == "P=1":
            continue
        same = sum(a == b for a, b in zip(r["ids"], results["P=1"]["ids"]))
        print(f"{name}: identical outputs to P=1 {same}/{len(prompts)}")
    for name, r in results.items():
        for b in bases if name not in bases else []:
            print(f"ratio {name} / {b}: {r['tok_s'] / results[b]['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
