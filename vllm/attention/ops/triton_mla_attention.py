# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Dense MLA attention over the paged latent cache in Triton (CUDA and ROCm from one source;
Triton's interpreter on CPU), and its torch reference.

MLA in the absorbed form is single-KV-head attention: queries q [T, H, rank + rope] (q_nope
already multiplied into latent space, then q_pe) over the latent cache [slots, 1, rank + rope]
(the normalised kv_c, then the rotated k_pe, per token), values = the first rank channels of
the same rows; the output [T, H, rank] is projected out by W_UV afterwards.

The row layout is the paged kernel's (triton_paged_attention.py): request r owns query rows
query_start_loc[r] .. query_start_loc[r + 1] - 1, the last q_len of its seq_lens[r] positions,
and a row sees its cached context plus the step's rows up to itself (or, with a tree mask
[R, M, M], the step's rows j with tree_mask[r, i, j] set - row i's ancestors and itself).

One program per (query row, block of heads) streams the row's visible latent rows in BLOCK_N
tiles with an online softmax; the rank and rope channels are loaded as two power-of-two tiles
(rank 512 + rope 64 would otherwise pad to 1024). Programs past query_start_loc[-1] (padding
rows of a captured step) return at once.

The sparse top-k variant (DeepSeek-V3.2, vllm/attention/backends/mla/triton_mla_sparse.py) is
the same kernel with SPARSE set: a row streams the latent rows at its own top-k cache slots
(slots [T, topk], -1: none) instead of its visible paged positions.
"""

from __future__ import annotations

import torch

from vllm.attention.ops.triton_paged_attention import check_tree_mask
from vllm.triton_utils import LazyKernel, dot_upcast, next_pow2, tl


def _mla_paged_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    tree_ptr,
    slots_ptr,
    scale,
    num_reqs,
    num_heads,
    block_size,
    topk,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_tr,
    stride_ti,
    stride_st,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_TREE: tl.constexpr,
    SPARSE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0)
    if SPARSE:
        kv_end = topk
    else:
        if t >= tl.load(qsl_ptr + num_reqs):
            return
        # The request of row t: the last r with qsl[r] <= t.
        lo = t * 0
        hi = lo + num_reqs
        while lo < hi - 1:
            mid = (lo + hi) // 2
            take = tl.load(qsl_ptr + mid) <= t
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid)
        req = lo
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + req)
        ctx = seq_len - q_len
        q_row = t - q_start
        if HAS_TREE:
            kv_end = seq_len
        else:
            kv_end = ctx + q_row + 1

    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < ROPE
    q_base = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_base + RANK + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        if SPARSE:
            slot = tl.load(slots_ptr + t.to(tl.int64) * stride_st + offs_n, mask=n_ok, other=-1)
            n_ok = slot >= 0
            kv_row = tl.where(n_ok, slot, 0).to(tl.int64)
        else:
            blk = tl.load(
                block_table_ptr + req.to(tl.int64) * stride_bt + offs_n // block_size,
                mask=n_ok,
                other=0,
            )
            kv_row = blk.to(tl.int64) * block_size + offs_n % block_size
        row = kv_ptr + kv_row[:, None] * stride_kv
        k_lat = tl.load(row + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(row + RANK + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        v_dtype = k_lat.dtype
        if UPCAST:
            k_lat = k_lat.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        ok = n_ok
        if HAS_TREE:  # (never with SPARSE)
            in_step = offs_n >= ctx
            bit = tl.load(
                tree_ptr + req.to(tl.int64) * stride_tr + q_row * stride_ti + (offs_n - ctx),
                mask=in_step & n_ok,
                other=0,
            )
            ok = ok & tl.where(in_step, bit != 0, True)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
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


_KERNEL = LazyKernel(_mla_paged_kernel)


def triton_mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    block_size: int,
    kv_lora_rank: int,
    max_query_len: int,
    out: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, rank + rope] over latent [slots, 1, rank + rope]; returns out [T, H, rank]
    (module docstring; rows past query_start_loc[-1] are left as they are)."""
    T, H, d = q.shape
    rank = int(kv_lora_rank)
    if latent.dim() != 3 or latent.shape[1] != 1 or latent.shape[2] != d:
        raise ValueError(f"latent {tuple(latent.shape)} must be [slots, 1, {d}]")
    if not 0 < rank < d:
        raise ValueError(f"kv_lora_rank must be in (0, {d}), got {rank}")
    if latent.stride(-1) != 1:
        raise ValueError("latent must be contiguous in its last dimension")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(f"query_start_loc must hold {num_reqs} + 1 entries")
    tree = check_tree_mask(tree_mask, num_reqs, max_query_len)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = q.new_empty(T, H, rank) if out is None else out
    if T == 0 or num_reqs == 0:
        return out
    return _launch(
        q, latent, out, scale, rank, 32, block_table, seq_lens, query_start_loc, block_size, tree
    )


def triton_sparse_mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    block_k: int = 32,
) -> torch.Tensor:
    """q [T, H, rank + rope] over the latent rows [slots, ..., rank + rope] at each row's own
    cache slots [T, topk] (-1: none); returns out [T, H, rank]."""
    T, H, _ = q.shape
    q = q.contiguous()
    slots = slots.to(torch.int32).contiguous()
    out = q.new_empty(T, H, int(kv_lora_rank))
    if T == 0:
        return out
    return _launch(q, latent, out, scale, int(kv_lora_rank), block_k, slots=slots)


def _launch(
    q: torch.Tensor,
    latent: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    rank: int,
    block_n: int,
    block_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    block_size: int = 1,
    tree: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel over the paged layout (block_table, seq_lens, query_start_loc, tree), or
    with slots [T, topk] in its sparse mode; the other mode's pointers are never read."""
    T, H, d = q.shape
    sparse = slots is not None
    dense = slots if sparse else seq_lens
    assert dense is not None and (sparse or block_table is not None)
    block_h = min(next_pow2(H, 16), 64)
    grid = (T, -(-H // block_h))
    _KERNEL[grid](
        q,
        latent,
        out,
        block_table if block_table is not None else dense,
        dense,
        query_start_loc if query_start_loc is not None else dense,
        tree if tree is not None else dense,
        slots if slots is not None else dense,
        float(scale),
        0 if query_start_loc is None else query_start_loc.shape[0] - 1,
        H,
        block_size,
        slots.shape[1] if slots is not None else 0,
        q.stride(0),
        q.stride(1),
        latent.stride(0),
        out.stride(0),
        out.stride(1),
        block_table.stride(0) if block_table is not None else 0,
        tree.stride(0) if tree is not None else 0,
        tree.stride(1) if tree is not None else 0,
        slots.stride(0) if slots is not None else 0,
        RANK=rank,
        ROPE=d - rank,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=next_pow2(rank, 16),
        BLOCK_P=next_pow2(d - rank, 16),
        HAS_TREE=tree is not None,
        SPARSE=sparse,
        UPCAST=dot_upcast(q.dtype),
    )
    return out


def mla_attention_reference(
    q: torch.Tensor,
    latent: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    block_size: int,
    kv_lora_rank: int,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention per request, densely: MQA over the gathered latent rows."""
    from vllm.attention.ops.triton_paged_attention import paged_attention_reference

    return paged_attention_reference(
        q,
        latent,
        latent[..., :kv_lora_rank],
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        block_size,
        tree_mask=tree_mask,
    )
