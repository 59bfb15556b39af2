# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Fused RMSNorm (+ residual add) in Triton (CUDA and ROCm from one source; Triton's
interpreter on CPU), and its torch reference.

The arithmetic is RMSNorm's torch path step by step: the residual sum rounded to the input
dtype (it is also the new residual), the mean square and the scaling in fp32, the normalised
row rounded to the input dtype, then multiplied by the weight and rounded again. One program
per row.
"""

from __future__ import annotations

import torch

from vllm.triton_utils import LazyKernel, next_pow2, tl


def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    dtype = x.dtype
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


_KERNEL = LazyKernel(_rms_norm_kernel)


def triton_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) or, with residual, (norm(x + residual), x + residual) - new tensors; x and
    residual [..., N] (rows may be strided, the last dimension contiguous), weight [N]."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    rows = x2.shape[0]
    res2 = res_out = None
    if residual is not None:
        res2 = residual.reshape(-1, n)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if rows:
        _KERNEL[(rows,)](
            x2,
            res2 if res2 is not None else x2,
            weight,
            out,
            res_out if res_out is not None else out,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            out.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            n,
            float(eps),
            BLOCK=next_pow2(n),
            HAS_RES=residual is not None,
        )
    if res_out is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * y
    return out if residual is None else (out, x)
