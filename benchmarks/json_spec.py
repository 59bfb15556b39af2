# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""JSON-schema requests (a schema with long fixed keys, no free whitespace) without speculation
vs a draft model with grammar-blind drafts vs the same with grammar-aware drafting vs
jump-forward alone, in one run, at batch 1 and batch 8.

--model smollm2: SmolLM2-135M-Instruct and its bundled EAGLE3 head (K = 3), chat prompts.
--model bundled: the bundled tiny DeepSeek-V3 and its MTP heads (K = 2), code prompts. There
is no MTP head for SmolLM2, so MTP is measured on the bundled model only.

Every engine is built and warmed up first (the grammar compiles there); each repeat times every
(engine, batch) once, engines in an order rotating between repeats; medians. Greedy. Prints
tokens/s, the ratio to no speculation, mean acceptance length, the draft tokens the grammar
forced (the jump_forward proposer's counters), and whether every output is the same as without
speculation and valid for the schema.

    python benchmarks/json_spec.py [--model smollm2|bundled] [--batch 1 8] [--repeats 2]
        [--output-len 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags, smollm2
from benchmarks.hybrid_smollm2 import per_proposer

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 24},
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
        "preferred_contact_method": {"enum": ["email", "phone", "post"]},
        "shipping_address_city": {"type": "string", "maxLength": 16},
        "is_priority_customer": {"type": "boolean"},
    },
    "required": [
        "customer_full_name",
        "customer_account_identifier",
        "preferred_contact_method",
        "shipping_address_city",
        "is_priority_customer",
    ],
    "additionalProperties": False,
}
QUESTIONS = [
    "Describe a customer of a bookshop as JSON.",
    "Give me a JSON record for a customer who lives in Paris.",
    "Make up a customer record in JSON.",
    "Return the customer Alice Smith as a JSON object.",
    "Create a JSON customer entry for a priority customer.",
    "Write a JSON object describing a customer who prefers phone calls.",
    "Produce JSON for a customer with account 1234.",
    "Output a customer profile as JSON.",
]
CODE = [
    "customer = ",
    "def customer_record():\n    return ",
    "record = ",
    "payload = ",
    "profile = ",
    "def to_json(self):\n    return ",
    "entry = ",
    "data = ",
]


def engines(name: str) -> tuple[str, dict[str, dict | None]]:
    if name == "smollm2":
        from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

        draft = {"method": "eagle3", "model": str(SMOLLM2_EAGLE3_DIR), "num_speculative_tokens": 3}
        label, model = "eagle3", smollm2()
    else:
        from vllm.config import default_model_path

        draft = {"method": "mtp", "num_speculative_tokens": 2}
        label, model = "mtp", str(default_model_path())
    return model, {
        "none": None,
        label: {**draft, "grammar_aware_drafting": False},
        f"{label}+grammar": draft,
        "jump_forward": {"method": "jump_forward", "num_speculative_tokens": 8},
    }


