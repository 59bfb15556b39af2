# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""SmolLM2-135M-Instruct with the bundled EAGLE3 head: fixed K vs the adaptive K vs no
speculation, at batch 1 / 8 / 16 and temperature 0 and 1.0 (the OpenAI default), in one run.

Held-out chat prompts; every request has max_tokens = --output-len (ignore_eos). Engines: no
speculation, EAGLE3 with K fixed (adaptive off) and EAGLE3 with the adaptive K (the default;
the per-batch-size schedule not set). All are built and warmed up first; each repeat times
every (engine, batch, temperature) once in a rotating order; medians. Prints tokens/s, the
ratio to no speculation and the mean drafts verified per request-step.

    python benchmarks/spec_k_smollm2.py [--dtype float32] [--k 3] [--batch 1 8 16]
        [--temperature 0 1] [--repeats 3] [--output-len 48]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import smollm2
from benchmarks.eagle3_smollm2 import heldout_chats


def make_llm(model: str, dtype: str, spec: dict | None, max_seqs: int):
    from vllm import LLM

    return LLM(
        model=model,
        dtype=dtype,
        speculative_config=spec,
        max_model_len=512,
        # A small step budget keeps start-up's warm-up short (it prefills a full budget).
        max_num_batched_tokens=256,
        max_num_seqs=max_seqs,
    )


def _counters(llm) -> tuple[float, float]:
    m = {x.name: x for x in llm.get_metrics()}
    d = m.get("vllm:spec_decode_num_draft_tokens")
    a = m.get("vllm:spec_decode_num_accepted_tokens")
    return (d.value if d else 0.0, a.value if a else 0.0)


def timed(llm, chats, batch: int, temperature: float, out_len: int, seed: int):
    from vllm import SamplingParams

    sps = [
        SamplingParams(temperature=temperature, max_tokens=out_len, ignore_eos=True, seed=seed + i)
        for i in range(len(chats))
    ]
    d0, a0 = _counters(llm)
    t = time.perf_counter()
    outs = []
    for i in range(0, len(chats), batch):
        outs += llm.chat(chats[i : i + batch], sps[i : i + batch], use_tqdm=False)
    dt = time.perf_counter() - t
    d1, a1 = _counters(llm)
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return toks / dt, toks, d1 - d0, a1 - a0, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--num-prompts-b1", type=int, default=2)
    args = ap.parse_args()
    head = str(SMOLLM2_EAGLE3_DIR)
    eagle3 = {"method": "eagle3", "model": head, "num_speculative_tokens": args.k}
    specs = {
        "none": None,
        f"eagle3 K={args.k} fixed": {**eagle3, "adaptive_num_speculative_tokens": False},
        f"eagle3 K={args.k} adaptive": eagle3,
    }
    model = smollm2()
    max_seqs = max(args.batch)
    llms = {name: make_llm(model, args.dtype, s, max_seqs) for name, s in specs.items()}
    cells = [(b, t) for b in args.batch for t in args.temperature]
    runs: dict[tuple, list] = {}
    try:
        for llm in llms.values():
            timed(llm, heldout_chats(1), 1, 0.0, 8, 0)  # warm-up
        order = [(name, b, t) for name in llms for b, t in cells]
        for r in range(args.repeats):
            step = (r * len(order)) // max(args.repeats, 1)
            for name, b, t in order[step:] + order[:step]:
                chats = heldout_chats(args.num_prompts_b1 if b == 1 else b)
                res = timed(llms[name], chats, b, t, args.output_len, seed=100 * r)
                runs.setdefault((name, b, t), []).append(res)
                print(f"  rep {r} {name} batch {b} T={t}: {res[0]:.1f} tok/s", flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    print("---")
    for b, t in cells:
        base = statistics.median(x[0] for x in runs[("none", b, t)])
        for name in llms:
            rs = runs[(name, b, t)]
            tps = statistics.median(x[0] for x in rs)
            toks = sum(x[1] for x in rs)
            drafts = sum(x[2] for x in rs)
            acc = sum(x[3] for x in rs)
            steps = toks - acc
            same = all(x[4] == y[4] for x, y in zip(rs, runs[("none", b, t)]))
            print(
                f"{args.dtype} batch {b:2d} T={t:.1f} {name:18s}: {tps:6.1f} tok/s  "
                f"{tps / base:.2f}x  drafts/step {drafts / max(steps, 1):.2f}  "
                f"tokens/step {toks / max(steps, 1):.2f}  text = none: {same}"
            )


if __name__ == "__main__":
    main()
