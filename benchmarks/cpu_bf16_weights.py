# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The small-M kernel on an EAGLE3 head's linear shapes (SmolLM2's: fc, qkv, o, gate-up, down,
LM head): fp32 rows by fp32 weights vs the same rows by the same values stored in bf16 (what an
fp32 draft keeps of a bf16 head, layers/exact_bf16.py), and bf16 rows by bf16 weights vs fp32
rows by bf16 weights. Every product is checked bit for bit against the fp32-weight one first.
M rows per call, the configurations interleaved within each of --repeats repeats (5 passes over
the six shapes each), medians.

    python benchmarks/cpu_bf16_weights.py [--threads 2] [--repeats 7] [--rows 1 2 4 5 8 16 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags

SHAPES = [(576, 1728), (960, 1152), (576, 576), (3072, 576), (576, 1536), (8192, 576)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32])
    args = ap.parse_args()
    import torch

    from vllm import _custom_ops as ops

    torch.set_num_threads(args.threads)
    if not ops.cpu_kernels_available():
        raise SystemExit("the CPU kernels did not build")
    g = torch.Generator().manual_seed(0)
    w16 = [torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in SHAPES]
    w32 = [w.float() for w in w16]
    print(f"CPU: {cpu_flags()}; {args.threads} threads; kernel path {ops.linear_isa()}")
    print("M: rows; A: fp32 rows x fp32 weights; B: fp32 rows x bf16 weights; C: bf16 x bf16")
    print(f"{'M':>3s} {'A':>9s} {'B':>9s} {'B/A':>6s}   {'C':>9s} {'B/C':>6s}")
    for m in args.rows:
        x32 = [torch.randn(m, k, generator=g) for _, k in SHAPES]
        x16 = [x.to(torch.bfloat16) for x in x32]
        for x, a, b in zip(x32, w32, w16):
            assert torch.equal(ops.linear_small_m(x, a), ops.linear_small_m(x, b))
        cases = {"fp32": (x32, w32), "mixed": (x32, w16), "bf16": (x16, w16)}
        times: dict[str, list[float]] = {c: [] for c in cases}
        for _ in range(args.repeats):
            for c, (xs, ws) in cases.items():
                t = time.perf_counter()
                for _ in range(5):
                    for x, w in zip(xs, ws):
                        ops.linear_small_m(x, w)
                times[c].append((time.perf_counter() - t) / 5 * 1e3)
        f, mx, bf = (statistics.median(times[c]) for c in ("fp32", "mixed", "bf16"))
        print(f"{m:3d} {f:7.2f}ms {mx:7.2f}ms {mx / f:5.2f}x   {bf:7.2f}ms {mx / bf:5.2f}x")


if __name__ == "__main__":
    main()
