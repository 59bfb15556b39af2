# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Time to first token by prompt length against HF transformers, prefill tokens/s at 512-token
chunks against the GEMM peak measured in the same run, and the BLAS routes per dtype.

Every number is a ratio within one run (the machine is shared): per repeat, for each length,
the engine's TTFT (`LLM.generate`, max_tokens=1, a fresh random prompt each time, prefix
caching off) and one HF forward of the same length (`model(ids, logits_to_keep=1)`: the
prefill HF's generate() runs, its LM head on the last position only, as ours) run back to
back; medians over --repeats. Default engine settings otherwise (max_num_batched_tokens 2048:
prompts past it are chunked, the later chunks attending to their cached context).

GEMM peak: the best route's rate on a 2048 x 2048 x 2048 product, interleaved with the
repeats. Model FLOPs: the linear layers' 2 x params per token plus causal attention
(4 x layers x heads x head_dim x n(n+1)/2). Routes: the model's own four projection shapes at
M = 512 and 2048 rows through each BLAS route (fp32: MKL via torch's linear, oneDNN's
linear; bf16: native bf16, fp32 MKL / oneDNN on widened copies), and the route the engine
picked. Attention: one layer's causal attention over 512 / 2000 fresh tokens through the CPU
prefill kernel (paged cache), SDPA's causal path and SDPA with a boolean mask.

    python benchmarks/prefill.py [--dtypes float32 bfloat16] [--lengths 256 512 1000 2000 4000 8000]
        [--repeats 3] [--chunk 512] [--hf-budget-s 600] [--num-threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.common import cpu_flags, resolve_model


def load_avg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def model_flops(cfg, n: int) -> tuple[float, float]:
    """(linear-layer FLOPs, causal attention FLOPs) of prefilling n tokens (LM head: one row,
    left out)."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = getattr(cfg, "head_dim", None) or h // H
    per_layer = h * (H + 2 * Hkv) * D + H * D * h + 3 * h * cfg.intermediate_size
    return 2.0 * L * per_layer * n, 4.0 * L * H * D * n * (n + 1) / 2


def gemm_routes(dtype: torch.dtype) -> dict:
    """name -> f(x, w): the BLAS routes of a prefill product in this dtype."""

    def onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    if dtype == torch.float32:
        return {"mkl": F.linear, "onednn": onednn}
    return {
        "native": F.linear,
        "fp32 mkl": lambda x, w: F.linear(x.float(), w.float()).to(dtype),
        "fp32 onednn": lambda x, w: onednn(x.float(), w.float()).to(dtype),
    }


def time_gemms(dtype, shapes, m, reps=3) -> dict[str, float]:
    """GF/s of each route over the given [N, K] weights at m rows (interleaved, medians)."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g).to(dtype) for n, k in shapes]
    xs = [torch.randn(m, k, generator=g).to(dtype) for _, k in shapes]
    flops = sum(2.0 * m * n * k for n, k in shapes)
    routes = gemm_routes(dtype)
    times: dict[str, list[float]] = {r: [] for r in routes}
    for f in routes.values():
        f(xs[0], ws[0])
    for _ in range(reps):
        for r, f in routes.items():
            t = time.perf_counter()
            for x, w in zip(xs, ws):
                f(x, w)
            times[r].append(time.perf_counter() - t)
    return {r: flops / statistics.median(v) / 1e9 for r, v in times.items()}


def time_attention(cfg, n: int, dtype: torch.dtype, reps: int = 3) -> dict[str, float]:
    """GF/s of one layer's causal attention over n fresh tokens (the model's heads): the CPU
    prefill kernel reading a paged cache, SDPA's causal path and SDPA with a boolean mask
    (what the padded groups ran), on the same tensors (interleaved, medians)."""
    from vllm import _custom_ops as ops

    assert ops.cpu_kernels_available(), "the CPU kernels did not build"
    h, H = cfg.hidden_size, cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = getattr(cfg, "head_dim", None) or h // H
    bs = 16
    nb = -(-n // bs)
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(nb + 4, generator=g)[:nb].long()[None]
    q = torch.randn(n, H, D, generator=g).to(dtype)
    kc = torch.randn((nb + 4) * bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn((nb + 4) * bs, Hkv, D, generator=g).to(dtype)
    pos = torch.arange(n)
    slots = table[0][pos // bs] * bs + pos % bs
    meta = (table, torch.tensor([n]), torch.tensor([0, n]), torch.tensor([0]))
    out = torch.empty(n, H, D, dtype=dtype)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]

    def kernel():
        ops.prefill_attention(out, q, kc, vc, *meta, bs, D**-0.5)

    def sdpa(m=None):
        k = kc[slots].transpose(0, 1)[None]
        v = vc[slots].transpose(0, 1)[None]
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k, v, attn_mask=m, is_causal=m is None, enable_gqa=True
        )

    fns = {"kernel": kernel, "sdpa causal": sdpa, "sdpa mask": lambda: sdpa(mask)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    flops = 4.0 * H * D * n * (n + 1) / 2
    return {k: flops / statistics.median(v) / 1e9 for k, v in times.items()}


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1000, 2000, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="token budget of the throughput run")
    ap.add_argument("--chunked-prompt", type=int, default=2048)
    ap.add_argument(
        "--hf-budget-s",
        type=float,
        default=600.0,
        help="skip HF at longer prompts once one HF forward took longer than this",
    )
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument(
        "--micro-only", action="store_true", help="only the BLAS-route and attention timings"
    )
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers import gemm as linear_mod

    path = resolve_model(args.model)
    cfg = AutoConfig.from_pretrained(path)
    print(f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model {path}; load average at start {load_avg()} (shared machine)")
    h, inter = cfg.hidden_size, cfg.intermediate_size
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = getattr(cfg, "head_dim", None) or h // H
    shapes = [((H + 2 * Hkv) * D, h), (h, H * D), (2 * inter, h), (h, inter)]
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    max_len = max(args.lengths + [args.chunked_prompt])

    for dt_name in args.dtypes:
        dtype = getattr(torch, dt_name)
        print(f"\n=== {dt_name} ===")
        for m in (512, 2048):
            rates = time_gemms(dtype, shapes, m)
            print(
                f"BLAS routes, the model's projections at M={m}: "
                + ", ".join(f"{r} {v:.1f} GF/s" for r, v in rates.items())
            )
        for n in (512, 2000):
            rates = time_attention(cfg, n, dtype)
            print(
                f"one layer's causal attention over {n} tokens (GF/s of causal FLOPs): "
                + ", ".join(f"{r} {v:.1f}" for r, v in rates.items())
            )
        if args.micro_only:
            continue
        kv_bytes = 2 * 2 * cfg.num_hidden_layers * Hkv * D * dtype.itemsize * (max_len + 64)
        llm = LLM(
            model=path,
            dtype=dt_name,
            enable_prefix_caching=False,
            max_model_len=max_len + 16,
            kv_cache_memory_bytes=kv_bytes,
            max_num_seqs=4,
        )
        route = getattr(linear_mod, "prefill_gemm_route", lambda d: "torch linear")(dtype)
        print(f"engine's prefill GEMM route for {dt_name}: {route}")
        chunked = LLM(
            model=path,
            dtype=dt_name,
            enable_prefix_caching=False,
            max_model_len=max_len + 16,
            kv_cache_memory_bytes=kv_bytes,
            max_num_seqs=4,
            max_num_batched_tokens=args.chunk,
        )
        hf = None
        if not args.no_hf:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        vocab = cfg.vocab_size

        def ours(engine, n, seed, vocab=vocab):
            ids = random_prompt(vocab, n, seed)
            t = time.perf_counter()
            engine.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
            return time.perf_counter() - t

        def hf_fwd(model, n, seed, vocab=vocab):
            ids = torch.tensor([random_prompt(vocab, n, seed)])
            with torch.inference_mode():
                t = time.perf_counter()
                model(ids, logits_to_keep=1)
                return time.perf_counter() - t

        # Warm both (first calls build caches / load kernels).
        ours(llm, 64, 1)
        ours(chunked, 64, 1)
        if hf is not None:
            hf_fwd(hf, 64, 1)
        big = [torch.randn(2048, 2048).to(dtype) for _ in range(2)]
        routes = gemm_routes(dtype)
        t_ours: dict[int, list[float]] = {n: [] for n in args.lengths}
        t_hf: dict[int, list[float]] = {n: [] for n in args.lengths}
        t_chunk: list[float] = []
        peak: list[float] = []
        hf_limit = max(args.lengths)
        for rep in range(args.repeats):
            best = 0.0
            for f in routes.values():
                t = time.perf_counter()
                f(big[0], big[1])
                best = max(best, 2 * 2048**3 / (time.perf_counter() - t) / 1e9)
            peak.append(best)
            for n in args.lengths:
                seed = 1000 * rep + n
                t_ours[n].append(ours(llm, n, seed))
                if hf is not None and n <= hf_limit:
                    t_hf[n].append(hf_fwd(hf, n, seed))
                    if t_hf[n][-1] > args.hf_budget_s:
                        hf_limit = n
                print(
                    f"  repeat {rep} n={n}: ours {t_ours[n][-1]:.2f} s"
                    + (f", HF {t_hf[n][-1]:.2f} s" if t_hf[n] else "")
                    + f" (load {load_avg()})",
                    flush=True,
                )
            t_chunk.append(ours(chunked, args.chunked_prompt, 77 + rep))
        gemm_peak = statistics.median(peak)
        print(f"\nGEMM peak ({dt_name}, 2048^3, best route): {gemm_peak:.1f} GF/s")
        print("| prompt | ours TTFT | HF forward | HF / ours | ours prefill tok/s | ours GF/s |")
        print("|---|---|---|---|---|---|")
        for n in args.lengths:
            o = statistics.median(t_ours[n])
            lin, att = model_flops(cfg, n)
            hf_s = f"{statistics.median(t_hf[n]):.2f} s" if t_hf[n] else "skipped"
            ratio = f"**{statistics.median(t_hf[n]) / o:.2f}x**" if t_hf[n] else "-"
            print(
                f"| {n} | {o:.2f} s | {hf_s} | {ratio} | {n / o:.0f} | "
                f"{(lin + att) / o / 1e9:.1f} |"
            )
        c = statistics.median(t_chunk)
        lin, att = model_flops(cfg, args.chunked_prompt)
        print(
            f"\nPrefill at {args.chunk}-token chunks ({args.chunked_prompt}-token prompt): "
            f"{c:.2f} s, {args.chunked_prompt / c:.0f} tok/s, {(lin + att) / c / 1e9:.1f} GF/s "
            f"= {100 * (lin + att) / c / 1e9 / gemm_peak:.0f}% of the GEMM peak "
            f"(linear layers alone {100 * lin / c / 1e9 / gemm_peak:.0f}%)"
        )
        llm.shutdown()
        chunked.shutdown()
        del llm, chunked
        hf = None
    print(f"\nload average at end {load_avg()}")


if __name__ == "__main__":
    main()
