# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The CPU decode-attention kernel (csrc/cpu/paged_attention.cpp) per call, against the torch
reference path (padded_attention) in the same run: SmolLM2-135M's heads (9 query / 3 KV heads
of 64), a batch-1 decode (1 query token), a verify of 4 / 8 / 16 tokens (chain and tree mask),
batch 8 x 4 tokens and batch 16 decode, at a context of --context keys; fp32 and bf16. Also
the kernel with its key split forced off, to check the automatic split (flash-decoding parts)
against not splitting. Medians of interleaved repeats. (Tree rows: no torch column - the torch
path applies a tree mask in the layer, not in padded_attention.)

    python benchmarks/cpu_attention.py [--context 160 1000] [--threads 1 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags

H, HKV, D, BLOCK = 9, 3, 64, 16
CASES = [  # (requests, query tokens each, tree mask)
    (1, 1, False),
    (1, 4, False),
    (1, 8, False),
    (1, 16, False),
    (1, 8, True),
    (1, 16, True),
    (8, 4, False),
    (16, 1, False),
]


def make_case(reqs: int, m: int, ctx: int, dtype: torch.dtype, tree: bool, seed: int = 0):
    """(kernel args, metadata for the torch path): paged caches with a shuffled block table; a
    tree mask of random parents when tree."""
    from vllm.attention.backends.torch_paged import build_attn_metadata

    g = torch.Generator().manual_seed(seed)
    seq = ctx + m
    nb = -(-seq // BLOCK)
    k = torch.randn(reqs * nb * BLOCK, HKV, D, generator=g).to(dtype)
    v = torch.randn(reqs * nb * BLOCK, HKV, D, generator=g).to(dtype)
    q = torch.randn(reqs * m, H, D, generator=g).to(dtype)
    perm = torch.randperm(reqs * nb, generator=g).numpy()
    table = perm.reshape(reqs, nb).astype(np.int64)
    seq_lens = np.full(reqs, seq, dtype=np.int64)
    qsl = np.arange(reqs + 1, dtype=np.int64) * m
    mask = None
    if tree:
        mask = np.zeros((reqs, m, m), dtype=bool)
        rng = np.random.default_rng(seed)
        for r in range(reqs):
            parents = [-1] + [int(rng.integers(0, i)) for i in range(1, m)]
            for i in range(m):
                j = i
                while j >= 0:
                    mask[r, i, j] = True
                    j = parents[j]
    meta = build_attn_metadata(qsl, seq_lens, table, BLOCK, "cpu", short_query_len=m)
    out = torch.empty_like(q)
    args = [out, q, k, v, torch.from_numpy(table), torch.from_numpy(seq_lens)]
    args += [torch.from_numpy(qsl), torch.arange(reqs), BLOCK, D**-0.5, 0]
    args += [None if mask is None else torch.from_numpy(mask)]
    return args, (q, k, v, meta)


def per_call_us(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, nargs="+", default=[160, 1000])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from vllm import _custom_ops as ops
    from vllm.attention.backends.torch_paged import padded_attention

    assert ops.cpu_kernels_available(), "the CPU kernels did not build"
    print(f"CPU: {cpu_flags()}; heads {H} / {HKV} kv, head size {D}; us per call, medians")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (getattr(torch, d) for d in args.dtype):
            for ctx in args.context:
                print(f"\n== {threads} thread(s), {str(dtype)[6:]}, context {ctx}")
                head = f"{'case':>14} | {'kernel':>8} | {'no split':>8} | {'torch':>8}"
                print(head + " | torch/kernel")
                for reqs, m, tree in CASES:
                    kargs, (q, k, v, meta) = make_case(reqs, m, ctx, dtype, tree)
                    unsplit = list(kargs)
                    unsplit[10] = 1 << 30
                    runs = {
                        "kernel": lambda a=kargs: ops.paged_attention(*a),
                        "no split": lambda a=unsplit: ops.paged_attention(*a),
                    }
                    if not tree:  # (the torch path applies a tree mask elsewhere)
                        runs["torch"] = lambda q=q, k=k, v=v, meta=meta: padded_attention(
                            q, k, v, meta, D**-0.5, out=torch.empty_like(q)
                        )
                    calls = max(20, 4000 // (reqs * m * max(ctx // 160, 1)))
                    t: dict[str, list[float]] = {n: [] for n in runs}
                    for rep in range(args.repeats):
                        for n in runs if rep % 2 == 0 else reversed(list(runs)):
                            t[n].append(per_call_us(runs[n], calls))
                    med = {n: statistics.median(v) for n, v in t.items()}
                    name = f"{reqs} x {m}{' tree' if tree else ''}"
                    ref = (
                        f"{med['torch']:8.1f} | {med['torch'] / med['kernel']:.1f}x"
                        if "torch" in med
                        else f"{'-':>8} | -"
                    )
                    print(f"{name:>14} | {med['kernel']:8.1f} | {med['no split']:8.1f} | {ref}")


if __name__ == "__main__":
    main()
