# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What the draft's confidence is worth: SmolLM2-135M-Instruct + the bundled EAGLE3 head, an
adaptive chain (adaptive_draft_confidence on), held-out chat prompts, batch B. After the run,
prints the engine's own calibration (v1/core/sched/draft_confidence.py): per bin of the
drafts' running confidence (the product of the draft's top probabilities along the chain),
how many verified drafts fell there and the share on the accepted path - raw counts without
the decay's forgetting weighed in only approximately (the decay is 0.999 per observation of a
bin) - and the fitted gain the scheduler prices drafts with. Greedy and sampled requests are
calibrated apart.

    python benchmarks/draft_confidence.py [--k 3] [--batch 1] [--prompts 16]
        [--temperature 0 0.7] [--output-len 96] [--tree N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags, smollm2
from benchmarks.eagle3_smollm2 import heldout_chats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tree", type=int, default=0, help="a dynamic tree of N nodes instead")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--output-len", type=int, default=96)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR
    from vllm.v1.core.sched.draft_confidence import BINS

    spec: dict = {"method": "eagle3", "model": str(SMOLLM2_EAGLE3_DIR)}
    spec |= {"num_tree_nodes": args.tree} if args.tree else {"num_speculative_tokens": args.k}
    llm = LLM(
        model=str(smollm2()), speculative_config=spec, max_num_seqs=args.batch, max_model_len=1024
    )
    try:
        chats = heldout_chats(args.prompts)
        for t in args.temperature:
            sp = SamplingParams(temperature=t, seed=7, max_tokens=args.output_len)
            for i in range(0, len(chats), args.batch):
                llm.chat(chats[i : i + args.batch], sp, use_tqdm=False)
        conf = llm.llm_engine.scheduler.spec_k.confidence
        assert conf is not None
    finally:
        llm.shutdown()
    shape = f"dynamic tree of {args.tree}" if args.tree else f"chain of {args.k}"
    print("---")
    print(f"CPU: {cpu_flags()}; float32; {shape}; batch {args.batch}; {args.prompts} prompts")
    for name, cal in (("greedy", conf.greedy), ("sampled", conf.sampled)):
        if sum(cal.seen) == 0:
            continue
        print(f"{name}: confidence bin | verified drafts (decayed) | on the accepted path | fitted")
        table = cal.table()
        for b in range(BINS):
            if cal.seen[b] < 1:
                continue
            lo, hi = b / BINS, (b + 1) / BINS
            rate = cal.hits[b] / cal.seen[b]
            print(f"  [{lo:.2f}, {hi:.2f})  {cal.seen[b]:8.1f}  {rate:6.2f}  {table[b]:6.2f}")


if __name__ == "__main__":
    main()
