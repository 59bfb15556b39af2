# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The matmul under every linear layer: a forward's rows routed by the kinds its caller passes
(ForwardContext.rows, ALL_SHORT for the rows being sampled) to the CPU small-M kernel or to
BLAS, and the prefill BLAS route measured once per dtype at start-up."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vllm._custom_ops import cpu_op_ok, linear_small_m
from vllm.forward_context import RowKinds

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_FP32 = torch.float32


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kinds: RowKinds | None
) -> torch.Tensor:
    """x @ weight^T (+ bias) (weight in x's dtype, or bf16 under fp32 x: the product of its
    exact fp32 widening), the rows routed by `kinds` (the caller's, required: the forward
    context's rows, ALL_SHORT for sampled rows): decode / verify / draft rows through the CPU
    small-M kernel (each weight row streamed from memory once for all of them; a row's result
    independent of what shares the call), prefill rows through BLAS. A step mixing both splits
    its rows; kinds None (products outside a forward, e.g. weight processing) is prefill-kind."""
    if kinds is not None and not kinds.all_long and _kernel_takes(x, weight, bias):
        if kinds.all_short:
            if x.dim() == 2:
                return linear_small_m(x, weight, bias)
            y = linear_small_m(x.reshape(-1, x.shape[-1]), weight, bias)
            return y.view(*x.shape[:-1], weight.shape[0])
        if x.dim() == 2 and x.shape[0] >= kinds.num_rows:
            assert kinds.short_rows is not None  # mixed
            y = x.new_empty(x.shape[0], weight.shape[0])
            short = kinds.short_rows
            y.index_copy_(0, short, linear_small_m(x.index_select(0, short), weight, bias))
            long = kinds.long_rows(x.shape[0])
            y.index_copy_(0, long, _blas_linear(x.index_select(0, long), weight, bias))
            return y
        # A subset of a mixed step's rows (e.g. an expert's tokens): which are which is unknown.
    return _blas_linear(x, weight, bias)


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.dtype in _KERNEL_DTYPES
        and (weight.dtype == x.dtype or (weight.dtype == torch.bfloat16 and x.dtype == _FP32))
        and weight.is_cpu
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and x.dim() >= 2
        and x.numel() > 0
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and cpu_op_ok(x)
    )


def _blas_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Prefill rows: a BLAS product, on the route measured fastest for this dtype on this CPU
    (prefill_gemm_route). bf16 weights under fp32 rows (layers/exact_bf16.py) are widened for
    the call (exact)."""
    if weight.dtype == torch.bfloat16 and x.dtype == _FP32:
        weight = weight.to(_FP32)
    if (
        x.device.type != "cpu"
        or x.dtype not in _KERNEL_DTYPES
        or weight.dtype != x.dtype
        or x.dim() != 2
        or x.shape[0] <= 1
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    return _ROUTES[prefill_gemm_route(x.dtype, weight)](x, weight, bias)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def _widened(route):
    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b = None if bias is None else bias.float()
        return route(x.float(), weight.float(), b).to(x.dtype)

    return run


# The BLAS routes of a prefill product (x [M, K] @ weight [N, K]^T + bias, M > 1, on CPU):
# torch's linear in the input's dtype (fp32: MKL; bf16: oneDNN's bf16 GEMM where the CPU has
# one, else a generic loop), oneDNN's linear, and for bf16 either of them on fp32 copies
# (widening is exact and both accumulate in fp32, so the result is the same up to rounding
# order).
_ROUTES = {
    "torch": F.linear,
    "onednn": _onednn,
    "fp32": _widened(F.linear),
    "onednn-fp32": _widened(_onednn),
}
_CANDIDATES = {
    torch.float32: ("torch", "onednn"),
    torch.bfloat16: ("torch", "onednn", "fp32", "onednn-fp32"),
}
_chosen: dict[torch.dtype, str] = {}


def prefill_gemm_route(dtype: torch.dtype, weight: torch.Tensor | None = None) -> str:
    """The prefill BLAS route for dtype: VLLM_CPU_PREFILL_GEMM if set, else measured once per
    process on the first prefill product (its weight, 256 rows, each candidate timed three
    times interleaved, medians; the default - torch's linear for fp32, for bf16 the native
    GEMM where oneDNN has one, else fp32 - is kept unless another is 10% faster). The
    start-up warm-up makes the first prefill product, so no request pays for it."""
    if dtype in _chosen:
        return _chosen[dtype]
    from vllm import envs

    forced = envs.VLLM_CPU_PREFILL_GEMM
    if forced != "auto":
        if forced not in _CANDIDATES[dtype]:
            raise ValueError(
                f"VLLM_CPU_PREFILL_GEMM={forced}: not a route for {dtype} (choose from "
                f"{list(_CANDIDATES[dtype])})"
            )
        _chosen[dtype] = forced
        return forced
    default = "torch" if dtype == torch.float32 or _cpu_has_bf16_gemm() else "fp32"
    if weight is None:
        return default
    _chosen[dtype] = _measure_routes(dtype, weight, default, prefill_gemm_candidates(dtype))
    return _chosen[dtype]


def prefill_gemm_candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The routes auto chooses from: without a native bf16 GEMM (oneDNN on AVX512-BF16 /
    AMX), the bf16 routes are a generic loop or have no oneDNN kernel, so only the fp32 ones."""
    if dtype == torch.bfloat16 and not _cpu_has_bf16_gemm():
        return ("fp32", "onednn-fp32")
    return _CANDIDATES[dtype]


def _measure_routes(
    dtype: torch.dtype, weight: torch.Tensor, default: str, candidates: tuple[str, ...]
) -> str:
    import statistics
    import time

    from vllm.logger import init_logger

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, weight.shape[1], generator=g).to(dtype)
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        for r in candidates:
            try:
                _ROUTES[r](x, weight, None)  # first call: any one-time set-up
            except RuntimeError:  # no kernel for this shape / dtype on this CPU
                continue
            times[r] = []
        for _ in range(3):
            for r in times:
                t = time.perf_counter()
                _ROUTES[r](x, weight, None)
                times[r].append(time.perf_counter() - t)
    med = {r: statistics.median(v) for r, v in times.items()}
    best = min(med, key=lambda r: med[r])
    chosen = best if med[best] < 0.9 * med[default] else default
    init_logger(__name__).info(
        "prefill GEMM route for %s: %s (ms per [256 x %d] x [%d x %d]^T: %s)",
        str(dtype).removeprefix("torch."),
        chosen,
        weight.shape[1],
        weight.shape[0],
        weight.shape[1],
        ", ".join(f"{r} {v * 1e3:.2f}" for r, v in med.items()),
    )
    return chosen


@functools.cache
def _cpu_has_bf16_gemm() -> bool:
    """Whether oneDNN has a native bf16 GEMM on this CPU (AVX512-BF16 / AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
