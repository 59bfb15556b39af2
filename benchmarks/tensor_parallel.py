# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tensor parallelism: tokens/s at TP = 1 and TP = N (mp workers) on the same model and prompts
in one run, with the TP collectives' time per step (all-reduces after every row-parallel layer
and MoE block, the logits gather, the sampled-token broadcast), measured inside the workers.

    python -m benchmarks.tensor_parallel --model PATH --tp 2 [--repeats 3]

Both engines stay up for the whole run and are measured alternately (warm-up first, then
--repeats interleaved rounds; medians). TP = 1 runs in this process with one intra-op thread,
each TP worker with cores / TP (at least one): on a 2-core host this measures the overhead of
splitting, not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _gen(llm, prompts, max_tokens: int):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return outs, dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from transformers import AutoConfig

    from vllm import LLM

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 1, (args.num_prompts, args.input_len), generator=g).tolist()
    common = dict(
        model=args.model, dtype=args.dtype, max_model_len=512, max_num_seqs=args.num_prompts
    )
    torch.set_num_threads(1)
    print(
        f"model={args.model} prompts={args.num_prompts} in={args.input_len} "
        f"out={args.output_len} cores={os.cpu_count()} TP={args.tp}",
        flush=True,
    )
    tp1 = LLM(**common)
    tpn = LLM(tensor_parallel_size=args.tp, **common)
    try:
        executor = tpn.llm_engine.executor
        _gen(tp1, prompts[:4], 4)
        _gen(tpn, prompts[:4], 4)
        rates: dict[str, list[float]] = {"TP=1": [], f"TP={args.tp}": []}
        comm_ms: list[float] = []
        colls: list[float] = []
        ids: dict[str, list] = {}
        for _ in range(args.repeats):
            outs, dt = _gen(tp1, prompts, args.output_len)
            ids["TP=1"] = [o.outputs[0].token_ids for o in outs]
            rates["TP=1"].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            before = executor.comm_stats()
            outs, dt = _gen(tpn, prompts, args.output_len)
            after = executor.comm_stats()
            ids["TP=N"] = [o.outputs[0].token_ids for o in outs]
            rates[f"TP={args.tp}"].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            # The output rank (TP rank 0): its steps and the time it spent in collectives.
            a, b = after[0], before[0]
            steps = max(1, a["steps"] - b["steps"])
            comm_ms.append(1e3 * (a["tp_comm_s"] - b["tp_comm_s"]) / steps)
            colls.append((a["tp_collectives"] - b["tp_collectives"]) / steps)
            step_ms = 1e3 * dt / steps
            print(
                f"  round: TP=1 {rates['TP=1'][-1]:.1f} tok/s, TP={args.tp} "
                f"{rates[f'TP={args.tp}'][-1]:.1f} tok/s ({steps} steps, {step_ms:.1f} ms/step, "
                f"collectives {comm_ms[-1]:.2f} ms/step, {colls[-1]:.0f} per step)",
                flush=True,
            )
    finally:
        tpn.shutdown()
        tp1.shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k, v in med.items():
        print(f"{k:6s} median {v:8.1f} tok/s", flush=True)
    print(f"ratio TP={args.tp} / TP=1: {med[f'TP={args.tp}'] / med['TP=1']:.2f}x")
    print(
        f"TP={args.tp} collectives: median {statistics.median(comm_ms):.2f} ms/step, "
        f"{statistics.median(colls):.0f} per step"
    )
    same = sum(a == b for a, b in zip(ids["TP=1"], ids["TP=N"]))
    print(f"identical greedy outputs: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
