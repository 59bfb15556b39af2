# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""CUDA block-FP8 GEMM for DeepSeek-style weights: activations quantized per token and 128-wide
K block on the fly (dynamic scheme), multiplied with torch's blockwise `scaled_mm` (cuBLASLt:
Hopper, CUDA >= 12.9, [128, 128] weight blocks, N and K multiples of 128).

Each weight shape is checked once against the dequantized product before it is used; a shape or
device the kernel does not take falls back to the dequantized path in fp8.py. This file has not
run on a GPU in this project's CI (no GPU there).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.forward_context import RowKinds
    from vllm.model_executor.layers.fused_moe import ExpertLinear, FusedMoE

logger = init_logger(__name__)

GEMM_BLOCK = (128, 128)
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)
# Activation quantization alone costs ~2^-4 relative error per element; a wrong layout or scale
# is off by O(1).
_SELF_TEST_RTOL = 0.1
_checked: dict[tuple, bool] = {}


def block_grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid of a [rows, cols] matrix in [bn, bk] blocks (partial edge blocks count)."""
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """weight [..., N, K] (FP8) * scale_inv [..., ceil(N/bn), ceil(K/bk)] per block -> dtype.

    The product is formed in float32 and rounded once, so it is exact for float32 and the
    correctly rounded value for bf16 / fp16.
    """
    bn, bk = block
    n, k = weight.shape[-2:]
    gn, gk = block_grid(n, k, block)
    if tuple(scale_inv.shape[-2:]) != (gn, gk):
        raise ValueError(
            f"scale grid {tuple(scale_inv.shape)} does not match a {tuple(weight.shape)} weight "
            f"in {list(block)} blocks (expected [..., {gn}, {gk}])"
        )
    w = weight.to(torch.float32, memory_format=torch.contiguous_format)
    if gn * bn != n or gk * bk != k:
        w = F.pad(w, (0, gk * bk - k, 0, gn * bn - n))
    lead = w.shape[:-2]
    w = w.view(*lead, gn, bn, gk, bk)
    w.mul_(scale_inv.to(torch.float32).view(*lead, gn, 1, gk, 1))
    return w.view(*lead, gn * bn, gk * bk)[..., :n, :k].to(dtype).contiguous()


def _scaled_mm_available(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(F, "scaled_mm") or torch.version.hip:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    version = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return major == 9 and version >= (12, 9)


def _weight_scale_layout(scale_inv: torch.Tensor) -> torch.Tensor:
    """[N/128, K/128] block scales as cuBLAS reads 128x128 scales of the [K, N] operand: K blocks
    padded to a multiple of 4, outer-dimension major."""
    gn, gk = scale_inv.shape
    padded = scale_inv.new_ones(gn, -(-gk // 4) * 4, dtype=torch.float32)
    padded[:, :gk] = scale_inv
    return padded.t()


def _quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], per (token, 128-column block) scales [M, K/128] column-major)."""
    m, k = x.shape
    groups = x.float().view(m, k // GEMM_BLOCK[1], GEMM_BLOCK[1])
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / _FP8_MAX
    q = (groups / scale[..., None]).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8).view(m, k)
    return q, scale.t().contiguous().t()


def _gemm(
    x: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    xq, scale_a = _quantize_activation(x)
    return F.scaled_mm(
        xq,
        weight.t(),
        scale_a,
        F.ScalingType.BlockWise1x128,
        scale_b,
        F.ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
    )


def _passes_self_test(
    weight: torch.Tensor, scale_inv: torch.Tensor, scale_b: torch.Tensor, dtype: torch.dtype
) -> bool:

    n, k = weight.shape
    key = (weight.device, n, k, dtype)
    if key not in _checked:
        try:
            gen = torch.Generator(device=weight.device).manual_seed(0)
            x = torch.randn(5, k, device=weight.device, generator=gen).to(dtype)
            got = _gemm(x, weight, scale_b, dtype).float()
            ref = F.linear(x, dequantize_fp8_block(weight, scale_inv, GEMM_BLOCK, dtype)).float()
            err = ((got - ref).norm() / ref.norm().clamp(min=1e-12)).item()
            ok = err < _SELF_TEST_RTOL
            reason = f"relative error {err:.3g}"
        except (RuntimeError, TypeError, ValueError) as e:
            ok, reason = False, f"{type(e).__name__}: {e}"
        if not ok:
            logger.warning(
                "FP8 block GEMM unusable for [%d, %d] weights on %s (%s); using dequantized "
                "weights instead",
                n,
                k,
                weight.device,
                reason,
            )
        _checked[key] = ok
    return _checked[key]


def _gemm_shape_ok(n: int, k: int, block: tuple[int, int], device: torch.device) -> bool:
    return (
        tuple(block) == GEMM_BLOCK
        and n % GEMM_BLOCK[0] == 0
        and k % GEMM_BLOCK[1] == 0
        and _scaled_mm_available(device)
    )


def prepare_block_fp8_gemm(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor | None:
    """The weight scales laid out for block_fp8_linear, or None when the GEMM cannot take this
    weight here (then the caller dequantizes)."""
    n, k = weight.shape
    if not _gemm_shape_ok(n, k, block, weight.device):
        return None
    scale_b = _weight_scale_layout(scale_inv)
    return scale_b if _passes_self_test(weight, scale_inv, scale_b, dtype) else None


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T (+ bias) with FP8 tensor cores."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] == 0:
        out = x2d.new_zeros(0, weight.shape[0])
    else:
        out = _gemm(x2d.contiguous(), weight, scale_b, x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


def prepare_moe_block_fp8_gemm(
    layer: FusedMoE, block: tuple[int, int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Per-expert scale layouts for stacked FP8 experts, or None (dequantized path). Needs
    I % 128 == 0 so the gate and up grids of w13 join into one grid of the [2I, H] matrix."""
    w13, w2 = layer.w13_weight, layer.w2_weight
    _, two_i, h = w13.shape
    if not (
        _gemm_shape_ok(two_i // 2, h, block, w13.device)
        and _gemm_shape_ok(h, two_i // 2, block, w13.device)
    ):
        return None
    s13 = [_weight_scale_layout(s) for s in layer.w13_weight_scale_inv]
    s2 = [_weight_scale_layout(s) for s in layer.w2_weight_scale_inv]
    dtype = layer.params_dtype
    ok = _passes_self_test(w13[0], layer.w13_weight_scale_inv[0], s13[0], dtype)
    ok = ok and _passes_self_test(w2[0], layer.w2_weight_scale_inv[0], s2[0], dtype)
    return (s13, s2) if ok else None


def moe_expert_linear(layer: FusedMoE) -> ExpertLinear:
    """fused_moe's expert_linear over FP8 expert stacks prepared by prepare_moe_block_fp8_gemm
    (the FP8 GEMM has no small-M route: the rows' kinds go unused)."""
    assert layer.fp8_gemm_scales is not None, "prepare_moe_block_fp8_gemm did not run"
    s13, s2 = layer.fp8_gemm_scales

    def linear(x: torch.Tensor, expert: int, proj: str, rows: RowKinds | None) -> torch.Tensor:
        if proj == "w13":
            return block_fp8_linear(x, layer.w13_weight[expert], s13[expert])
        return block_fp8_linear(x, layer.w2_weight[expert], s2[expert])

    return linear
