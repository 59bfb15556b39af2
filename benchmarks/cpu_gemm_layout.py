# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Where a CPU decode step's GEMM time goes, by weight layout and row count.

The engine runs every linear layer as `F.linear(x, W)` with W stored [out, in] (the checkpoint's
layout). On CPU the GEMM library picks its kernel by layout and M (rows: batch x (K + 1) tokens
in a verify pass), and for the small M of decoding that choice matters more than the FLOPs. This
times, for the linear shapes of one model (SmolLM2-135M's by default), three ways to compute the
same product:

  NT      F.linear(x, W), W [out, in]           (what the engine does now)
  NN      x @ Wt, Wt = W.T made contiguous [in, out]
  packed  torch.ops.mkl._mkl_linear with W reordered once by _mkl_reorder_linear_weight

Each decoder shape is timed over --layers distinct copies of the weight (so, as in a real
forward, every weight comes from memory, not cache), the LM head over one. Methods run
interleaved within each repeat; medians of --repeats; ratios are against NT in the same run.

    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm_layout.py [--rows 1 2 3 4 8 32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def shapes(hidden: int, inter: int, heads: int, kv_heads: int, vocab: int) -> dict:
    head_dim = hidden // heads
    return {
        "qkv": (hidden + 2 * kv_heads * head_dim, hidden),
        "o_proj": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (vocab, hidden),
    }


def methods(weights: list[torch.Tensor]) -> dict:
    nn_w = [w.t().contiguous() for w in weights]
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, 4) for w in weights]
    return {
        "NT": lambda x: [F.linear(x, w) for w in weights],
        "NN": lambda x: [x @ w for w in nn_w],
        "packed": lambda x: [
            torch.ops.mkl._mkl_linear(x, p, w, None, x.shape[0]) for p, w in zip(packed, weights)
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 32])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    if not torch.backends.mkl.is_available():
        sys.exit("this torch build has no MKL (the packed method needs it)")
    torch.manual_seed(0)
    # fp32 only: the engine's fp32 linears are these BLAS calls (bf16 has its own small-M
    # kernel, layers/gemm.py).
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32")
    print(f"{'shape':>8} {'out x in':>11} {'M':>3} {'NT us':>8} {'NN':>14} {'packed':>14}")
    per_m: dict[int, dict[str, float]] = {m: {} for m in args.rows}
    for name, (out_f, in_f) in shapes(
        args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab
    ).items():
        copies = 1 if name == "lm_head" else args.layers
        run = methods([torch.randn(out_f, in_f) for _ in range(copies)])
        for m in args.rows:
            x = torch.randn(m, in_f)
            ref = run["NT"](x)[0]
            for f in run.values():  # same result, and a warm-up
                torch.testing.assert_close(f(x)[0], ref, atol=1e-3, rtol=1e-3)
            times: dict[str, list[float]] = {k: [] for k in run}
            for r in range(args.repeats):
                order = list(run)[r % 3 :] + list(run)[: r % 3]
                for k in order:
                    t0 = time.perf_counter()
                    run[k](x)
                    times[k].append((time.perf_counter() - t0) / copies * 1e6)
            med = {k: statistics.median(v) for k, v in times.items()}
            for k, v in med.items():  # a whole forward's worth
                per_m[m][k] = per_m[m].get(k, 0.0) + v * copies
            print(
                f"{name:>8} {f'{out_f}x{in_f}':>11} {m:>3} {med['NT']:>8.0f} "
                + " ".join(f"{med[k]:>7.0f} ({med['NT'] / med[k]:.2f}x)" for k in ("NN", "packed"))
            )
    print(f"\none forward's GEMMs ({args.layers} layers + LM head), ms; speedup vs NT:")
    for m, tot in per_m.items():
        nt = tot["NT"]
        print(
            f"  M={m:>3}: NT {nt / 1e3:6.1f}  "
            + "  ".join(f"{k} {v / 1e3:6.1f} ({nt / v:.2f}x)" for k, v in tot.items() if k != "NT")
        )


if __name__ == "__main__":
    main()
