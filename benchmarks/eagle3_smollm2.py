# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""SmolLM2-135M-Instruct with the bundled EAGLE3 head vs without speculation, in one run.

Chat prompts held out from the head's training data; greedy; K = 0 (off), the given fixed K
and the adaptive K policy (at most --adaptive-k), batch 1 (requests one after another), 8 and
16 (requests together), P = 1 and 2, fp32 and bf16. All engines of a
(dtype, P) pair are built first; then every repeat times each (batch, K) once, in an order that
rotates between repeats, and the medians are reported. Prints tokens/s, speedup over K = 0,
mean acceptance length and per-position acceptance, checks the greedy text equals K = 0's, and
plots the per-position acceptance (benchmarks/eagle3_smollm2_acceptance.png).

    python benchmarks/eagle3_smollm2.py [--dtype float32 bfloat16] [--pp 1 2] [--k 0 1 2 3 4]
        [--adaptive-k 3] [--batch 1 8 16] [--repeats 3] [--output-len 64] [--profile] [--no-plot]

--profile instead breaks one P=1 run's step time down (target forward, target logits,
sampling / verification, draft prefill pass, draft decode steps, draft logits and sampling,
the rest = host overhead of scheduler, runner and engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags, smollm2


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


PLOT = Path(__file__).parent / "eagle3_smollm2_acceptance.png"


def heldout_chats(n: int) -> list[list[dict[str, str]]]:
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

    prompts = json.loads((SMOLLM2_EAGLE3_DIR / "heldout_prompts.json").read_text())
    # More than there are: the prompts again, in order.
    return [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(n)]


def make_llm(model: str, dtype: str, pp: int, k: int, max_seqs: int, adaptive: bool = False):
    """K = 0: no speculation; else the bundled head with K drafts per step (adaptive: K is the
    most the engine's adaptive policy may draft, else every step drafts K)."""
    from vllm import LLM
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

    spec = None
    if k:
        spec = {
            "method": "eagle3",
            "model": str(SMOLLM2_EAGLE3_DIR),
            "num_speculative_tokens": k,
            "adaptive_num_speculative_tokens": adaptive,
        }
    return LLM(
        model=model,
        dtype=dtype,
        pipeline_parallel_size=pp,
        speculative_config=spec,
        max_model_len=1024,
        max_num_seqs=max_seqs,
    )


def _spec_counters(llm) -> tuple[float, float, list[float]]:
    m = {x.name: x for x in llm.get_metrics()}
    d = m.get("vllm:spec_decode_num_drafts")
    a = m.get("vllm:spec_decode_num_accepted_tokens")
    p = m.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return (d.value if d else 0, a.value if a else 0, list(p.values) if p else [])


