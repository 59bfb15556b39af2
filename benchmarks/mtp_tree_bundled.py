# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""MTP chains vs draft trees on the bundled model (tiny DeepSeek-V3, two trained MTP layers; a
tree drafts every depth with the first): tokens/s, the ratio to no speculation, tokens per
verify step and acceptance per depth, greedy text checked identical to no speculation.
Engine names as in tree_smollm2.py (chainK, treeN, dynN[kT][dD]; a trailing "a": the adaptive
K picks each step's prefix; NAME-nodefer: without the first-pass deferral). Engines are
built once, warmed up, then timed in interleaved rounds (medians).

    python benchmarks/mtp_tree_bundled.py [--engines none chain2 chain3 tree6 tree10 dyn10]
        [--batch 1 8] [--pp 1] [--repeats 3] [--output-len 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bundled_mtp import PROMPTS
from benchmarks.common import cpu_flags
from benchmarks.tree_smollm2 import counters, spec_of


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", nargs="+", default=["none", "chain2", "chain3", "tree6", "dyn10"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    print(f"CPU: {cpu_flags()}; bundled model, P = {args.pp}, greedy, {args.output_len} tokens")
    for batch in args.batch:
        prompts = (PROMPTS * batch)[:batch]
        llms = {}
        for name in args.engines:
            llms[name] = LLM(
                speculative_config=spec_of(name, method="mtp"),
                pipeline_parallel_size=args.pp,
                max_num_seqs=batch,
                max_model_len=512,
            )
            if name.endswith("-nodefer"):  # the first pass over every row of every step
                llms[name].llm_engine.executor.worker.model_runner.speculator.deferral = None
            llms[name].generate(prompts, sp, use_tqdm=False)  # warm-up
        rates: dict[str, list[float]] = {n: [] for n in args.engines}
        texts: dict[str, list] = {}
        before = {n: counters(llm) for n, llm in llms.items()}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                dt = time.perf_counter() - t
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
                texts[name] = [list(o.outputs[0].token_ids) for o in outs]
        base = statistics.median(rates["none"]) if "none" in rates else None
        print(f"--- batch {batch}")
        for name, llm in llms.items():
            tps = statistics.median(rates[name])
            d0, a0, p0, _ = before[name]
            d1, a1, p1, _ = counters(llm)
            drafts, acc = d1 - d0, a1 - a0
            per = (
                [round((b - (p0[i] if i < len(p0) else 0)) / drafts, 2) for i, b in enumerate(p1)]
                if drafts
                else []
            )
            ratio = f"{tps / base:.2f}x" if base else "-"
            steps = f"{1 + acc / drafts:.2f}" if drafts else "1.00"
            same = texts[name] == texts.get("none", texts[name])
            print(
                f"{name:8s} {tps:8.1f} tok/s  {ratio:>6s}  tokens per verify step {steps}  "
                f"per depth {per}  identical to none: {same}",
                flush=True,
            )
        for llm in llms.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
