# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Speculative decoding vs none, same prompts, same target, one run: MTP (K = 1, 2, 3) on a tiny
DeepSeek-V3, and EAGLE3, DFlash and DSpark (K = 2, 4) on a tiny Llama. Prints tokens/s, mean
acceptance length and per-position acceptance of every configuration, checks greedy outputs are
identical, and prints the speedup ratios last; at P = 1 also the drafter's time per step
(propose: EAGLE3 runs K draft forwards, DFlash / DSpark one block forward) and its ratio to
EAGLE3's at the same K.

    python benchmarks/spec_decode.py --num-prompts 8 --input-len 64 --output-len 64
    python benchmarks/spec_decode.py --mtp-heads self     # MTP heads that reproduce the target
    python benchmarks/spec_decode.py --pp 1 2             # P = 1 and P = 2, with and without
                                                          # speculation; acceptance ratio P2/P1 last
    python benchmarks/spec_decode.py --mtp-k --dflash-k 2 4 8   # EAGLE3 vs DFlash / DSpark only

--dflash-heads: random, or bigram (constructed heads that draft the near-bigram target's bigram
map: partial acceptance; DFlash drafts only its first token well, DSpark chains it).
--mtp-heads: random (the checkpoint's random MTP layer: acceptance near 0, shows the overhead),
near (the target mostly a bigram model that the MTP head reproduces: partial acceptance),
self (a bigram target: every draft accepted, the upper bound).
"""

from __future__ import annotations

import argparse

from benchmarks.common import CACHE, timer


def _near_bigram_llama(llama: str) -> str:
    """The Llama target with attention / MLP outputs x0.2: mostly a bigram model."""
    from vllm.testing.spec_checkpoints import make_llama_bigram_target

    out = CACHE / "tiny-llama-near-bigram"
    if not (out / "config.json").exists():
        make_llama_bigram_target(str(out), llama, target_scale=0.2)
    return str(out)


def _dflash_heads(llama: str, max_k: int, kind: str) -> dict[str, str]:
    """Speculators-format DFlash and DSpark heads for the Llama target with blocks large
    enough for max_k drafts: random (DSpark: vanilla Markov head, confidence head), or the
    constructed bigram heads of the tests (partial acceptance on the near-bigram target)."""
    from vllm.testing.speculators_dflash_heads import make_bigram_head, make_speculators_dflash

    out = {}
    for method in ("dflash", "dspark"):
        path = CACHE / f"tiny-llama-{method}-{kind}-b{max_k + 1}"
        if not (path / "config.json").exists():
            if kind == "bigram":
                make_bigram_head(path, llama, method == "dspark", max_k)
            else:
                make_speculators_dflash(
                    str(path), llama, dspark=method == "dspark", block_size=max_k + 1
                )
        out[method] = str(path)
    return out


def _models(mtp_heads: str) -> tuple[str, str, str]:
    from vllm.testing.checkpoints import make_deepseek_v3, make_llama
    from vllm.testing.spec_checkpoints import make_eagle3_draft, make_mtp_self_draft

    ds = CACHE / "tiny-deepseek-v3-mtp1"
    if not (ds / "config.json").exists():
        make_deepseek_v3(str(ds), num_nextn_predict_layers=1, max_position_embeddings=1024)
    mtp = str(ds)
    if mtp_heads != "random":
        scale = 0.0 if mtp_heads == "self" else 0.2
        out = CACHE / f"tiny-deepseek-v3-mtp1-{mtp_heads}"
        if not (out / "config.json").exists():
            make_mtp_self_draft(str(out), str(ds), target_scale=scale)
        mtp = str(out)
    llama = CACHE / "tiny-llama-eagle3-target"
    if not (llama / "config.json").exists():
        make_llama(str(llama), max_position_embeddings=1024)
    draft = CACHE / "tiny-llama-eagle3-draft"
    if not (draft / "config.json").exists():
        make_eagle3_draft(str(draft), str(llama), aux_layers=(1, 2, 3), draft_vocab_size=256)
    return mtp, str(llama), str(draft)


def _spec_counts(llm) -> tuple[int, int, list[int]]:
    m = {x.name: x for x in llm.get_metrics()}
    if "vllm:spec_decode_num_drafts" not in m:  # no speculation: the counters never moved
        return 0, 0, []
    return (
        m["vllm:spec_decode_num_drafts"].value,
        m["vllm:spec_decode_num_accepted_tokens"].value,
        list(m["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
    )


def run(model: str, prompts, output_len: int, pp: int, spec: dict | None, max_num_seqs: int):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        pipeline_parallel_size=pp,
        speculative_config=spec,
        disable_log_stats=False,
    )
    draft_s: list[float] = []
    try:
        sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompts[0]}], warm, use_tqdm=False)
        if spec and pp == 1:
            _time_propose(llm, draft_s)
        d0, a0, p0 = _spec_counts(llm)
        with timer() as t:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        d1, a1, p1 = _spec_counts(llm)
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    k = spec["num_speculative_tokens"] if spec else 0
    drafts, accepted = d1 - d0, a1 - a0
    per_pos = [b - (p0[i] if i < len(p0) else 0) for i, b in enumerate(p1)] + [0] * k
    return {
        "tok_s": sum(len(x) for x in tokens) / t["s"],
        "tokens": tokens,
        "mean_len": 1 + accepted / drafts if drafts else 1.0,
        "per_pos": [v / drafts if drafts else 0.0 for v in per_pos[:k]],
        # Median drafter time per step (ms), P = 1 only (the drafter runs in this process).
        "draft_ms": 1e3 * sorted(draft_s)[len(draft_s) // 2] if draft_s else None,
    }


def _time_propose(llm, out: list[float]) -> None:
    """Record the wall time of every speculator.propose call (P = 1: in this process)."""
    import time

    spec = llm.llm_engine.executor.worker.model_runner.speculator
    orig = spec.propose

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        r = orig(*args, **kwargs)
        out.append(time.perf_counter() - t0)
        return r

    spec.propose = timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--mtp-heads", choices=["random", "near", "self"], default="random")
    ap.add_argument(
        "--dflash-heads",
        choices=["random", "bigram"],
        default="random",
        help="bigram: constructed heads on a near-bigram Llama target (all Llama rows use it)",
    )
    ap.add_argument("--mtp-k", type=int, nargs="*", default=[1, 2, 3])
    ap.add_argument("--eagle3-k", type=int, nargs="+", default=[2, 4])
    ap.add_argument(
        "--dflash-k", type=int, nargs="*", default=[2, 4], help="K of the DFlash / DSpark rows"
    )
    ap.add_argument("--pp", type=int, nargs="+", default=[1], help="pipeline sizes to run")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead
    from vllm.testing.engine_utils import make_prompts

    mtp, llama, draft = _models(args.mtp_heads)
    prompts = make_prompts(512, [args.input_len] * args.num_prompts, seed=0)
    cases = [("mtp", mtp, None, k) for k in args.mtp_k]
    cases += [("eagle3", llama, draft, k) for k in args.eagle3_k]
    if args.dflash_heads == "bigram":
        llama = _near_bigram_llama(llama)
        cases = [c if c[0] != "eagle3" else (c[0], llama, c[2], c[3]) for c in cases]
    if args.dflash_k:
        heads = _dflash_heads(llama, max(args.dflash_k), args.dflash_heads)
        cases += [(m, llama, heads[m], k) for k in args.dflash_k for m in ("dflash", "dspark")]
    print(
        f"{args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} tokens, "
        f"greedy, max_num_seqs={args.max_num_seqs}, MTP heads: {args.mtp_heads}"
    )
    header = (
        f"{'pp':>2} {'method':<7} {'K':>2} {'tok/s':>8} {'mean len':>8} {'draft ms':>8}  "
        "per-position"
    )
    ratios = []
    accept_len: dict[tuple[int, str, int], float] = {}
    draft_ms: dict[tuple[str, int], float] = {}
    targets = {mtp: "mtp"} if args.mtp_k else {}
    targets[llama] = "eagle3 / dflash / dspark"
    for pp in args.pp:
        base = {m: run(m, prompts, args.output_len, pp, None, args.max_num_seqs) for m in targets}
        print(header)
        for m, name in targets.items():
            print(
                f"{pp:>2} {'none':<7} {0:>2} {base[m]['tok_s']:>8.1f} {1.0:>8.2f} {'':>8}  "
                f"({name} target)"
            )
        for method, target, draft_dir, k in cases:
            spec = {"method": method, "num_speculative_tokens": k}
            if draft_dir:
                spec["model"] = draft_dir
            r = run(target, prompts, args.output_len, pp, spec, args.max_num_seqs)
            same = r["tokens"] == base[target]["tokens"]
            rates = " ".join(f"{x:.2f}" for x in r["per_pos"])
            ms = f"{r['draft_ms']:>8.2f}" if r["draft_ms"] is not None else f"{'':>8}"
            if r["draft_ms"] is not None:
                draft_ms[(method, k)] = r["draft_ms"]
            print(
                f"{pp:>2} {method:<7} {k:>2} {r['tok_s']:>8.1f} {r['mean_len']:>8.2f} {ms}  "
                f"[{rates}]" + ("" if same else "  OUTPUT DIFFERS FROM NO-SPEC RUN")
            )
            ratios.append(f"pp{pp} {method} K={k}: {r['tok_s'] / base[target]['tok_s']:.2f}x")
            accept_len[(pp, method, k)] = r["mean_len"]
    print("speedup vs no speculation (tok/s ratio): " + ", ".join(ratios))
    cost = [
        f"{m} K={k}: {draft_ms[(m, k)] / draft_ms[('eagle3', k)]:.2f}"
        for m, k in draft_ms
        if m in ("dflash", "dspark") and ("eagle3", k) in draft_ms
    ]
    if cost:
        print("drafter time per step vs EAGLE3 at the same K (P = 1): " + ", ".join(cost))
    # Same drafts, same acceptance under PP: the ratio must be 1.00 for greedy sampling.
    p1 = args.pp[0]
    for pp in args.pp[1:]:
        parts = [
            f"{method} K={k}: {accept_len[(pp, method, k)] / accept_len[(p1, method, k)]:.2f}"
            for method, _, _, k in cases
        ]
        print(f"acceptance-length ratio P{pp}/P{p1}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
