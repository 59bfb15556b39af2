# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Generate a few completions with the bundled default model (or a model folder given as argv[1])."""

from __future__ import annotations

import sys

from vllm import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    llm = LLM(model=model)
    prompts = ["def fib(n):", "import os\n", "class Stack:"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
    for o in outs:
        print("=" * 60)
        print(o.prompt + o.outputs[0].text)
    llm.shutdown()


if __name__ == "__main__":
    main()
