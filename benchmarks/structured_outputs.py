# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tokens/s of JSON-schema requests vs plain ones, with and without speculation (the bundled
model, MTP K = 2): what the grammar's per-position bitmask costs a step. One engine per K; the
plain and JSON workloads alternate in it (warm-up first, then interleaved repeats, medians).

    python benchmarks/structured_outputs.py [--k 0 2] [--repeats 3] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "size": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["list", "dict", "set", "tuple"]},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "size", "kind", "items"],
    "additionalProperties": False,
}
PROMPTS = [
    "def describe(obj):\n    return ",
    "config = ",
    "def summary(items):\n    return ",
    "result = ",
    "payload = ",
    "def to_json(self):\n    return ",
    "defaults = ",
    "meta = ",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    js = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    rows = []
    for k in args.k:
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        llm = LLM(
            speculative_config=spec,
            max_model_len=512,
            max_num_seqs=max(args.batch),
            disable_log_stats=False,
        )
        try:
            for batch in args.batch:
                prompts = PROMPTS[:batch]
                for sp in (plain, js):  # warm-up (the grammar compiles here)
                    llm.generate(prompts, sp, use_tqdm=False)
                rates: dict[str, list[float]] = {"plain": [], "json": []}
                acc = {"plain": [0, 0], "json": [0, 0]}  # drafts, accepted
                for _ in range(args.repeats):
                    for name, sp in (("plain", plain), ("json", js)):
                        before = _spec_counts(llm)
                        t = time.perf_counter()
                        outs = llm.generate(prompts, sp, use_tqdm=False)
                        dt = time.perf_counter() - t
                        after = _spec_counts(llm)
                        acc[name][0] += after[0] - before[0]
                        acc[name][1] += after[1] - before[1]
                        toks = sum(len(o.outputs[0].token_ids) for o in outs)
                        rates[name].append(toks / dt)
                med = {n: statistics.median(v) for n, v in rates.items()}
                mal = {n: 1 + a / d if d else 1.0 for n, (d, a) in acc.items()}
                rows.append((k, batch, med["plain"], med["json"], mal["plain"], mal["json"]))
                print(f"K={k} batch={batch}: plain {med['plain']:.1f} tok/s, "
                      f"json {med['json']:.1f} tok/s ({med['json'] / med['plain']:.2f}x)",
                      flush=True)  # fmt: skip
        finally:
            llm.shutdown()
    base = {b: (p, j) for k, b, p, j, _, _ in rows if k == 0}
    print(
        "\n| K | batch | plain tok/s | JSON-schema tok/s | JSON / plain | JSON vs K=0 JSON "
        "| mean acceptance length plain / JSON |"
    )
    print("|---|---|---|---|---|---|---|")
    for k, b, p, j, mp, mj in rows:
        rel = f"{j / base[b][1]:.2f}x" if b in base else "-"
        print(f"| {k} | {b} | {p:.1f} | {j:.1f} | {j / p:.2f}x | {rel} | {mp:.2f} / {mj:.2f} |")


def _spec_counts(llm) -> tuple[int, int]:
    m = {x.name: x for x in llm.get_metrics()}
    if "vllm:spec_decode_num_drafts" not in m:
        return 0, 0
    return (
        int(m["vllm:spec_decode_num_drafts"].value),
        int(m["vllm:spec_decode_num_accepted_tokens"].value),
    )


if __name__ == "__main__":
    main()
