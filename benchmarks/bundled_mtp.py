# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The bundled model's MTP heads: K = 0 (off), 1, 2, 3 at batch 1 and batch 16, P = 1 and 2, in
one run; mean acceptance length, per-position acceptance, tokens/s and speedup vs K = 0; plus
HF transformers generate (no MTP) on the same prompts as the reference. Writes
benchmarks/acceptance_per_position.png.

    python benchmarks/bundled_mtp.py [--pp 1 2] [--k 0 1 2 3] [--output-len 48]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [
    "def binary_search(items, target):\n",
    "class Queue:\n    def __init__(self):\n",
    "import json\n\n\ndef load_config(path):\n",
    "for key, value in sorted(counts.items()):\n",
    "    def __repr__(self):\n        return ",
    "if __name__ == '__main__':\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "    try:\n        result = func(*args)\n    except",
]


def run(pp: int, k: int, batch: int, prompts: list[str], out_len: int):
    from vllm import LLM, SamplingParams

    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(
        pipeline_parallel_size=pp, speculative_config=spec, max_num_seqs=batch, max_model_len=512
    )
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    base = {m.name: m for m in llm.get_metrics()}
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    m = {x.name: x for x in llm.get_metrics()}
    llm.shutdown()
    toks = sum(len(o.outputs[0].token_ids) for o in outs)

    def val(d, name):
        x = d.get(name)
        return 0 if x is None else x.value

    def vec(d, name):
        x = d.get(name)
        return [0] * k if x is None else list(x.values) + [0] * (k - len(x.values))

    drafts = val(m, "vllm:spec_decode_num_drafts") - val(base, "vllm:spec_decode_num_drafts")
    acc = val(m, "vllm:spec_decode_num_accepted_tokens") - val(
        base, "vllm:spec_decode_num_accepted_tokens"
    )
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    per_pos = [a - b for a, b in zip(vec(m, name), vec(base, name))]
    rates = [v / drafts for v in per_pos] if drafts else []
    mal = 1 + acc / drafts if drafts else 1.0
    return toks / dt, mal, rates, [o.outputs[0].token_ids for o in outs]


def run_hf(prompts: list[str], out_len: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm.config import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    t = time.perf_counter()
    n = 0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok.encode(p)])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=out_len,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            n += out.shape[1] - ids.shape[1]
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--plot", default=str(Path(__file__).parent / "acceptance_per_position.png"))
    args = ap.parse_args()
    rows = {}
    for batch in args.batch:
        prompts = (PROMPTS * ((batch + len(PROMPTS) - 1) // len(PROMPTS)))[: max(batch, 4)]
        for pp in args.pp:
            for k in args.k:
                tps, mal, rates, ids = run(pp, k, batch, prompts, args.output_len)
                rows[(batch, pp, k)] = (tps, mal, rates, ids)
                print(
                    f"batch {batch:2d} P={pp} K={k}: {tps:7.1f} tok/s  mean acceptance length "
                    f"{mal:.2f}  per position {[round(r, 3) for r in rates]}",
                    flush=True,
                )
    hf = run_hf(PROMPTS[:4], args.output_len)
    print(f"HF transformers generate (batch 1, no MTP): {hf:.1f} tok/s")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for (batch, pp, k), (_, _, rates, _) in sorted(rows.items()):
            if k and batch == args.batch[0] and pp == args.pp[0]:
                ax.plot(range(1, k + 1), rates, marker="o", label=f"K={k}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.set_title("Bundled model: MTP acceptance per position (greedy)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"plot: {args.plot}")
    except ImportError:
        pass
    print("---")
    for batch in args.batch:
        for pp in args.pp:
            base = rows.get((batch, pp, 0))
            for k in args.k:
                if not k or base is None:
                    continue
                tps, mal, _, ids = rows[(batch, pp, k)]
                same = ids == base[3]
                print(
                    f"batch {batch:2d} P={pp} K={k}: speedup vs K=0 {tps / base[0]:.2f}x, "
                    f"mean acceptance length {mal:.2f}, greedy identical to K=0: {same}"
                )
    for k in args.k:
        if k and (args.batch[0], 1, k) in rows and (args.batch[0], 2, k) in rows:
            r = rows[(args.batch[0], 2, k)][1] / rows[(args.batch[0], 1, k)][1]
            print(f"acceptance-length ratio P2/P1 at K={k}: {r:.2f}")
    if (1, 1, 0) in rows:
        print(f"ours (batch 1, P=1, K=0) vs HF generate: {rows[(1, 1, 0)][0] / hf:.2f}x")


if __name__ == "__main__":
    main()
