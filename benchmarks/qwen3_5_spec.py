# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""MTP speculation on a hybrid (Qwen3.5-shaped) target vs none, same prompts, one run: spec off
and MTP K = 1, 2, 3 at batch 1 and 16. Prints tokens/s, mean acceptance length, and the time
spent choosing each request's linear-attention state after rejections (the state rollback) per
step; checks greedy outputs equal the no-spec run; prints the speedup ratios last.

    python -m benchmarks.qwen3_5_spec                      # near-self MTP head (partial accept)
    python -m benchmarks.qwen3_5_spec --mtp-heads random   # acceptance ~0: rollback every step
    python -m benchmarks.qwen3_5_spec --pp 1 2

The target: 8 layers, 3 Gated DeltaNet layers per full-attention layer (Qwen3.5's pattern),
hidden 128, dense MLP, one MTP layer. --mtp-heads as in benchmarks/spec_decode.py: random (the
checkpoint's), near (target layers x0.3 and an MTP head reproducing the bigram part), self
(bigram target, every draft accepted). Rollback time is read from the in-process worker, so it
is shown for P = 1 only.
"""

from __future__ import annotations

import argparse

from benchmarks.common import CACHE, timer

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def _model(mtp_heads: str, hidden: int) -> str:
    from vllm.testing.qwen3_5_checkpoints import make_qwen3_5, make_qwen3_5_mtp_self_draft

    base = CACHE / f"qwen3_5-h{hidden}-mtp1"
    if not (base / "config.json").exists():
        make_qwen3_5(
            str(base), layer_types=LAYER_TYPES * 2, mtp_num_hidden_layers=1, hidden_size=hidden
        )
    if mtp_heads == "random":
        return str(base)
    out = CACHE / f"qwen3_5-h{hidden}-mtp1-{mtp_heads}"
    if not (out / "config.json").exists():
        make_qwen3_5_mtp_self_draft(
            str(out), str(base), target_scale=0.0 if mtp_heads == "self" else 0.3
        )
    return str(out)


def _spec_counts(llm) -> tuple[int, int]:
    m = {x.name: x for x in llm.get_metrics()}
    if "vllm:spec_decode_num_drafts" not in m:
        return 0, 0
    return m["vllm:spec_decode_num_drafts"].value, m["vllm:spec_decode_num_accepted_tokens"].value


def _states(llm):
    worker = getattr(llm.llm_engine.executor, "worker", None)
    return worker.model_runner.linear_attn_states if worker is not None else None


def run(model: str, prompts, output_len: int, pp: int, k: int) -> dict:
    from vllm import LLM, SamplingParams

    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=len(prompts),
        pipeline_parallel_size=pp,
        speculative_config=spec,
        disable_log_stats=False,
    )
    try:
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompts[0]}], warm, use_tqdm=False)
        states = _states(llm)
        s0 = (states.select_s, states.num_steps) if states is not None else None
        d0, a0 = _spec_counts(llm)
        sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        with timer() as t:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        d1, a1 = _spec_counts(llm)
        rollback = None
        if s0 is not None:
            steps = states.num_steps - s0[1]
            rollback = (states.select_s - s0[0]) / max(steps, 1), steps
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    drafts = d1 - d0
    return {
        "tok_s": sum(len(x) for x in tokens) / t["s"],
        "wall_s": t["s"],
        "tokens": tokens,
        "mean_len": 1 + (a1 - a0) / drafts if drafts else 1.0,
        "rollback": rollback,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--mtp-heads", choices=["random", "near", "self"], default="near")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--pp", type=int, nargs="+", default=[1])
    ap.add_argument("--hidden-size", type=int, default=128)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead
    from vllm.testing.engine_utils import make_prompts

    model = _model(args.mtp_heads, args.hidden_size)
    print(
        f"Qwen3.5-shaped target (8 layers, 6 linear + 2 full attention, H={args.hidden_size}), "
        f"{args.input_len} -> {args.output_len} tokens, greedy, MTP heads: {args.mtp_heads}"
    )
    print(f"{'pp':>2} {'batch':>5} {'K':>2} {'tok/s':>8} {'mean len':>8} {'rollback/step':>14}")
    ratios = []
    for pp in args.pp:
        for b in args.batch_sizes:
            prompts = make_prompts(512, [args.input_len] * b, seed=b)
            base = run(model, prompts, args.output_len, pp, 0)
            for k in [0, *args.k]:
                r = base if k == 0 else run(model, prompts, args.output_len, pp, k)
                rb = "n/a"
                if r["rollback"] is not None:
                    per, steps = r["rollback"]
                    rb = f"{per * 1e6:8.1f} us"
                    share = per * steps / r["wall_s"]
                    rb += f" ({share:.2%})"
                same = r["tokens"] == base["tokens"]
                print(
                    f"{pp:>2} {b:>5} {k:>2} {r['tok_s']:>8.1f} {r['mean_len']:>8.2f} {rb:>14}"
                    + ("" if same else "  OUTPUT DIFFERS FROM NO-SPEC RUN"),
                    flush=True,
                )
                if k:
                    ratios.append(f"pp{pp} b{b} K={k}: {r['tok_s'] / base['tok_s']:.2f}x")
    print("speedup vs no speculation (tok/s ratio): " + ", ".join(ratios))


if __name__ == "__main__":
    main()