def timed_run(llm, chats, batch: int, out_len: int):
    """(tokens/s, drafts, accepted, per-position accepted, token ids per prompt)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    d0, a0, p0 = _spec_counters(llm)
    t = time.perf_counter()
    outs = []
    for i in range(0, len(chats), batch):
        outs += llm.chat(chats[i : i + batch], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    d1, a1, p1 = _spec_counters(llm)
    p0 = p0 + [0] * (len(p1) - len(p0))
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    per_pos = [b - a for a, b in zip(p0, p1)]
    return toks / dt, d1 - d0, a1 - a0, per_pos, [list(o.outputs[0].token_ids) for o in outs]


def bench(args) -> dict:
    from vllm import SamplingParams

    model = smollm2()
    results: dict = {}
    for dtype in args.dtype:
        for pp in args.pp:
            llms = {
                label: make_llm(model, dtype, pp, _k(label), max(args.batch), label.endswith("a"))
                for label in args.labels
            }
            try:
                for llm in llms.values():  # warm-up
                    llm.chat(heldout_chats(1), SamplingParams(max_tokens=8), use_tqdm=False)
                samples = defaultdict(list)
                order = [(b, k) for b in args.batch for k in args.labels]
                for r in range(args.repeats):
                    rot = order[r % len(order) :] + order[: r % len(order)]
                    for batch, k in rot:
                        chats = heldout_chats(args.num_prompts_b1 if batch == 1 else batch)
                        samples[(batch, k)].append(
                            timed_run(llms[k], chats, batch, args.output_len)
                        )
                        tps = samples[(batch, k)][-1][0]
                        print(f"  {dtype} P={pp} batch {batch} K={k} rep {r}: {tps:.1f} tok/s")
                for (batch, k), runs in samples.items():
                    drafts = sum(x[1] for x in runs)
                    acc = sum(x[2] for x in runs)
                    per_pos = [sum(x[3][i] for x in runs) for i in range(_k(k))]
                    results[(dtype, pp, batch, k)] = {
                        "tps": statistics.median(x[0] for x in runs),
                        "mal": 1 + acc / drafts if drafts else 1.0,
                        "rates": [v / drafts for v in per_pos] if drafts else [],
                        "ids": runs[0][4],
                        "same_across_repeats": all(x[4] == runs[0][4] for x in runs),
                    }
            finally:
                for llm in llms.values():
                    llm.shutdown()
    return results


def _k(label: str) -> int:
    """Engine label -> K: "3" is K = 3 every step, "3a" the adaptive policy with at most 3."""
    return int(label.rstrip("a"))


def report(args, results: dict) -> None:
    print("---")
    print(f"CPU: {cpu_flags()}; torch threads {torch_threads()}")
    for key in sorted(results):
        dtype, pp, batch, k = key
        row = results[key]
        base = results.get((dtype, pp, batch, "0"))
        sp = f"{row['tps'] / base['tps']:.2f}x" if base else "-"
        same = base is not None and row["ids"] == base["ids"] and row["same_across_repeats"]
        rates = " ".join(f"{r:.2f}" for r in row["rates"])
        print(
            f"{dtype:8s} P={pp} batch {batch} K={k}: {row['tps']:7.1f} tok/s  speedup {sp:>6s}  "
            f"mean acc len {row['mal']:.2f}  per position [{rates}]  identical to K=0: {same}"
        )
    print("---")
    for dtype in args.dtype:
        for batch in args.batch:
            best = {}
            for pp in args.pp:
                cands = [
                    (
                        results[(dtype, pp, batch, k)]["tps"]
                        / results[(dtype, pp, batch, "0")]["tps"],
                        k,
                    )
                    for k in args.labels
                    if k != "0" and (dtype, pp, batch, "0") in results
                ]
                if cands:
                    best[pp] = max(cands)
            line = ", ".join(f"P={pp}: {s:.2f}x (K={k})" for pp, (s, k) in best.items())
            line += " (Na: adaptive, at most N)"
            print(f"{dtype} batch {batch}: best speedup {line}")
            if 1 in best and 2 in best:
                print(
                    f"{dtype} batch {batch}: P=2 / P=1 speedup ratio {best[2][0] / best[1][0]:.2f}"
                )
    if args.no_plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        dtype, pp, batch = args.dtype[0], args.pp[0], args.batch[0]
        fig, ax = plt.subplots(figsize=(6, 4))
        for k in args.labels:
            row = results.get((dtype, pp, batch, k))
            if k != "0" and not k.endswith("a") and row:
                ax.plot(range(1, _k(k) + 1), row["rates"], marker="o", label=f"K={k}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.set_title(f"SmolLM2-135M + EAGLE3 head ({dtype}, P={pp}, batch {batch}, held-out)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(PLOT)
        print(f"plot: {PLOT}")
    except ImportError:
        pass


class _Timers:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.undo: list[tuple[object, str, object]] = []

    def wrap(self, obj, attr: str, name, key=None):
        orig = getattr(obj, attr)

        def wrapped(*a, **kw):
            label = name(*a, **kw) if callable(name) else name
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.t[label] += time.perf_counter() - t0
                self.n[label] += 1

        self.undo.append((obj, attr, orig))
        setattr(obj, attr, wrapped)

    def restore(self) -> None:
        for obj, attr, orig in reversed(self.undo):
            setattr(obj, attr, orig)
        self.undo.clear()


def profile(args) -> None:
    """Per-step time breakdown of P=1 runs (uniproc: the runner is in this process)."""
    from vllm.v1.worker.gpu.sample.sampler import SamplingArrays

    model = smollm2()
    dtype = args.dtype[0]
    for batch in args.batch:
        for k in args.k:
            llm = make_llm(model, dtype, 1, k, batch)
            tm = _Timers()
            try:
                from vllm import SamplingParams

                llm.chat(heldout_chats(1), SamplingParams(max_tokens=8), use_tqdm=False)
                runner = llm.llm_engine.executor.worker.model_runner
                tm.wrap(llm.llm_engine, "step", "engine step (total)")
                tm.wrap(runner.model, "forward", "target forward")
                tm.wrap(runner.model, "compute_logits", "target logits")
                tm.wrap(runner, "prepare", "input preparation")
                tm.wrap(SamplingArrays, "sample", "sampling")
                tm.wrap(runner, "rejection_sampler", "verification (rejection sampler)")
                spec = runner.speculator
                if spec is not None:
                    tm.wrap(spec, "propose", "draft propose (total)")
                    tm.wrap(
                        spec,
                        "_run_model",
                        lambda *a, **kw: "draft prefill pass" if a[4] == 0 else "draft decode step",
                    )
                    tm.wrap(spec, "_compute_logits", "draft logits")
                    tm.wrap(spec, "sample_draft", "draft sampling")
                chats = heldout_chats(args.num_prompts_b1 if batch == 1 else batch)
                tps, drafts, acc, _, _ = timed_run(llm, chats, batch, args.output_len)
                steps = tm.n["engine step (total)"]
                total = tm.t["engine step (total)"]
                inner = sum(
                    tm.t[x]
                    for x in (
                        "input preparation",
                        "target forward",
                        "target logits",
                        "sampling",
                        "verification (rejection sampler)",
                        "draft propose (total)",
                    )
                )
                mal = 1 + acc / drafts if drafts else 1.0
                print(
                    f"{dtype} P=1 batch {batch} K={k}: {tps:.1f} tok/s, {steps} steps, "
                    f"{1000 * total / steps:.1f} ms/step, mean acceptance length {mal:.2f}"
                )
                for name in sorted(tm.t, key=lambda x: -tm.t[x]):
                    if name == "engine step (total)":
                        continue
                    print(
                        f"    {name:34s} {1000 * tm.t[name] / steps:7.1f} ms/step "
                        f"({tm.n[name] / steps:.1f} calls/step)"
                    )
                rest = 1000 * (total - inner) / steps
                print(f"    {'host overhead (rest)':34s} {rest:7.1f} ms/step")
            finally:
                tm.restore()
                llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument(
        "--adaptive-k",
        type=int,
        nargs="*",
        default=[3],
        help="also engines with the adaptive K policy, at most these K (reported as Na)",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts-b1", type=int, default=4, help="requests run one by one")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-plot", action="store_true", help="leave the acceptance png as it is")
    args = ap.parse_args()
    if args.profile:
        profile(args)
        return
    if 0 not in args.k:
        args.k = [0, *args.k]
    args.labels = [str(k) for k in args.k] + [f"{k}a" for k in args.adaptive_k]
    report(args, bench(args))


if __name__ == "__main__":
    main()
