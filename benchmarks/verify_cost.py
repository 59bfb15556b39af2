# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What a verify pass costs: the target's forward (+ LM head over every row) for one request
with M = 1..32 new tokens (a verify step of K = M - 1 drafts), relative to M = 1, and the
batch-1 decode step's share of the memory roofline.

The model is SmolLM2-135M-Instruct by default, built by the engine (P = 1, eager), and its
forward is called directly with the attention metadata of one request of --context tokens plus
M new ones (short-query rows: the CPU small-M kernel's route). `--routes kernel blas` times
the same forwards with every row sent to BLAS (torch's linear, what decode and verify rows ran
before), interleaved within each repeat; medians of --repeats.

Roofline: the weight bytes one token streams (every linear layer and the LM head) divided by
the read bandwidth measured in the same run (a sum over fresh buffers larger than the caches,
with the engine's thread count), against the measured M = 1 step.

Compute ceiling: torch's fp32 GEMM on a cache-resident product (multiply-adds per second,
same run); the many-row forwards' linear multiply-adds per second are held against it, and the
"compute floor" of M rows is M x the linear multiply-adds at that rate (what the forward would
cost if the linear layers ran at BLAS's best and nothing else took time).

    python benchmarks/verify_cost.py [--dtype float32 bfloat16] [--max-m 32] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from benchmarks.common import cpu_flags, resolve_model


def read_bandwidth(nbytes: int = 1 << 28, copies: int = 3, repeats: int = 7) -> float:
    """Bytes per second of a plain sum over buffers that do not fit in the caches."""
    bufs = [torch.ones(nbytes // 4) for _ in range(copies)]
    for b in bufs:
        b.sum()
    times = []
    for r in range(repeats):
        b = bufs[r % copies]
        t0 = time.perf_counter()
        b.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def gemm_rate(repeats: int = 9) -> float:
    """Multiply-adds per second of torch's fp32 GEMM on a cache-resident [256 x 576] x
    [576 x 576] product (BLAS at its best on this core: the compute ceiling the kernel's many-row
    forwards are held against)."""
    a, b = torch.randn(256, 576), torch.randn(576, 576)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 256 * 576 * 576 / statistics.median(times)


def _streamed_weights(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Each 2-D weight one token's forward streams, once: not the embedding (one row of it is
    read) unless it is also the LM head (tied)."""
    embed = model.get_submodule("model.embed_tokens").weight
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if p.dim() != 2 or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p.data_ptr() == embed.data_ptr() and "lm_head" not in name:
            continue
        yield p


def linear_macs(model: torch.nn.Module) -> int:
    """Multiply-adds of one token's linear layers and LM head (weight_bytes' weights)."""
    embed = model.get_submodule("model.embed_tokens").weight
    head = model.get_submodule("lm_head").weight
    total = sum(p.numel() for p in _streamed_weights(model))
    return total + (head.numel() if head.data_ptr() == embed.data_ptr() else 0)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one token's forward streams: every 2-D weight but the embedding
    (one row of it is read), the LM head counted once even when tied."""
    embed = model.get_submodule("model.embed_tokens").weight
    total = sum(p.numel() * p.element_size() for p in _streamed_weights(model))
    head = model.get_submodule("lm_head").weight
    if head.data_ptr() == embed.data_ptr():
        total += head.numel() * head.element_size()
    return total


def linear_only(model: torch.nn.Module, ms: list[int], repeats: int) -> dict[int, float]:
    """Milliseconds of CPU time (this thread) for the kernel over every linear weight of the
    model and the LM head with M rows of random activations: the forward's weight products
    alone, without attention, norms or Python, and without the time the scheduler gives to
    other processes (steadier than the wall clock on a shared machine)."""
    from vllm import _custom_ops as ops

    embed = model.get_submodule("model.embed_tokens").weight
    head = model.get_submodule("lm_head").weight
    skip = {embed.data_ptr(), head.data_ptr()}
    weights = [p for p in model.parameters() if p.dim() == 2 and p.data_ptr() not in skip]
    weights.append(head)
    xs = {m: {w.shape[1]: torch.randn(m, w.shape[1]).to(w.dtype) for w in weights} for m in ms}

    def run(m: int) -> None:
        for w in weights:
            ops.linear_small_m(xs[m][w.shape[1]], w, None)

    times: dict[int, list[float]] = {m: [] for m in ms}
    with torch.inference_mode():
        for m in ms:
            run(m)
        for rep in range(repeats):
            for m in ms if rep % 2 == 0 else ms[::-1]:
                t0 = time.thread_time()
                run(m)
                times[m].append(time.thread_time() - t0)
    return {m: statistics.median(v) * 1e3 for m, v in times.items()}


def make_step(runner, context: int, m: int, route: str) -> Callable[[], torch.Tensor]:
    """One forward (+ LM head) of m new tokens; route "blas" sends every row to BLAS (the
    forward context's rows fixed to ALL_LONG), "kernel" routes them by kind (all decode rows)."""
    from vllm.attention.backends.torch_paged import build_attn_metadata
    from vllm.forward_context import ALL_LONG, ALL_SHORT, ForwardContext

    model, bs = runner.model, runner.block_size
    seq = context + m
    blocks = np.arange((seq + bs - 1) // bs, dtype=np.int64)[None, :]
    positions = np.arange(context, seq, dtype=np.int64)
    meta = build_attn_metadata(
        np.array([0, m]),
        np.array([seq]),
        blocks,
        bs,
        runner.device,
        positions=positions,
        short_query_len=m,
    )
    ids = torch.randint(0, 1000, (m,))
    pos = torch.from_numpy(positions)
    ctx = ForwardContext(meta)
    head_rows = ALL_SHORT
    if route == "blas":
        ctx, head_rows = ctx.with_rows(ALL_LONG), ALL_LONG

    def step() -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(ids, pos, None, ctx=ctx)
            return model.compute_logits(hidden, head_rows)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--max-m", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--num-threads", type=int, default=None, help="intra-op threads")
    ap.add_argument("--routes", nargs="+", default=["kernel", "blas"], choices=["kernel", "blas"])
    ap.add_argument(
        "--linear-only",
        action="store_true",
        help="time only the kernel over the model's linear weights (CPU time), no forwards",
    )
    args = ap.parse_args()

    from vllm import LLM
    from vllm import _custom_ops as ops

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    path = resolve_model(args.model)
    print(f"CPU: {cpu_flags()}; load average at start {os.getloadavg()[0]:.1f}")
    assert ops.cpu_kernels_available(), "the CPU kernels did not build"
    print(
        f"threads: {torch.get_num_threads()}, kernel path: {ops.linear_isa()}, "
        f"(1=portable 2=avx2 3=avx512 4=avx512bf16)"
    )
    for dtype in args.dtype:
        llm = LLM(
            model=path,
            dtype=dtype,
            max_model_len=args.context + args.max_m + 16,
            max_num_seqs=1,
            enforce_eager=True,
        )
        runner = llm.llm_engine.executor.worker.model_runner
        wbytes = weight_bytes(runner.model)
        ms = list(range(1, args.max_m + 1))
        if args.linear_only:
            macs = linear_macs(runner.model)
            lin = linear_only(runner.model, ms, args.repeats)
            print(f"\n== {dtype}: {_linear_line(lin, ms, macs, wbytes)}")
            del llm, runner
            continue
        steps = {
            (r, m): make_step(runner, args.context, m, r) for r in ("kernel", "blas") for m in ms
        }
        for f in steps.values():  # warm-up
            f()
        times: dict[tuple[str, int], list[float]] = {(r, m): [] for r in args.routes for m in ms}
        bws: list[float] = []
        rates: list[float] = []
        for rep in range(args.repeats):
            bws.append(read_bandwidth())
            order = [(r, m) for m in ms for r in args.routes]
            if rep % 2:
                order.reverse()
            for r, m in order:
                t0 = time.perf_counter()
                steps[(r, m)]()
                times[(r, m)].append(time.perf_counter() - t0)
            rates.append(gemm_rate())
        bw = statistics.median(bws)
        rate = statistics.median(rates)
        macs = linear_macs(runner.model)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"\n== {dtype}: weights streamed per token {wbytes / 1e6:.0f} MB, read bandwidth "
            f"{bw / 1e9:.1f} GB/s -> roofline {wbytes / bw * 1e3:.2f} ms per forward; "
            f"fp32 GEMM ceiling {rate / 1e9:.1f} GMAC/s -> {macs / rate * 1e3:.2f} ms of "
            f"linear multiply-adds per row; load average {os.getloadavg()[0]:.1f}"
        )
        header = "  M " + "".join(f"| {r} ms  x(M=1) " for r in args.routes)
        print(header)
        for m in ms:
            row = f"{m:3d} "
            for r in args.routes:
                row += f"| {med[(r, m)]:7.2f}  {med[(r, m)] / med[(r, 1)]:5.2f}x  "
            print(row)
        for r in args.routes:
            share = wbytes / bw * 1e3 / med[(r, 1)]
            rel = ", ".join(
                f"M={m} {med[(r, m)] / med[(r, 1)]:.2f}x" for m in (4, 8, 16, 32) if m in ms
            )
            print(
                f"{r}: M=1 forward {med[(r, 1)]:.2f} ms = {share:.0%} of the memory roofline; "
                f"{rel} the M=1 forward"
            )
        for r in args.routes:
            # Where the many-row time goes: the linear multiply-adds per second of the forward
            # against the GEMM ceiling, and the compute floor of M rows against M = 1.
            parts = []
            for m in (8, 16, 32):
                if m not in ms:
                    continue
                floor = max(med[(r, 1)], m * macs / rate * 1e3)
                parts.append(
                    f"M={m} {m * macs / (med[(r, m)] / 1e3) / 1e9:.1f} GMAC/s "
                    f"({m * macs / (med[(r, m)] / 1e3) / rate:.0%} of the ceiling; compute "
                    f"floor {floor / med[(r, 1)]:.2f}x M=1)"
                )
            print(f"{r}: " + ", ".join(parts))
        lin = linear_only(runner.model, ms, args.repeats)
        print(_linear_line(lin, ms, macs, wbytes))
        if "blas" in args.routes and "kernel" in args.routes:
            print(
                "kernel vs blas speed-up: "
                + " ".join(
                    f"M={m}:{med[('blas', m)] / med[('kernel', m)]:.2f}x"
                    for m in (1, 2, 3, 4, 8, 16, 32)
                    if m in ms
                )
            )
        del llm, runner, steps


def _linear_line(lin: dict[int, float], ms: list[int], macs: int, wbytes: int) -> str:
    return (
        "kernel, linear products only (CPU ms of this thread; x M=1; GMAC/s): "
        + ", ".join(
            f"M={m} {lin[m]:.1f} ({lin[m] / lin[1]:.2f}x; {m * macs / lin[m] / 1e6:.1f})"
            for m in ms
            if m in (1, 2, 4, 8, 16, 32)
        )
        + f"; M=1 streams {wbytes / lin[1] / 1e6:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
