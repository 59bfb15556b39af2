# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Prompt-lookup (n-gram) speculation on SmolLM2-135M-Instruct vs no speculation, in one run.

Tasks whose answers copy from the prompt (rename a variable in / add type hints or a docstring
to a given function, sort a given list); greedy; batch 1 (requests one after another). Engines:
no speculation, ngram with K fixed (adaptive K off) and ngram with the adaptive K (default).
All are built and warmed up first; each repeat times every engine once, in an order rotating
between repeats; medians. Prints tokens/s, the speed-up over no speculation, the mean tokens
per step (1 + accepted per verify step: the ceiling a free verify step would give), whether the
greedy text equals no speculation's, and the matcher's share of the step time.

    python benchmarks/ngram_smollm2.py [--dtype float32] [--k 4] [--min 2] [--max 4]
        [--repeats 3] [--output-len 96] [--num-prompts 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import make_chat_llm, smollm2, timed_chats
from benchmarks.suffix_smollm2 import FILES

# The functions the agentic workload of suffix_smollm2.py writes.
FUNC, FUNC2 = FILES["utils/price.py"], FILES["utils/counts.py"]
TASKS = [
    f"Rename the variable `subtotal` to `net_total` in this function. Reply with the whole "
    f"function only.\n\n{FUNC}",
    f"Add Python type hints to this function. Reply with the whole function only.\n\n{FUNC2}",
    f"Add a docstring to this function. Reply with the whole function only.\n\n{FUNC}",
    "Sort this list of words alphabetically and reply with the sorted list only, one per line:"
    "\nbanana\ncherry\napple\nmango\nkiwi\ngrape\nlemon\npeach\nplum\norange\nfig\npear",
    f"Rename the function `merge_counts` to `combine_counts`. Reply with the whole function "
    f"only.\n\n{FUNC2}",
]


def make_llm(model: str, dtype: str, spec: dict | None):
    return make_chat_llm(model, dtype, spec, max_model_len=512, max_num_batched_tokens=256)


def matcher_cost(k: int, lo: int, hi: int, ids: list[list[int]]) -> float:
    """Microseconds per proposal of the n-gram index over these outputs (prompt-free)."""
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramIndex

    n, t = 0, time.perf_counter()
    for seq in ids:
        idx = NgramIndex(lo, hi)
        for tok in seq:
            idx.extend([tok])
            idx.propose(k)
            n += 1
    return (time.perf_counter() - t) / max(n, 1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--min", type=int, default=2)
    ap.add_argument("--max", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=4)
    args = ap.parse_args()
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.min,
        "prompt_lookup_max": args.max,
    }
    specs = {
        "none": None,
        "ngram fixed K": {**ngram, "adaptive_num_speculative_tokens": False},
        "ngram adaptive K": ngram,
    }
    chats = [[{"role": "user", "content": p}] for p in TASKS[: args.num_prompts]]
    model = smollm2()
    llms = {name: make_llm(model, args.dtype, s) for name, s in specs.items()}
    try:
        for llm in llms.values():
            timed_chats(llm, chats[:1], 8)  # warm-up
        runs: dict[str, list] = {name: [] for name in llms}
        names = list(llms)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(timed_chats(llms[name], chats, args.output_len))
                print(f"  rep {r} {name}: {runs[name][-1][0]:.1f} tok/s", flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    base = statistics.median(x[0] for x in runs["none"])
    ref_ids = runs["none"][0][4]
    print("---")
    for name, rs in runs.items():
        tps = statistics.median(x[0] for x in rs)
        toks = sum(x[1] for x in rs)
        drafts = sum(x[2] for x in rs)
        acc = sum(x[3] for x in rs)
        # Every step (prefill included) emits one token plus the drafts it accepted.
        steps = toks - acc
        same = all(x[4] == ref_ids for x in rs)
        print(
            f"{args.dtype} batch 1 {name:17s}: {tps:6.1f} tok/s  {tps / base:.2f}x  "
            f"tokens/step {toks / max(steps, 1):.2f}  accepted/verify {acc / max(drafts, 1):.2f}"
            f"  greedy text = none: {same}"
        )
    us = matcher_cost(args.k, args.min, args.max, ref_ids)
    print(f"matcher: {us:.1f} us per proposal")


if __name__ == "__main__":
    main()
