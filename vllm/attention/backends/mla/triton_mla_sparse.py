# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Sparse MLA in Triton: one kernel for CUDA and ROCm GPUs (and Triton's CPU interpreter).

One program per (query token, block of heads) streams that token's selected latent cache rows
with an online softmax. The selection itself (ties at the top-k boundary resolved toward the lower
position) is the indexer's, shared with the torch backend, so both attend over the same set
whatever the batch layout. Dots use IEEE precision (no TF32 rounding of fp32 inputs; the only
precision every backend accepts; bf16 inputs are unaffected). Importing this module never
needs triton; running it does (vllm/triton_utils.py).
"""

from __future__ import annotations

import torch

from vllm.attention.backends.mla.sparse_common import SparseMLACommonImpl
from vllm.attention.backends.mla.triton_mla import TritonMLAImpl
from vllm.triton_utils import HAS_TRITON, LazyKernel, dot_upcast, next_pow2, tl

__all__ = ["HAS_TRITON", "TritonMLASparseImpl"]


def _next_pow2(n: int, floor: int = 16) -> int:
    return next_pow2(n, floor)


def sparse_mla_fwd(
    q_ptr,
    kv_ptr,
    slots_ptr,
    out_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_st,
    stride_ot,
    stride_oh,
    num_heads,
    topk,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < ROPE
    q_row = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(0, topk, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        slot = tl.load(
            slots_ptr + t.to(tl.int64) * stride_st + offs_k, mask=offs_k < topk, other=-1
        )
        ok = slot >= 0
        row = kv_ptr + tl.where(ok, slot, 0).to(tl.int64)[:, None] * stride_kv
        k_lat = tl.load(row + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(row + RANK + offs_p[None, :], mask=ok[:, None] & p_ok[None, :], other=0.0)
        v_dtype = k_lat.dtype
        if UPCAST:
            k_lat = k_lat.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing selected yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(v_dtype)
        if UPCAST:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, k_lat, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & r_ok[None, :],
    )


_KERNEL = LazyKernel(sparse_mla_fwd)


class TritonMLASparseImpl(SparseMLACommonImpl, TritonMLAImpl):
    """Sparse top-k attention in Triton; the latent-cache write and the dense path (contexts
    within top-k) are TritonMLAImpl's."""

    name = "TRITON_MLA_SPARSE"
    supports_cuda_graphs = False  # the top-k selection is built from the step's host layout
    block_k = 32

    def sparse_attend(
        self, q: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        if not HAS_TRITON:
            raise RuntimeError(
                "the TRITON_MLA_SPARSE backend needs the triton package; install it or set "
                "VLLM_SPARSE_MLA_BACKEND=TORCH_MLA_SPARSE"
            )
        T, H, _ = q.shape
        rank, rope = self.kv_lora_rank, self.qk_rope_head_dim
        q = q.contiguous()
        slots = slots.to(torch.int32).contiguous()
        out = q.new_empty(T, H, rank)
        if T == 0:
            return out
        block_h = _next_pow2(min(H, 64))
        grid = (T, -(-H // block_h))
        _KERNEL[grid](
            q,
            latent,
            slots,
            out,
            float(self.scale),
            q.stride(0),
            q.stride(1),
            latent.stride(0),
            slots.stride(0),
            out.stride(0),
            out.stride(1),
            H,
            slots.shape[1],
            RANK=rank,
            ROPE=rope,
            BLOCK_H=block_h,
            BLOCK_K=self.block_k,
            BLOCK_R=_next_pow2(rank),
            BLOCK_P=_next_pow2(rope),
            UPCAST=dot_upcast(q.dtype),
        )
        return out
