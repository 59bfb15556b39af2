# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Cost of LoRA adapters: the same batch generated without adapters, with one rank-16 adapter
(all seven projections) on every row, and with rows spread over three adapters and the base
model; one engine (enable_lora), modes interleaved over the repeats after a warm-up of each,
medians; prints output tokens/s of each and the ratios to the base last.

    python benchmarks/lora.py --model smollm2 --batch 8 --prompt-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import CACHE, cpu_flags, resolve_model


def adapters(model: str, n: int, rank: int) -> list[str]:
    from vllm.testing.lora_adapters import make_peft_adapter

    out = []
    for i in range(n):
        folder = CACHE / f"lora-{Path(model).name}-r{rank}-{i}"
        if not (folder / "adapter_model.safetensors").exists():
            make_peft_adapter(model, folder, r=rank, lora_alpha=2 * rank, seed=i, b_scale=0.05)
        out.append(str(folder))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="tiny | smollm2 | PATH")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.testing.engine_utils import make_prompts

    model = resolve_model(args.model)
    paths = adapters(model, 3, args.rank)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    llm = LLM(
        model=model, enable_lora=True, max_loras=3, max_lora_rank=args.rank, max_model_len=512
    )
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in make_prompts(vocab, [args.prompt_len] * args.batch)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    modes = {
        "base": [None] * args.batch,
        "one adapter": [loras[0]] * args.batch,
        "mixed (3 adapters + base)": [(loras + [None])[i % 4] for i in range(args.batch)],
    }

    def run(rows) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=rows)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rate = tokens / (time.perf_counter() - start)
        print(f"    run: {rate:.1f} tok/s", flush=True)
        return rate

    for m, rows in modes.items():
        print(f"warm-up {m}", flush=True)
        run(rows)  # warm-up: adapters loaded, first-step costs paid
    results: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m, rows in modes.items():
            results[m].append(run(rows))
    llm.shutdown()
    med = {m: statistics.median(v) for m, v in results.items()}
    print(f"CPU: {cpu_flags()}")
    print(
        f"model {Path(model).name}, batch {args.batch}, prompt {args.prompt_len}, output "
        f"{args.output_len}, rank {args.rank}, {args.repeats} repeats (median output tokens/s)"
    )
    for m, v in med.items():
        print(f"  {m:28s} {v:8.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in results[m])})")
    for m in list(modes)[1:]:
        print(f"ratio {m} / base: {med[m] / med['base']:.3f}x")


if __name__ == "__main__":
    main()
