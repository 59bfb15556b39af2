# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Paged attention in Triton (CUDA and ROCm from one source; Triton's interpreter on CPU), and
its dense torch reference.

One kernel serves every row kind of a step - decode (one query row), draft verification (1 + K
rows), prefill chunks - straight from the paged cache, with no gather into dense tensors:

- queries q [T, H, Dqk] are the step's flattened tokens; request r owns rows
  query_start_loc[r] .. query_start_loc[r + 1] - 1, the last q_len of its seq_lens[r] positions
  (so its cached context is ctx = seq_len - q_len positions: the causal offset of its rows);
- keys / values live in caches [num_slots, Hkv, D] (slot = block * block_size + offset, block from
  the request's row of block_table) and have already been written for the step's own tokens;
- grouped-query attention: query head h reads KV head h // (H // Hkv);
- query row i of request r sees every cached-context key (positions < ctx) and the step's key
  at position ctx + j when j <= i (causal), or - with a tree mask - when tree_mask[r, i, j] is
  set (below);
- sliding window W (models that need one): a row at position p sees keys p - W + 1 .. p only.

Tree mask (draft trees, verified in one step): an int8 / bool tensor [R, M, M], M >= the most
query rows of any request, where tree_mask[r, i, j] = 1 iff query row j of request r is row i's
ancestor in the draft tree or row i itself, rows in topological order (a row's ancestors before
it: the mask is lower-triangular, as the torch reference, which applies it on top of the causal
rule, assumes). It replaces the causal rule among the step's own rows
only: every row still sees the request's whole cached context. A chain of drafts is the lower
triangle (plain causal); rows and columns past a request's q_len are ignored. A row whose mask
lets it see nothing gets zeros. Not combined with a sliding window (ValueError).

Each program takes one tile of BLOCK_Q query rows of one request times BLOCK_G query heads of
one KV-head group (the rows of one tl.dot), streams that request's keys in BLOCK_N-key tiles
with an online softmax, and writes its rows. Programs are numbered over requests by a binary
search of query_start_loc (request r owns tiles query_start_loc[r] // BLOCK_Q + r onwards), so
the grid depends only on the number of rows and of requests - fixed for a captured CUDA graph
whose unused request entries have query_start_loc equal to the total (empty requests).
Dots run in IEEE precision (no TF32 rounding of fp32 inputs; bf16 / fp16 are unaffected).
"""

from __future__ import annotations

import torch

from vllm.triton_utils import LazyKernel, dot_upcast, next_pow2, tl


def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    tree_ptr,
    scale,
    num_reqs,
    block_size,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_tr,
    stride_ti,
    GQA: tl.constexpr,
    HEAD_QK: tl.constexpr,
    HEAD_V: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_TREE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    G_BLOCKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // G_BLOCKS
    g_block = tl.program_id(1) % G_BLOCKS
    # The request owning this tile: the last r with qsl[r] // BLOCK_Q + r <= tile.
    lo = tile * 0
    hi = lo + num_reqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        take = start <= tile
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    req = lo
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    offs_m = tl.arange(0, BLOCK_M)
    q_row = q_tile * BLOCK_Q + offs_m // BLOCK_G  # query row within the request
    g = g_block * BLOCK_G + offs_m % BLOCK_G
    head = kv_head * GQA + g
    row_ok = (q_row < q_len) & (g < GQA)
    q_pos = ctx + q_row  # the key position each row sits at
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dq_ok = offs_dq < HEAD_QK
    dv_ok = offs_dv < HEAD_V
    tok = (q_start + q_row).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_dq[None, :],
        mask=row_ok[:, None] & dq_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this tile can see: up to its last row's position (the whole step with a tree).
    if HAS_TREE:
        kv_end = seq_len
    else:
        kv_end = tl.minimum(seq_len, ctx + (q_tile + 1) * BLOCK_Q)
    kv_begin = kv_end * 0
    if HAS_WINDOW:
        first = ctx + q_tile * BLOCK_Q - window + 1
        kv_begin = tl.maximum(first, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(kv_begin, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        blk = tl.load(
            block_table_ptr + req.to(tl.int64) * stride_bt + offs_n // block_size,
            mask=n_ok,
            other=0,
        )
        slot = blk.to(tl.int64) * block_size + offs_n % block_size
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_dq[None, :],
            mask=n_ok[:, None] & dq_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if HAS_TREE:
            in_step = offs_n >= ctx
            bit = tl.load(
                tree_ptr
                + req.to(tl.int64) * stride_tr
                + q_row[:, None] * stride_ti
                + (offs_n - ctx)[None, :],
                mask=row_ok[:, None] & (in_step & n_ok)[None, :],
                other=0,
            )
            allowed = tl.where(in_step[None, :], bit != 0, True) & n_ok[None, :]
        else:
            allowed = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            allowed = allowed & (q_pos[:, None] - offs_n[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :],
            mask=n_ok[:, None] & dv_ok[None, :],
            other=0.0,
        )
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dv_ok[None, :],
    )


_KERNEL = LazyKernel(_paged_attention_kernel)


def check_tree_mask(
    tree_mask: torch.Tensor | None, num_reqs: int, max_query_len: int
) -> torch.Tensor | None:
    """The tree mask as the kernel reads it (int8, contiguous), or ValueError naming the field."""
    if tree_mask is None:
        return None
    if tree_mask.dim() != 3 or tree_mask.shape[1] != tree_mask.shape[2]:
        raise ValueError(f"tree_mask must be [R, M, M], got shape {tuple(tree_mask.shape)}")
    if tree_mask.shape[0] < num_reqs or tree_mask.shape[1] < max_query_len:
        raise ValueError(
            f"tree_mask {tuple(tree_mask.shape)} must cover {num_reqs} requests of up to "
            f"{max_query_len} query rows"
        )
    if tree_mask.dtype == torch.bool:
        tree_mask = tree_mask.view(torch.int8)
    if tree_mask.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"tree_mask must be bool or int8, got {tree_mask.dtype}")
    return tree_mask.contiguous()


def block_sizes(max_query_len: int, gqa: int, head_qk: int, head_v: int) -> dict[str, int]:
    """The kernel's tile sizes: a tl.dot needs 16 rows; decode / verify tiles hold all of a
    request's rows of one KV-head group, prefill tiles 64 rows."""
    block_g = min(next_pow2(gqa), 16)
    rows = 16 if max_query_len * block_g <= 16 else 64
    return dict(
        BLOCK_Q=max(1, rows // block_g),
        BLOCK_G=block_g,
        BLOCK_N=32,
        BLOCK_DQK=next_pow2(head_qk, 16),
        BLOCK_DV=next_pow2(head_v, 16),
    )


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    block_size: int,
    max_query_len: int,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, Dqk] over the paged caches k_cache [slots, Hkv, Dqk] and
    v_cache [slots, Hkv, Dv] (module docstring); returns out [T, H, Dv] (rows past
    query_start_loc[-1] are left as they are). max_query_len: the most query rows of any
    request (a host-side number: it picks the tile shape)."""
    T, H, dqk = q.shape
    num_slots, hkv, dv = v_cache.shape
    if k_cache.shape[:2] != (num_slots, hkv) or k_cache.shape[2] != dqk:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not match q / v_cache")
    if H % hkv:
        raise ValueError(f"num_heads {H} is not a multiple of num_kv_heads {hkv}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must be contiguous in their last dimension")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"query_start_loc ({query_start_loc.shape[0]}) must hold seq_lens' {num_reqs} "
            "requests + 1 and block_table a row per request"
        )
    tree = check_tree_mask(tree_mask, num_reqs, max_query_len)
    if tree is not None and sliding_window is not None:
        raise ValueError("tree_mask and sliding_window cannot be combined")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = q.new_empty(T, H, dv) if out is None else out
    if T == 0 or num_reqs == 0:
        return out
    gqa = H // hkv
    bs = block_sizes(max_query_len, gqa, dqk, dv)
    g_blocks = triton_cdiv(gqa, bs["BLOCK_G"])
    grid = (T // bs["BLOCK_Q"] + num_reqs, hkv * g_blocks)
    tree_arg = tree if tree is not None else seq_lens  # any pointer: never read
    _KERNEL[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_table,
        seq_lens,
        query_start_loc,
        tree_arg,
        float(scale),
        num_reqs,
        block_size,
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        tree.stride(0) if tree is not None else 0,
        tree.stride(1) if tree is not None else 0,
        GQA=gqa,
        HEAD_QK=dqk,
        HEAD_V=dv,
        HAS_TREE=tree is not None,
        HAS_WINDOW=sliding_window is not None,
        UPCAST=dot_upcast(q.dtype),
        G_BLOCKS=g_blocks,
        **bs,
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    block_size: int,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention, one request at a time: its keys gathered densely by block table, an
    explicit [H, q_len, seq_len] boolean mask, softmax in fp32 (rows that see nothing: 0)."""
    T, H, _ = q.shape
    hkv, dv = v_cache.shape[1], v_cache.shape[2]
    out = torch.zeros(T, H, dv, dtype=q.dtype, device=q.device)
    qsl = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = int(qsl[r]), int(qsl[r + 1])
        q_len = hi - lo
        if q_len == 0:
            continue
        ctx = seq_len - q_len
        pos = torch.arange(seq_len, device=q.device)
        slots = block_table[r, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(H // hkv, dim=1)  # [S, H, D]
        v = v_cache[slots].float().repeat_interleave(H // hkv, dim=1)
        q_pos = ctx + torch.arange(q_len, device=q.device)
        allowed = pos[None, :] <= q_pos[:, None]
        if tree_mask is not None:
            step = tree_mask[r, :q_len, :q_len].bool()
            allowed = torch.cat([allowed[:, :ctx], step], dim=1)
        if sliding_window is not None:
            allowed &= q_pos[:, None] - pos[None, :] < sliding_window
        scores = torch.einsum("qhd,shd->hqs", q[lo:hi].float(), k) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[lo:hi] = torch.einsum("hqs,shd->qhd", probs, v).to(q.dtype)
    return out
