# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""An FP8 block-quantized checkpoint vs its bf16 original, in one run: load time, peak and
resident memory, weight bytes in memory, and decode tokens/s, for the FP8 folder dequantized at
load (the CPU default) and dequantized per forward (FP8 kept resident, VLLM_FP8_DEQUANT=forward).
Each variant runs in a fresh process (clean RSS), the variants interleaved over --repeats rounds;
medians are reported, ratios vs bf16 last.

    python benchmarks/fp8.py [--layers 8] [--hidden 512] [--repeats 3] [--device cpu]

The model is a small DeepSeek-V3 (MLA + MoE, bf16) built once under VLLM_BENCH_CACHE; its FP8
copy uses [128, 128] blocks (kv_a_proj_with_mqa's 288 rows end in a partial block).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {
    "bf16": ("bf16", None),
    "fp8 (dequant at load)": ("fp8", "load"),
    "fp8 (dequant per forward)": ("fp8", "forward"),
}


def build(layers: int, hidden: int) -> dict[str, str]:
    import torch

    from benchmarks.common import CACHE
    from vllm.testing.checkpoints import make_deepseek_v3
    from vllm.testing.fp8_checkpoints import quantize_checkpoint

    root = CACHE / f"fp8-dsv3-{layers}l-{hidden}h"
    bf16, fp8 = root / "bf16", root / "fp8"
    if not (bf16 / "config.json").exists():
        make_deepseek_v3(
            bf16,
            num_hidden_layers=layers,
            hidden_size=hidden,
            q_lora_rank=hidden * 3 // 4,
            kv_lora_rank=hidden // 2,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            num_attention_heads=8,
            n_routed_experts=16,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=hidden // 2,
            intermediate_size=hidden * 2,
            max_position_embeddings=1024,
            dtype=torch.bfloat16,
        )
    if not (fp8 / "config.json").exists():
        quantize_checkpoint(bf16, fp8, block=(128, 128))
    return {"bf16": str(bf16), "fp8": str(fp8)}


def child(path: str, device: str, prompts: int, input_len: int, output_len: int) -> dict:
    """One variant in this process: load, then timed greedy decoding."""
    import resource

    import psutil

    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader import parameter_bytes
    from vllm.testing.engine_utils import make_prompts

    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t = time.perf_counter()
    llm = LLM(
        model=path,
        dtype="bfloat16",
        device=device,
        max_model_len=input_len + output_len + 8,
        max_num_seqs=prompts,
        max_num_batched_tokens=max(128, prompts * input_len),  # a small warm-up batch
        kv_cache_memory_bytes=32 << 20,
    )
    load_s = time.perf_counter() - t
    resident = proc.memory_info().rss - rss0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    model = llm.llm_engine.executor.worker.model_runner.model
    weights = parameter_bytes(model)
    ids = make_prompts(llm.llm_engine.model_config.vocab_size, [input_len] * prompts, seed=0)
    batch = [{"prompt_token_ids": p} for p in ids]
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    decode_s = time.perf_counter() - t
    llm.shutdown()
    return {
        "load_s": load_s,
        "peak_mib": peak / 2**20,
        "resident_mib": resident / 2**20,
        "weights_mib": weights / 2**20,
        "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / decode_s,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        out = child(args.child, args.device, args.prompts, args.input_len, args.output_len)
        print("RESULT " + json.dumps(out))
        return

    paths = build(args.layers, args.hidden)
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(args.repeats):
        # Rotate the order each round so no variant always runs first (shared, noisy machine).
        for name in names[r % len(names) :] + names[: r % len(names)]:
            kind, mode = VARIANTS[name]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            env.pop("VLLM_FP8_DEQUANT", None)
            if mode is not None:
                env["VLLM_FP8_DEQUANT"] = mode
            cmd = [sys.executable, __file__, "--child", paths[kind], "--device", args.device]
            cmd += ["--prompts", str(args.prompts), "--input-len", str(args.input_len)]
            cmd += ["--output-len", str(args.output_len)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            results[name].append(json.loads(line[0][len("RESULT ") :]))
            print(f"round {r + 1} {name}: {results[name][-1]['tok_s']:.1f} tok/s", flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in results[name])

    base = "bf16"
    print(
        f"\nDeepSeek-V3 {args.layers} layers, hidden {args.hidden}, {args.device}, "
        f"{args.threads} thread(s), {args.prompts} x {args.input_len} -> {args.output_len} tokens, "
        f"medians of {args.repeats}"
    )
    print("| variant | load s | peak MiB | resident MiB | weights MiB | decode tok/s | vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for name in VARIANTS:
        print(
            f"| {name} | {med(name, 'load_s'):.2f} | {med(name, 'peak_mib'):.0f} | "
            f"{med(name, 'resident_mib'):.0f} | {med(name, 'weights_mib'):.1f} | "
            f"{med(name, 'tok_s'):.1f} | {med(name, 'tok_s') / med(base, 'tok_s'):.2f}x |"
        )
    same = all(
        x["tokens"] == results["fp8 (dequant at load)"][0]["tokens"]
        for n in VARIANTS
        if n != base
        for x in results[n]
    )
    print(f"fp8 variants produce identical greedy tokens: {same}")
    for name in VARIANTS:
        if name != base:
            print(
                f"{name} / bf16: load {med(name, 'load_s') / med(base, 'load_s'):.2f}x, "
                f"resident {med(name, 'resident_mib') / med(base, 'resident_mib'):.2f}x, "
                f"weights {med(name, 'weights_mib') / med(base, 'weights_mib'):.2f}x, "
                f"decode {med(name, 'tok_s') / med(base, 'tok_s'):.2f}x"
            )


if __name__ == "__main__":
    main()
