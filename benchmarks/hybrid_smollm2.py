# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Hybrid proposers (the bundled EAGLE3 head + suffix decoding) vs EAGLE3 alone vs suffix alone
vs no speculation on SmolLM2-135M-Instruct, in one run, on a mix of repetitive (agentic
tool-call / file-edit turns, from benchmarks/suffix_smollm2.py) and plain chat requests.

Greedy, batch 1 (the mix's requests one after another, chat and agentic turns interleaved, so
earlier outputs exist when later requests run). Every engine is built and warmed up first;
each repeat runs the whole mix once per engine, in an order rotating between repeats; suffix
decoding's global cache starts empty at each repeat. Prints tokens/s, the ratio to no
speculation and to the better single proposer, mean acceptance length, the drafts per proposer
(vllm:spec_decode_num_*_per_proposer) and whether the greedy text equals no speculation's.

    python benchmarks/hybrid_smollm2.py [--dtype float32] [--repeats 2] [--output-len 64]
        [--turns N] [--nodefer]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags, smollm2
from benchmarks.suffix_smollm2 import CHAT, _forget, agentic_turns, make_llm


def mix() -> list[str]:
    """Agentic turns with chat questions between them (two agentic turns, one chat, ...)."""
    agentic, chat = agentic_turns(), list(CHAT)
    out: list[str] = []
    while agentic or chat:
        out += agentic[:2]
        agentic = agentic[2:]
        if chat:
            out.append(chat.pop(0))
    return out


def per_proposer(llm) -> dict[str, list[float]]:
    """proposer -> [drafts, draft tokens, accepted tokens] so far."""
    out: dict[str, list[float]] = {}
    idx = {
        "vllm:spec_decode_num_drafts_per_proposer": 0,
        "vllm:spec_decode_num_draft_tokens_per_proposer": 1,
        "vllm:spec_decode_num_accepted_tokens_per_proposer": 2,
    }
    for m in llm.get_metrics():
        if m.name in idx:
            out.setdefault(m.labels["proposer"], [0.0, 0.0, 0.0])[idx[m.name]] = m.value
    return out


def timed(llm, turns: list[str], out_len: int):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=out_len)
    _forget(llm)
    before = per_proposer(llm)
    t = time.perf_counter()
    outs = [llm.chat([{"role": "user", "content": u}], sp, use_tqdm=False)[0] for u in turns]
    dt = time.perf_counter() - t
    after = per_proposer(llm)
    delta = {
        p: [a - b for a, b in zip(v, before.get(p, [0.0, 0.0, 0.0]))] for p, v in after.items()
    }
    ids = [list(o.outputs[0].token_ids) for o in outs]
    toks = sum(len(x) for x in ids)
    return toks / dt, toks, delta, ids


def main() -> None:
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--turns", type=int, default=0, help="the mix's first N requests (0: all)")
    ap.add_argument(
        "--nodefer",
        action="store_true",
        help="also hybrid-nodefer: the head's first pass on every row of every step (before "
        "the rows suffix serves were kept, FirstPassDeferral)",
    )
    args = ap.parse_args()
    head = str(SMOLLM2_EAGLE3_DIR)
    specs = {
        "none": None,
        "eagle3": {"method": "eagle3", "model": head, "num_speculative_tokens": 3},
        "suffix": {"method": "suffix"},
        "hybrid": {
            "method": "eagle3",
            "model": head,
            "num_speculative_tokens": 16,
            "hybrid_method": "suffix",
            "hybrid_model_num_speculative_tokens": 3,
        },
    }
    turns = mix()[: args.turns or None]
    model = smollm2()
    if args.nodefer:
        specs["hybrid-nodefer"] = specs["hybrid"]
    llms = {name: make_llm(model, args.dtype, s) for name, s in specs.items()}
    if args.nodefer:
        llms[
            "hybrid-nodefer"
        ].llm_engine.executor.worker.model_runner.speculator.drafter.deferral = None
    print(f"CPU: {cpu_flags()}; dtype {args.dtype}; batch 1; greedy; {len(turns)} requests")
    print(f"hybrid: {specs['hybrid']}", flush=True)
    runs: dict[str, list] = {}
    names = list(llms)
    try:
        for llm in llms.values():
            timed(llm, CHAT[:1], 8)  # warm-up
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                res = timed(llms[name], turns, args.output_len)
                runs.setdefault(name, []).append(res)
                print(f"  rep {r} {name}: {res[0]:.1f} tok/s", flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    med = {n: statistics.median(x[0] for x in rs) for n, rs in runs.items()}
    best_single = max(med["eagle3"], med["suffix"])
    ref = runs["none"][0][3]
    print("\n| engine | tok/s | vs none | vs better single | mean acc. len | drafts by proposer "
          "(drafts / draft tok / accepted) | text = none |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in names:
        rs = runs[name]
        tot: dict[str, list[float]] = {}
        for x in rs:
            for p, v in x[2].items():
                tot[p] = [a + b for a, b in zip(tot.get(p, [0.0, 0.0, 0.0]), v)]
        drafts = sum(v[0] for v in tot.values())
        acc = sum(v[2] for v in tot.values())
        mal = f"{1 + acc / drafts:.2f}" if drafts else "-"
        by = ", ".join(f"{p} {v[0]:.0f}/{v[1]:.0f}/{v[2]:.0f}" for p, v in tot.items() if v[0])
        same = all(x[3] == ref for x in rs)
        print(
            f"| {name} | {med[name]:.1f} | {med[name] / med['none']:.2f}x | "
            f"{med[name] / best_single:.2f}x | {mal} | {by or '-'} | {same} |"
        )
    print(f"\nhybrid / better of eagle3 and suffix: {med['hybrid'] / best_single:.2f}x")


if __name__ == "__main__":
    main()
