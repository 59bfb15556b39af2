# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Suffix decoding vs prompt lookup (n-gram) vs no speculation on SmolLM2-135M-Instruct, in one
run, on an agentic workload and on plain chat.

Agentic: a loop that writes files through a tool-call JSON (`write_file` with the file's
content), re-reads a file it wrote and edits it (rename, docstring), and retries calls - the
repetition across requests that a global cache of earlier outputs learns and a prompt lookup
cannot (each request only sees its own prompt). Plain chat: questions whose answers repeat
nothing. Greedy, batch 1 (requests one after another, in order, so earlier outputs exist when
later requests run). Every engine is built and warmed up first; each repeat runs the whole
workload once per engine, the engines in an order rotating between repeats; the global cache
starts empty at each repeat (a fresh engine per repeat would re-pay start-up: the cache is
cleared instead). Prints tokens/s, the speed-up over no speculation and over n-gram, tokens
per step, and whether the greedy text equals no speculation's.

    python benchmarks/suffix_smollm2.py [--dtype float32] [--repeats 3] [--output-len 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags, make_chat_llm, smollm2, timed_chats

FILES = {
    "utils/price.py": """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax
""",
    "utils/counts.py": """def merge_counts(left, right):
    result = dict(left)
    for key, value in right.items():
        if key in result:
            result[key] = result[key] + value
        else:
            result[key] = value
    return result
""",
    "utils/text.py": """def word_lengths(text):
    lengths = {}
    for word in text.split():
        lengths[word] = len(word)
    return lengths
""",
}
TOOL = (
    'You can call one tool, write_file. Reply with one JSON object only: {"name": '
    '"write_file", "arguments": {"path": "...", "content": "..."}}.'
)


def agentic_turns() -> list[str]:
    """The requests of the loop, in order (each one a user message)."""
    turns = []
    for path, code in FILES.items():
        turns.append(f"{TOOL}\n\nWrite this code to {path}:\n\n{code}")
    for path, code in FILES.items():
        turns.append(
            f"{TOOL}\n\nHere is {path}:\n\n{code}\nRename the variable `result` or `subtotal` "
            f"or `lengths` to `out` and write the file back."
        )
    for path, code in list(FILES.items())[:2]:  # the agent retries two calls
        turns.append(f"{TOOL}\n\nWrite this code to {path}:\n\n{code}")
    return turns


CHAT = [
    "What are three good habits for studying?",
    "Explain why the sky is blue in two sentences.",
    "Give me a short poem about autumn.",
    "What is the difference between a list and a tuple in Python?",
]


def make_llm(model: str, dtype: str, spec: dict | None):
    return make_chat_llm(model, dtype, spec, max_model_len=1024, max_num_batched_tokens=512)


def _forget(llm) -> None:
    """Empty the suffix global cache (a new workload run starts from nothing)."""
    runner = llm.llm_engine.executor.worker.model_runner
    if runner.speculator is not None and hasattr(runner.speculator, "end_warm_up"):
        runner.speculator.end_warm_up()


def timed(llm, turns: list[str], out_len: int):
    """The turns as greedy chats (timed_chats), suffix decoding's global cache emptied first."""
    _forget(llm)
    return timed_chats(llm, [[{"role": "user", "content": u}] for u in turns], out_len)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    specs = {
        "none": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
        "suffix": {"method": "suffix"},
    }
    workloads = {"agentic": agentic_turns(), "chat": CHAT}
    model = smollm2()
    llms = {name: make_llm(model, args.dtype, s) for name, s in specs.items()}
    print(f"CPU: {cpu_flags()}; dtype {args.dtype}; batch 1; greedy", flush=True)
    try:
        for llm in llms.values():
            timed(llm, CHAT[:1], 8)  # warm-up
        runs: dict[tuple[str, str], list] = {}
        names = list(llms)
        for r in range(args.repeats):
            for w, turns in workloads.items():
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    res = timed(llms[name], turns, args.output_len)
                    runs.setdefault((w, name), []).append(res)
                    tps = res[1] / max(res[1] - res[3], 1)  # tokens per step
                    print(
                        f"  rep {r} {w} {name}: {res[0]:.1f} tok/s, {tps:.2f} tok/step", flush=True
                    )
    finally:
        for llm in llms.values():
            llm.shutdown()
    print("---")
    for w in workloads:
        base = statistics.median(x[0] for x in runs[(w, "none")])
        ngram = statistics.median(x[0] for x in runs[(w, "ngram")])
        ref_ids = runs[(w, "none")][0][4]
        for name in names:
            rs = runs[(w, name)]
            tps = statistics.median(x[0] for x in rs)
            toks, acc = sum(x[1] for x in rs), sum(x[3] for x in rs)
            same = all(x[4] == ref_ids for x in rs)
            print(
                f"{w:8s} {name:7s}: {tps:6.1f} tok/s  {tps / base:.2f}x of none  "
                f"{tps / ngram:.2f}x of ngram  tokens/step {toks / max(toks - acc, 1):.2f}  "
                f"greedy text = none: {same}"
            )


if __name__ == "__main__":
    main()
