# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Where a decode step's time goes: torch.profiler over steady-state decode steps of one engine,
the top operators by self CPU time, and the share of the step spent outside the model forward.

    python benchmarks/profile_decode.py --model smollm2 --dtype float32 --batch-size 1
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from vllm import LLM, SamplingParams
    from vllm.benchmarks.common import random_prompts, resolve_model
    from vllm.benchmarks.probe import EngineProbe

    path = resolve_model(args.model)
    t0 = time.perf_counter()
    llm = LLM(
        model=path,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 8,
        max_num_seqs=args.batch_size,
        enforce_eager=args.enforce_eager,
    )
    print(f"LLM() {time.perf_counter() - t0:.2f} s, {torch.get_num_threads()} threads")
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": p}
        for p in random_prompts(vocab, args.batch_size, args.input_len, seed=0)
    ]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    probe = EngineProbe(llm)
    with probe.record() as rec:
        llm.generate(prompts, sp, use_tqdm=False)
    steps = [s for s in rec.steps if s.is_decode]
    wall = sum(s.wall_s for s in steps)
    fwd = sum(s.forward_s for s in steps)
    print(
        f"{len(steps)} decode steps: {1e3 * wall / len(steps):.2f} ms/step, forward+logits "
        f"{1e3 * fwd / len(steps):.2f} ms, outside the forward {1 - fwd / wall:.1%}"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, sp, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    llm.shutdown()


if __name__ == "__main__":
    main()
