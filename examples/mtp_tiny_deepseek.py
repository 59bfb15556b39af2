# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The bundled tiny DeepSeek-V3-style model, split over two pipeline stages, with
its own MTP heads drafting 2 tokens per step. Prints completions and the acceptance metrics.

    python examples/mtp_tiny_deepseek.py [MODEL_DIR] [--pp N] [--k K]
"""

from __future__ import annotations

import argparse

from vllm import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="model folder (default: bundled)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    ap.add_argument("--k", type=int, default=2, help="MTP draft tokens per step (0: off)")
    args = ap.parse_args()
    spec = {"method": "mtp", "num_speculative_tokens": args.k} if args.k else None
    llm = LLM(model=args.model, pipeline_parallel_size=args.pp, speculative_config=spec)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64))
    for o in outs:
        print("=" * 72)
        print(o.prompt + o.outputs[0].text)
    m = {x.name: x for x in llm.get_metrics()}
    drafts = m["vllm:spec_decode_num_drafts"].value
    if drafts:
        acc = m["vllm:spec_decode_num_accepted_tokens"].value
        per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"].values
        print("=" * 72)
        print(
            f"drafts: {drafts}  accepted tokens: {acc}  "
            f"mean acceptance length: {1 + acc / drafts:.2f}"
        )
        print("per-position acceptance: " + ", ".join(f"{v / drafts:.2f}" for v in per_pos))
    llm.shutdown()


if __name__ == "__main__":
    main()
