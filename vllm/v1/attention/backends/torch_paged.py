# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Reference paged attention in torch (CPU and CUDA).

Prefill, chunked prefill, decode and draft verification all run through one varlen path: the
flattened query tokens of each request are gathered into a padded [R, Q] block, their keys and
values gathered from the paged cache into [R, S], and one SDPA call runs with a causal mask offset
by the request's already-computed tokens. Requests with short queries (decode, verify) and long
ones (prefill) are padded in separate groups so one long prompt does not pad every decode row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PaddedGroup:
    """One padded sub-batch of requests."""

    q_index: torch.Tensor  # [Rg, Qg] flat token index, or T (a zero row) for padding
    kv_slots: torch.Tensor  # [Rg, Sg] cache slot of each context position (0 for padding)
    mask: torch.Tensor  # [Rg, 1, Qg, Sg] True where attention is allowed
    valid: torch.Tensor  # [n] indices into the flattened [Rg * Qg] rows that are real tokens
    token_index: torch.Tensor  # [n] flat token index of each valid row
    kv_positions: torch.Tensor  # [Rg, Sg] context position of each key (for sparse masks)
    q_positions: torch.Tensor  # [Rg, Qg] absolute position of each query row
    req_rows: np.ndarray  # batch rows of this group


@dataclass
class AttentionMetadata:
    """Everything an attention layer needs for one forward over a flattened token batch."""

    num_tokens: int
    slot_mapping: torch.Tensor  # [T] int64 cache slot each new token is written to
    query_start_loc_np: np.ndarray  # [R + 1]
    seq_lens_np: np.ndarray  # [R]
    groups: list[PaddedGroup]
    block_size: int


def build_attn_metadata(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
    slot_mapping: torch.Tensor | None = None,
    positions: np.ndarray | None = None,
    short_query_len: int = 8,
) -> AttentionMetadata:
    """Build the padded-group layout of one step.

    query_start_loc/seq_lens describe R requests; the query of request r holds the last
    q_len[r] positions of its seq_lens[r]-long sequence. block_table is [R, max_blocks].
    """
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    num_tokens = int(qsl[-1])
    ctx = seq_lens - q_lens
    if positions is None:
        positions = np.concatenate(
            [np.arange(c, c + q) for c, q in zip(ctx, q_lens)] or [np.zeros(0, np.int64)]
        )
    if slot_mapping is None:
        blk = block_table[np.repeat(np.arange(len(q_lens)), q_lens), positions // block_size]
        slot_mapping = torch.from_numpy(blk * block_size + positions % block_size).to(device)
    short = q_lens <= short_query_len
    groups = []
    for rows in (np.nonzero(short & (q_lens > 0))[0], np.nonzero(~short)[0]):
        if len(rows) == 0:
            continue
        groups.append(
            _build_group(rows, qsl, q_lens, seq_lens, ctx, block_table, block_size, num_tokens)
        )
    groups = [_group_to(g, device) for g in groups]
    return AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=slot_mapping,
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
        groups=groups,
        block_size=block_size,
    )


def _build_group(rows, qsl, q_lens, seq_lens, ctx, block_table, block_size, num_tokens):
    ql, sl, c = q_lens[rows], seq_lens[rows], ctx[rows]
    qmax, smax = int(ql.max()), int(sl.max())
    i = np.arange(qmax)[None, :]
    q_valid = i < ql[:, None]
    q_index = np.where(q_valid, qsl[rows][:, None] + i, num_tokens)
    j = np.arange(smax)[None, :]
    kv_valid = j < sl[:, None]
    blocks = np.take_along_axis(
        block_table[rows], np.minimum(j // block_size, block_table.shape[1] - 1), axis=1
    )
    kv_slots = np.where(kv_valid, blocks * block_size + j % block_size, 0)
    q_pos = c[:, None] + i  # absolute position of each query row
    mask = (j[:, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
    mask[:, :, 0] |= ~q_valid  # padded query rows attend somewhere (their output is dropped)
    valid = np.nonzero(q_valid.reshape(-1))[0]
    return PaddedGroup(
        q_index=torch.from_numpy(q_index),
        kv_slots=torch.from_numpy(kv_slots),
        mask=torch.from_numpy(mask[:, None]),
        valid=torch.from_numpy(valid),
        token_index=torch.from_numpy(q_index.reshape(-1)[valid]),
        kv_positions=torch.from_numpy(np.broadcast_to(j, kv_slots.shape).copy()),
        q_positions=torch.from_numpy(q_pos),
        req_rows=rows,
    )


def _group_to(g: PaddedGroup, device: torch.device) -> PaddedGroup:
    if torch.device(device).type == "cpu":
        return g
    return PaddedGroup(
        q_index=g.q_index.to(device, non_blocking=True),
        kv_slots=g.kv_slots.to(device, non_blocking=True),
        mask=g.mask.to(device, non_blocking=True),
        valid=g.valid.to(device, non_blocking=True),
        token_index=g.token_index.to(device, non_blocking=True),
        kv_positions=g.kv_positions.to(device, non_blocking=True),
        q_positions=g.q_positions.to(device, non_blocking=True),
        req_rows=g.req_rows,
    )


def padded_attention(
    q: torch.Tensor,
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    mask_fn=None,
) -> torch.Tensor:
    """Attention of flattened queries q [T, H, Dq] over paged keys/values.

    k_src / v_src are [num_slots, Hkv, D*] views of the cache. mask_fn(group) may return an extra
    [Rg, 1 or H, Qg, Sg] boolean mask (sparse attention) combined with the causal one.
    """
    T, H, _ = q.shape
    dv = v_src.shape[-1]
    out = q.new_zeros(T, H, dv)
    q_pad = torch.cat([q, q.new_zeros(1, H, q.shape[-1])], dim=0)
    for g in meta.groups:
        qg = q_pad[g.q_index].transpose(1, 2)  # [Rg, H, Qg, D]
        kg = k_src[g.kv_slots].transpose(1, 2)  # [Rg, Hkv, Sg, D]
        vg = v_src[g.kv_slots].transpose(1, 2)
        mask = g.mask
        if mask_fn is not None:
            extra = mask_fn(g)
            if extra is not None:
                mask = mask & extra
                mask[..., 0] |= ~mask.any(-1)  # a row with nothing selected still has no NaN
        og = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=kg.shape[1] != H
        )
        og = og.transpose(1, 2).reshape(-1, H, dv)  # [Rg * Qg, H, Dv]
        out[g.token_index] = og[g.valid]
    return out


class TorchPagedAttentionImpl:
    """Standard multi-head / grouped-query attention over a paged [2, slots, Hkv, D] cache."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int):
        return (2, num_blocks * block_size, num_kv_heads, head_size)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = meta.num_tokens
        q = q[:T].view(T, self.num_heads, self.head_size)
        k = k[:T].view(T, self.num_kv_heads, self.head_size)
        v = v[:T].view(T, self.num_kv_heads, self.head_size)
        kv_cache[0][meta.slot_mapping] = k.to(kv_cache.dtype)
        kv_cache[1][meta.slot_mapping] = v.to(kv_cache.dtype)
        out = padded_attention(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return out.reshape(T, self.num_heads * self.head_size)
