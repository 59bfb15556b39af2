# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Rotary position embedding in Triton, plain and M-RoPE (CUDA and ROCm from one source;
Triton's interpreter on CPU), and its torch reference.

positions [A, T] (A = 1: plain RoPE; A = 3: M-RoPE's temporal / height / width rows) and
axis [rotary_dim // 2] (which positions row each rotary frequency takes its angle from: all 0 for
plain RoPE, MRotaryEmbedding.axis for M-RoPE) pick, per token and frequency, the row of the
cos / sin caches [max_position, rotary_dim // 2] (fp32, any attention factor folded in). The
first rotary_dim channels of each head rotate - pairs (i, i + rotary_dim / 2) in NeoX style,
(2i, 2i + 1) in GPT-J style - in fp32, rounded back to the input dtype; the other channels are
copied. One program per token does all of its query and key heads.
"""

from __future__ import annotations

import torch

from vllm.triton_utils import LazyKernel, next_pow2, tl


def _rotary_kernel(
    pos_ptr,
    axis_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    stride_pa,
    stride_qt,
    stride_kt,
    stride_cos,
    num_q_heads,
    num_k_heads,
    HEAD: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_F)
    f_ok = f < HALF
    ax = tl.load(axis_ptr + f, mask=f_ok, other=0)
    pos = tl.load(pos_ptr + ax.to(tl.int64) * stride_pa + t, mask=f_ok, other=0)
    cos = tl.load(cos_ptr + pos.to(tl.int64) * stride_cos + f, mask=f_ok, other=1.0)
    sin = tl.load(sin_ptr + pos.to(tl.int64) * stride_cos + f, mask=f_ok, other=0.0)
    if NEOX:
        i1 = f
        i2 = f + HALF
    else:
        i1 = 2 * f
        i2 = 2 * f + 1

    hq = tl.arange(0, BLOCK_HQ)
    ok = (hq < num_q_heads)[:, None] & f_ok[None, :]
    base = q_ptr + t * stride_qt + hq[:, None] * HEAD
    x1 = tl.load(base + i1[None, :], mask=ok, other=0.0)
    x2 = tl.load(base + i2[None, :], mask=ok, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(base + i1[None, :], (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=ok)
    tl.store(base + i2[None, :], (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=ok)

    hk = tl.arange(0, BLOCK_HK)
    ok = (hk < num_k_heads)[:, None] & f_ok[None, :]
    base = k_ptr + t * stride_kt + hk[:, None] * HEAD
    x1 = tl.load(base + i1[None, :], mask=ok, other=0.0)
    x2 = tl.load(base + i2[None, :], mask=ok, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(base + i1[None, :], (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=ok)
    tl.store(base + i2[None, :], (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=ok)


_KERNEL = LazyKernel(_rotary_kernel)


def _as_positions(positions: torch.Tensor) -> torch.Tensor:
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.dim() != 2:
        raise ValueError(f"positions must be [T] or [A, T], got {tuple(positions.shape)}")
    return positions if positions.stride(-1) == 1 else positions.contiguous()


def triton_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool = True,
    axis: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, Hq * D] (or [T, Hq, D]) and k, in their input shapes."""
    pos = _as_positions(positions)
    T = q.shape[0]
    if pos.shape[1] < T or k.shape[0] != T:
        raise ValueError(f"positions {tuple(pos.shape)} / k must cover q's {T} tokens")
    half = rotary_dim // 2
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise ValueError(f"rotary_dim must be even and in (0, {head_size}], got {rotary_dim}")
    if cos.shape != sin.shape or cos.shape[-1] != half or cos.dtype != torch.float32:
        raise ValueError(f"cos / sin must be fp32 [max_position, {half}]")
    if axis is None:
        axis = torch.zeros(half, dtype=torch.int64, device=q.device)
    if axis.shape != (half,):
        raise ValueError(f"axis must be [{half}] (a row of positions per frequency)")
    q_out = q.reshape(T, -1).clone()
    k_out = k.reshape(T, -1).clone()
    nq, nk = q_out.shape[1] // head_size, k_out.shape[1] // head_size
    if T:
        _KERNEL[(T,)](
            pos,
            axis,
            cos,
            sin,
            q_out,
            k_out,
            pos.stride(0),
            q_out.stride(0),
            k_out.stride(0),
            cos.stride(0),
            nq,
            nk,
            HEAD=head_size,
            HALF=half,
            BLOCK_F=next_pow2(half),
            BLOCK_HQ=next_pow2(nq),
            BLOCK_HK=next_pow2(nk),
            NEOX=bool(is_neox_style),
        )
    return q_out.view(q.shape), k_out.view(k.shape)


def rotary_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool = True,
    axis: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    pos = _as_positions(positions)
    half = rotary_dim // 2
    if axis is None:
        axis = torch.zeros(half, dtype=torch.int64, device=q.device)
    cols = torch.arange(half, device=q.device)
    T = q.shape[0]
    p = pos[axis][:, :T]  # [half, T]: each frequency's position row
    c = cos[p, cols[:, None]].t()[:, None, :]  # [T, 1, half]
    s = sin[p, cols[:, None]].t()[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x3 = x.reshape(T, -1, head_size)
        rot = x3[..., :rotary_dim].float()
        if is_neox_style:
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        return torch.cat((out.to(x.dtype), x3[..., rotary_dim:]), dim=-1).reshape(x.shape)

    return rotate(q), rotate(k)
