# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Plain decode with the per-layer C++ ops (write_kv, silu_and_mul) vs the torch ops they
replaced, paired in one process: SmolLM2-135M-Instruct, greedy, the two call sites switched
between interleaved repeats (medians after a warm-up); checks the tokens are identical.

    python benchmarks/cpu_layer_ops.py [--dtype float32] [--batch 1] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.common import cpu_flags, smollm2

STEPS = 48


def _torch_write_kv(kv_cache, slot_mapping, k, v) -> None:
    kv_cache[0][slot_mapping] = k.to(kv_cache.dtype)
    kv_cache[1][slot_mapping] = v.to(kv_cache.dtype)


def _torch_silu_and_mul(self, x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import vllm.attention.backends.torch_paged as paged
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers import activation

    llm = LLM(model=smollm2(), dtype=args.dtype, max_model_len=512, max_num_seqs=args.batch)
    prompts = [{"prompt_token_ids": list(range(100 + i, 104 + i))} for i in range(args.batch)]
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    sites = {
        "ops": (paged.write_kv, activation.SiluAndMul.forward),
        "torch": (_torch_write_kv, _torch_silu_and_mul),
    }

    def run(name: str):
        paged.write_kv, activation.SiluAndMul.forward = sites[name]
        t = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        return (time.perf_counter() - t) / STEPS * 1e3, [o.outputs[0].token_ids for o in out]

    run("ops")
    run("torch")
    ms: dict[str, list[float]] = {"ops": [], "torch": []}
    toks = {}
    for _ in range(args.repeats):
        for name in ms:
            t, toks[name] = run(name)
            ms[name].append(t)
    paged.write_kv, activation.SiluAndMul.forward = sites["ops"]
    m = {k: statistics.median(v) for k, v in ms.items()}
    print(
        f"CPU: {cpu_flags()}; {args.dtype}, batch {args.batch}, {args.threads} threads: "
        f"ms per step ops {m['ops']:.2f}, torch {m['torch']:.2f} -> "
        f"{m['torch'] / m['ops']:.3f}x; tokens identical: {toks['ops'] == toks['torch']}"
    )


if __name__ == "__main__":
    main()