def prompts(llm, name: str) -> list[str]:
    if name != "smollm2":
        return CODE
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["smollm2", "bundled"], default="smollm2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch1-requests", type=int, default=4, help="sequential at batch 1")
    ap.add_argument(
        "--profile", nargs="*", default=[], help="engines to profile at batch 1 (cProfile)"
    )
    args = ap.parse_args()

    import jsonschema

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    model, specs = engines(args.model)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, structured_outputs=so)
    short = SamplingParams(temperature=0, max_tokens=16, structured_outputs=so)
    llms = {
        n: LLM(
            model=model,
            dtype=args.dtype,
            speculative_config=s,
            max_model_len=1024,
            max_num_seqs=max(args.batch),
        )
        for n, s in specs.items()
    }
    print(f"CPU: {cpu_flags()}; {args.model}; dtype {args.dtype}; greedy", flush=True)
    ps = prompts(next(iter(llms.values())), args.model)

    def run(llm, batch: int):
        """Batch 1: the prompts one after another; batch B: B prompts together."""
        groups = [[p] for p in ps[: args.batch1_requests]] if batch == 1 else [ps[:batch]]
        before = per_proposer(llm)
        t = time.perf_counter()
        outs = [o for g in groups for o in llm.generate(g, sp, use_tqdm=False)]
        dt = time.perf_counter() - t
        after = per_proposer(llm)
        delta = {p: [a - b for a, b in zip(v, before.get(p, [0.0] * 3))] for p, v in after.items()}
        ids = [list(o.outputs[0].token_ids) for o in outs]
        valid = True
        for o in outs:
            try:
                jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
            except (ValueError, jsonschema.ValidationError):
                valid = False
        return sum(len(x) for x in ids) / dt, delta, ids, valid

    runs: dict[tuple[str, int], list] = {}
    names = list(llms)
    try:
        for llm in llms.values():
            for b in args.batch:  # warm-up: the grammar compiles, every batch shape seen
                llm.generate(ps[:b], short, use_tqdm=False)
        for n in args.profile:
            profile(lambda n=n: run(llms[n], 1), n)
        for r in range(args.repeats):
            for b in args.batch:
                for n in names[r % len(names) :] + names[: r % len(names)]:
                    res = run(llms[n], b)
                    runs.setdefault((n, b), []).append(res)
                    print(f"  rep {r} batch {b} {n}: {res[0]:.1f} tok/s", flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    print("\n| engine | batch | tok/s | vs none | mean acc. len | jump-forward draft tok "
          "(accepted) | text = none | valid JSON |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for b in args.batch:
        base = statistics.median(x[0] for x in runs[("none", b)])
        ref = runs[("none", b)][0][2]
        for n in names:
            rs = runs[(n, b)]
            tps = statistics.median(x[0] for x in rs)
            tot = [0.0, 0.0, 0.0]
            jf = [0.0, 0.0, 0.0]
            for x in rs:
                for p, v in x[1].items():
                    tot = [a + c for a, c in zip(tot, v)]
                    if p == "jump_forward":
                        jf = [a + c for a, c in zip(jf, v)]
            mal = f"{1 + tot[2] / tot[0]:.2f}" if tot[0] else "-"
            same = all(x[2] == ref for x in rs)
            valid = all(x[3] for x in rs)
            print(
                f"| {n} | {b} | {tps:.1f} | {tps / base:.2f}x | {mal} | "
                f"{jf[1]:.0f} ({jf[2]:.0f}) | {same} | {valid} |"
            )


# (label, file suffix, function): where a step's time goes (cumulative, so they nest).
PROFILED = [
    ("engine step", "v1/engine/llm_engine.py", "step"),
    ("runner execute_model", "worker/gpu/model_runner.py", "execute_model"),
    ("  sample + verify + propose", "worker/gpu/model_runner.py", "_sample_and_propose"),
    ("    grammar bitmasks (verify rows)", "sample/structured_outputs.py", "apply_bitmasks"),
    ("    grammar accept (sampled)", "sample/structured_outputs.py", "accept"),
    ("    draft model propose", "spec_decode/autoregressive/speculator.py", "propose"),
    ("      draft grammar mask", "sample/structured_outputs.py", "mask"),
    ("      draft grammar advance", "sample/structured_outputs.py", "advance"),
    ("    grammar fork for drafting", "sample/structured_outputs.py", "draft_grammar"),
    ("    constrain drafts / jump-forward", "sample/structured_outputs.py", "constrain_drafts"),
]


def profile(fn, name: str) -> None:
    """Run fn under cProfile; print the cumulative ms per engine step of PROFILED."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    got: dict[str, tuple[int, float]] = {}
    for (path, _, func), (_, calls, _, cum, _) in stats.items():
        for label, suffix, f in PROFILED:
            if func == f and path.endswith(suffix):
                c, t = got.get(label, (0, 0.0))
                got[label] = (c + calls, t + cum)
    steps = max(got.get("engine step", (1, 0.0))[0], 1)
    print(f"\nprofile of {name}, batch 1: {steps} engine steps, ms per step (cumulative)")
    for label, _, _ in PROFILED:
        if label in got:
            print(f"  {label:40s} {1000 * got[label][1] / steps:8.1f}")


if __name__ == "__main__":
    main()
