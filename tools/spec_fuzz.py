# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Randomized differential runs: seeded request mixes (vllm.testing.request_mix: every sampling
feature that reads a step's tokens, chunked prefill, a small KV cache) generated without
speculation and with each engine, compared request by request. Prints every mismatch and a
summary line per seed; exits 1 if any.

    python tools/spec_fuzz.py                          # the bundled MTP model, 10 seeds
    python tools/spec_fuzz.py --seeds 100 140 -pp 2
    python tools/spec_fuzz.py --model smollm2 --engines eagle3 eagle3-tree suffix
    python tools/spec_fuzz.py --model /path/to/target --spec '{"method": "ngram", ...}'

tests/e2e/test_spec_mixed_batch.py runs a few fixed seeds of the same mixes on every commit.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def engines(names: list[str], extra: list[str]) -> dict[str, dict]:
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

    head = str(SMOLLM2_EAGLE3_DIR)
    known = {
        "mtp": {"method": "mtp", "num_speculative_tokens": 3},
        "mtp-tree": {"method": "mtp", "num_tree_nodes": 8},
        "eagle3": {"method": "eagle3", "model": head, "num_speculative_tokens": 3},
        "eagle3-tree": {"method": "eagle3", "model": head, "num_tree_nodes": 10},
        "suffix": {"method": "suffix"},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    }
    out = {}
    for n in names:
        fixed = n.endswith("-fixed")  # the step-cost model off: drafts every step
        base = known[n.removesuffix("-fixed")]
        out[n] = {**base, "adaptive_num_speculative_tokens": False} if fixed else base
    out |= {f"spec{i}": json.loads(s) for i, s in enumerate(extra)}
    return out


def run(args, model: str, knobs: dict, prompts: list, params: list, spec: dict | None):
    """One engine's outputs of the mix and its (drafts, draft tokens, accepted)."""
    from vllm import LLM
    from vllm.testing.engine_utils import spec_decode_counts
    from vllm.testing.request_mix import outputs

    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=512,
        speculative_config=spec,
        pipeline_parallel_size=args.pipeline_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=True,
        disable_log_stats=False,
        **knobs,
    )
    try:
        return outputs(llm.generate(prompts, params, use_tqdm=False)), spec_decode_counts(llm)[:3]
    finally:
        llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-deepseek-mtp", help="zoo name or folder")
    ap.add_argument("--engines", nargs="*", default=["mtp-fixed", "mtp-tree-fixed", "suffix"])
    ap.add_argument("--spec", action="append", default=[], help="a speculative_config (JSON)")
    ap.add_argument("--seeds", nargs=2, type=int, default=[0, 10], metavar=("FIRST", "END"))
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    ap.add_argument(
        "--dtype",
        default="float32",
        help="float32 (the lossless reference) or bfloat16: also compared exactly, so a "
        "difference there may be a prefill chunked otherwise (BLAS is not batch-invariant)",
    )
    args = ap.parse_args()

    from vllm.model_zoo import zoo_names, zoo_path
    from vllm.testing.request_mix import random_knobs, random_params, same_outputs

    model = zoo_path(args.model) if args.model in zoo_names() else args.model
    vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 512)
    specs = engines(args.engines, args.spec)
    bad = 0
    for seed in range(*args.seeds):
        rng = random.Random(seed)
        kinds, params = random_params(rng, rng.randint(2, args.requests), vocab, first="stop")
        knobs = random_knobs(rng, small_kv_blocks=40)
        prompts = [
            {"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(rng.randint(3, 60))]}
            for _ in params
        ]

        ref, _ = run(args, model, knobs, prompts, params, None)
        line = []
        for name, spec in specs.items():
            got, counts = run(args, model, knobs, prompts, params, spec)
            for i, (r, g) in enumerate(zip(ref, got)):
                if not same_outputs(g, r):
                    bad += 1
                    print(f"MISMATCH seed {seed} {name} completion {i} ({params[i]!r})")
                    print(f"  none: {r[:4]}\n  spec: {g[:4]}", flush=True)
            line.append(f"{name} drafts/draft tokens/accepted {counts}")
        print(f"seed {seed}: {sorted(set(kinds))} {knobs}; " + "; ".join(line), flush=True)
    print(f"{bad} mismatches")
    if bad and args.dtype != "float32":
        print(
            f"({args.dtype}: the engines schedule prefill chunks and preemptions differently, and "
            "a prefill's BLAS product is not row-invariant, so a bf16 near-tie can flip; fp32 "
            "is the lossless reference - rerun a seed in float32)"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
