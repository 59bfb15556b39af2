# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Offline throughput vs HF transformers at several batch sizes: a thin loop over
`vllm bench throughput --hf-baseline` (vllm/benchmarks/throughput.py), which does the
measuring (warm-up, interleaved repeats, medians, identical-output check).

    python benchmarks/throughput.py --model smollm2 --batch-sizes 1 16 -- --dtype bfloat16

Flags after `--` go to `vllm bench throughput` unchanged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | PATH")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then vllm bench flags")
    args = ap.parse_args()
    extra = [a for a in args.bench_args if a != "--"]
    model = args.model if args.model == "smollm2" else resolve_model(args.model)

    from vllm.benchmarks.args import add_throughput_args
    from vllm.benchmarks.throughput import run

    parser = add_throughput_args(argparse.ArgumentParser(prog="vllm bench throughput"))
    ratios = []
    for b in args.batch_sizes:
        bench = parser.parse_args(
            ["--model", model, "--batch-size", str(b), "--hf-baseline"] + extra
        )
        bench.num_prompts = max(bench.num_prompts, b)
        res = run(bench)
        ratios.append((b, res["ratio"]["median"]))
        print(flush=True)
    for b, r in ratios:
        print(f"ratio ours/HF at batch {b}: {r:.2f}x")


if __name__ == "__main__":
    main()
