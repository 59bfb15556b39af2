# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Offline throughput: our LLM.generate vs HF transformers batched generate, same prompts,
same model, same dtype, in one run. Prints tokens/s of each and the ratio last.

    python benchmarks/throughput.py --model smollm2 --num-prompts 64 --input-len 128 \
        --output-len 128 --batch-sizes 8 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import resolve_model, timer


def run_ours(model: str, prompts: list[list[int]], output_len: int, batch: int, dtype: str):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=dtype,
        max_num_seqs=batch,
        max_model_len=1024,
        max_num_batched_tokens=4096,
    )
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    with timer() as t:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm.shutdown()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / t["s"], [o.outputs[0].token_ids for o in outs]


def run_hf(model: str, prompts: list[list[int]], output_len: int, batch: int, dtype: str):
    from transformers import AutoModelForCausalLM

    td = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    m = AutoModelForCausalLM.from_pretrained(model, dtype=td).eval()
    outs = []
    with timer() as t, torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            # All prompts have the same length: no padding needed.
            ids = torch.tensor(chunk)
            # No EOS so every row runs the full output_len (min_new_tokens would mask EOS and
            # change the greedy choice).
            gen = m.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            outs += gen[:, ids.shape[1] :].tolist()
    n = sum(len(o) for o in outs)
    return n / t["s"], outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | PATH")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = resolve_model(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts = torch.randint(10, vocab - 1, (args.num_prompts, args.input_len)).tolist()
    rows = []
    for b in args.batch_sizes:
        ours, ours_ids = run_ours(model, prompts, args.output_len, b, args.dtype)
        hf, hf_ids = run_hf(model, prompts, args.output_len, b, args.dtype)
        same = sum(a == b for a, b in zip(ours_ids, hf_ids))
        rows.append((b, ours, hf, same))
        print(
            f"batch {b:3d}: ours {ours:8.1f} tok/s   HF {hf:8.1f} tok/s   "
            f"identical outputs {same}/{len(prompts)}",
            flush=True,
        )
    print(
        f"model={args.model} prompts={args.num_prompts} in={args.input_len} "
        f"out={args.output_len} dtype={args.dtype}"
    )
    for b, ours, hf, _ in rows:
        print(f"ratio ours/HF at batch {b}: {ours / hf:.2f}x")


if __name__ == "__main__":
    main()
