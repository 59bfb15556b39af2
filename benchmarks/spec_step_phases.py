# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Where a speculative decode step's time goes: SmolLM2-135M-Instruct + the bundled EAGLE3 head.

Each engine (no speculation, chains, trees; names as in tree_smollm2.py, NAME-nodefer: the
draft's first pass every step) generates for B held-out chat prompts at once; wall time of the
engine's own phases is summed over the timed run and divided by its scheduled steps: the
target's forward and LM head, the speculator's
propose (its first pass over the step's rows, the EAGLE3 fc, every draft forward, the draft
LM head, sampling, the inputs of the later draft steps), the scheduler. A phase nested in
another is counted in both (the draft forwards are part of propose). Medians of the repeats
(after one warm-up run).

    python benchmarks/spec_step_phases.py [--engines none chain3a tree6a] [--batch 16]
        [--output-len 32] [--repeats 2] [--waves W]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags, smollm2
from benchmarks.eagle3_smollm2 import heldout_chats
from benchmarks.tree_smollm2 import no_deferral, spec_of

# (owner, method, label): owner "engine", "scheduler", "runner", "model", "spec", "draft".
PHASES = [
    ("engine", "step", "engine step"),
    ("runner", "execute_model", "execute_model"),
    ("model", "forward", "target forward"),
    ("model", "compute_logits", "target LM head"),
    ("spec", "propose", "propose"),
    ("spec", "run_step0", "  draft first pass"),
    ("spec", "_prefill_hidden", "  EAGLE3 fc"),
    ("draft", "forward", "  draft forwards (all)"),
    ("spec", "_compute_logits", "  draft LM head"),
    ("spec", "sample_draft", "  draft sampling"),
    ("spec", "_decode_inputs", "  later steps' inputs"),
    ("scheduler", "schedule", "schedule"),
    ("scheduler", "update_from_output", "update_from_output"),
]


def instrument(llm, acc: dict[str, float]) -> None:
    eng = llm.llm_engine
    runner = eng.executor.worker.model_runner
    spec = runner.speculator
    owners = {
        "engine": eng,
        "scheduler": eng.scheduler,
        "runner": runner,
        "model": runner.model,
        "spec": spec,
        "draft": getattr(spec, "draft", None),
    }
    for owner, name, label in PHASES:
        obj = owners[owner]
        if obj is None or not hasattr(obj, name):
            continue
        f = getattr(obj, name)

        def timed(*a, _f=f, _label=label, **kw):
            acc["calls: " + _label] += 1
            t = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                acc[_label] += time.perf_counter() - t

        setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", nargs="+", default=["none", "chain3a", "tree6a"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--waves", type=int, default=1, help="W x B requests at once, B at a time (steady state)"
    )
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    model = smollm2()
    n = args.batch * args.waves
    chats = heldout_chats(n)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows: dict[str, dict[str, float]] = {}
    built: dict = {}  # engines run so far (shut down; their step costs are kept)
    for e in args.engines:
        llm = LLM(
            model=model,
            dtype=args.dtype,
            speculative_config=spec_of(e),
            max_model_len=1024,
            max_num_seqs=args.batch,
        )
        if e.endswith("-nodefer"):
            # The step costs of the same engine with the deferral where it ran before (list
            # it first), so that both decide the same drafts.
            no_deferral(llm, built.get(e.removesuffix("-nodefer")))
        built[e] = llm
        try:
            acc: dict[str, float] = defaultdict(float)
            instrument(llm, acc)
            llm.chat(chats, SamplingParams(max_tokens=8), use_tqdm=False)
            runs: list[dict[str, float]] = []
            for _ in range(args.repeats):
                acc.clear()
                t = time.perf_counter()
                outs = llm.chat(chats, sp, use_tqdm=False)
                dt = time.perf_counter() - t
                steps = max(int(acc["calls: schedule"]), 1)
                toks = sum(len(o.outputs[0].token_ids) for o in outs)
                run = {k: v / steps * 1e3 for k, v in acc.items() if not k.startswith("calls")}
                run["tok/s"], run["steps"], run["ms/step"] = toks / dt, steps, dt / steps * 1e3
                runs.append(run)
            rows[e] = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
        finally:
            llm.shutdown()
    print("---")
    print(
        f"CPU: {cpu_flags()}; {args.dtype}; batch {args.batch} ({n} requests); "
        f"{args.output_len} tokens"
    )
    labels = ["tok/s", "steps", "ms/step"] + [p[2] for p in PHASES]
    print(f"{'':24s}" + "".join(f"{e:>10s}" for e in args.engines))
    for label in labels:
        if not any(label in r for r in rows.values()):
            continue
        cells = "".join(f"{rows[e].get(label, 0.0):10.2f}" for e in args.engines)
        print(f"{label:24s}{cells}")


if __name__ == "__main__":
    main()
