# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Reference paged attention in torch (CPU and CUDA).

Prefill, chunked prefill, decode and draft verification all run through one varlen path: the
flattened query tokens of each request are gathered into a padded [R, Q] block, their keys and
values gathered from the paged cache into [R, S], and one SDPA call runs with a causal mask offset
by the request's already-computed tokens. Requests with short queries (decode, verify) and long
ones (prefill) are padded in separate groups so one long prompt does not pad every decode row.

On CPU, paged_attention() runs every request through a C++ kernel that reads keys and values
straight from the cache by block table (no gather, no padding, no mask): the decode kernel for
short queries, the prefill kernel (query x key tiles, online softmax) for long ones. Elsewhere
a prefill with no cached context takes SDPA's mask-free causal path; the padded groups are built
only when something uses them (sparse masks, chunked prefill without the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    block_size: int
    block_table_np: np.ndarray  # [R, max_blocks]
    short_query_len: int
    device: torch.device
    # Draft trees: [R, M, M] ancestor-or-self mask among each request's
    # query rows, on top of its whole cached context (triton_paged_attention.py's docstring).
    tree_mask: torch.Tensor | None = None
    # A captured CUDA graph's step: the device tensors of device_layout(), in the graph's
    # persistent buffers (v1/worker/gpu/cuda_graph.py), instead of ones built per step.
    static_layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def max_query_len(self) -> int:
        q_lens = self.query_start_loc_np[1:] - self.query_start_loc_np[:-1]
        return int(q_lens.max(initial=0))

    def device_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(block_table [R, max_blocks], seq_lens [R], query_start_loc [R + 1]) as int32 device
        tensors, and the most query rows of a request: what the paged kernels read."""
        if self.static_layout is not None:
            return self.static_layout
        if "layout" not in self._cache:
            tensors = tuple(
                torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(self.device)
                for a in (self.block_table_np, self.seq_lens_np, self.query_start_loc_np)
            )
            self._cache["layout"] = (*tensors, self.max_query_len)
        return self._cache["layout"]

    def _rows(self, short: bool) -> np.ndarray:
        q_lens = self.query_start_loc_np[1:] - self.query_start_loc_np[:-1]
        if short:
            return np.nonzero((q_lens <= self.short_query_len) & (q_lens > 0))[0]
        return np.nonzero(q_lens > self.short_query_len)[0]

    def long_rows(self) -> torch.Tensor:
        """The long-query (prefill, chunked prefill) requests, as an int64 tensor."""
        if "long_rows" not in self._cache:
            rows = np.ascontiguousarray(self._rows(False), dtype=np.int64)
            self._cache["long_rows"] = torch.from_numpy(rows).to(self.device)
        return self._cache["long_rows"]

    def group(self, short: bool, exclude: np.ndarray | None = None) -> PaddedGroup | None:
        """The padded group of the short-query (decode, verify) or long-query (prefill)
        requests, built on first use; None when there are none. exclude: a boolean mask over
        the requests to leave out (computed another way)."""
        key = ("group", short, None if exclude is None else exclude.tobytes())
        if key not in self._cache:
            rows = self._rows(short)
            if exclude is not None:
                rows = rows[~exclude[rows]]
            g = None
            if len(rows):
                qsl, sl = self.query_start_loc_np, self.seq_lens_np
                q_lens = qsl[1:] - qsl[:-1]
                g = _group_to(
                    _build_group(
                        rows,
                        qsl,
                        q_lens,
                        sl,
                        sl - q_lens,
                        self.block_table_np,
                        self.block_size,
                        self.num_tokens,
                    ),
                    self.device,
                )
            self._cache[key] = g
        return self._cache[key]

    @property
    def groups(self) -> list[PaddedGroup]:
        """Padded sub-batches: short-query requests first, then long-query ones."""
        return [g for g in (self.group(True), self.group(False)) if g is not None]

    def kernel_inputs(self) -> tuple[torch.Tensor, ...]:
        """(block_table, seq_lens, query_start_loc, short-query rows) as int64 tensors."""
        if "kernel" not in self._cache:
            self._cache["kernel"] = tuple(
                torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)
                for a in (
                    self.block_table_np,
                    self.seq_lens_np,
                    self.query_start_loc_np,
                    self._rows(True),
                )
            )
        return self._cache["kernel"]


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
    return AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=slot_mapping,
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
        block_size=block_size,
        block_table_np=np.asarray(block_table),
        short_query_len=short_query_len,
        device=torch.device(device),
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
    groups: list[PaddedGroup] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of flattened queries q [T, H, Dq] over paged keys/values.

    k_src / v_src are [num_slots, Hkv, D*] views of the cache. mask_fn(group) may return an extra
    [Rg, 1 or H, Qg, Sg] boolean mask (sparse attention) combined with the causal one. groups
    (default: all of meta's) and out (default: zeros) let a caller run only some requests here.
    """
    T, H, _ = q.shape
    dv = v_src.shape[-1]
    out = q.new_zeros(T, H, dv) if out is None else out
    q_pad = torch.cat([q, q.new_zeros(1, H, q.shape[-1])], dim=0)
    for g in meta.groups if groups is None else groups:
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


def write_kv(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """A step's keys and values [T, kv_heads, head_size] into their slots of a paged
    [2, slots, kv_heads, head_size] cache: one C++ copy on CPU when the layouts allow it, else
    torch's indexed writes (converted to the cache's dtype)."""
    from vllm import _custom_ops as ops

    d = kv_cache.shape[-1]
    if (
        k.dtype == v.dtype == kv_cache.dtype
        and kv_cache.is_cpu
        and kv_cache.is_contiguous()
        and k.stride(-1) == v.stride(-1) == 1
        and k.stride(-2) == v.stride(-2) == d
        and ops.cpu_op_ok(k)
    ):
        ops.write_kv(kv_cache, slot_mapping, k, v)
        return
    kv_cache[0][slot_mapping] = k.to(kv_cache.dtype)
    kv_cache[1][slot_mapping] = v.to(kv_cache.dtype)


def use_cpu_kernel(q: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor) -> bool:
    """Whether the C++ paged kernel can run these tensors (CPU, one supported dtype)."""
    if not q.is_cpu or not (q.dtype == k_src.dtype == v_src.dtype):
        return False
    from vllm._custom_ops import cpu_op_ok

    return cpu_op_ok(q)


def paged_attention(
    q: torch.Tensor,
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """padded_attention's result (with meta's tree mask, if any), without its padding where
    possible. On CPU with the kernels built, every request reads its keys and values straight
    from the paged cache: short queries (decode, draft verification, tree verification: the
    decode kernel takes the tree mask) through the decode kernel, long ones (prefill, chunked
    prefill over a cached context) through the prefill kernel's query x key tiles - or, in a
    step with a tree mask, the padded group with the mask. Elsewhere, a prefill with no cached
    context runs SDPA's mask-free causal path on its own keys (no padding to the group's longest
    request, no mask tensor); the rest keep the padded groups."""
    tree = meta.tree_mask
    if not use_cpu_kernel(q, k_src, v_src):
        if tree is not None:
            return padded_attention(q, k_src, v_src, meta, scale, extra_mask(meta, None))
        return _sdpa_attention(q, k_src, v_src, meta, scale)
    from vllm import _custom_ops as ops

    T, H, _ = q.shape
    out = q.new_empty(T, H, v_src.shape[-1])
    block_table, seq_lens, qsl, short_rows = meta.kernel_inputs()
    if short_rows.numel():
        if tree is not None and "tree_u8" not in meta._cache:
            # One contiguous byte mask for every layer of the step.
            meta._cache["tree_u8"] = tree.to(torch.bool).contiguous()
        ops.paged_attention(
            out,
            q,
            k_src,
            v_src,
            block_table,
            seq_lens,
            qsl,
            short_rows,
            meta.block_size,
            scale,
            tree_mask=None if tree is None else meta._cache["tree_u8"],
        )
    long_rows = meta.long_rows()
    if long_rows.numel():
        if tree is not None:
            long_group = meta.group(False)
            assert long_group is not None
            mask_fn = extra_mask(meta, None)
            padded_attention(q, k_src, v_src, meta, scale, mask_fn, [long_group], out)
        else:
            ops.prefill_attention(
                out, q, k_src, v_src, block_table, seq_lens, qsl, long_rows, meta.block_size, scale
            )
    return out


def _sdpa_attention(
    q: torch.Tensor,
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The torch path: prefills without a cached context one SDPA call each on their own keys
    (is_causal: the flash / memory-efficient kernels skip the masked half, no mask tensor), the
    other requests in the padded groups."""
    qsl, sl = meta.query_start_loc_np, meta.seq_lens_np
    q_lens = qsl[1:] - qsl[:-1]
    fresh = (q_lens > meta.short_query_len) & (sl == q_lens)
    if not fresh.any():
        return padded_attention(q, k_src, v_src, meta, scale)
    T, H, _ = q.shape
    out = q.new_zeros(T, H, v_src.shape[-1])
    groups = [g for g in (meta.group(True), meta.group(False, exclude=fresh)) if g is not None]
    if groups:
        padded_attention(q, k_src, v_src, meta, scale, groups=groups, out=out)
    gqa = k_src.shape[1] != H
    for r in np.nonzero(fresh)[0].tolist():
        t0, t1 = int(qsl[r]), int(qsl[r + 1])
        slots = meta.slot_mapping[t0:t1]  # a fresh prefill's keys are this step's tokens
        qr = q[t0:t1].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        kr = k_src[slots].transpose(0, 1).unsqueeze(0)
        vr = v_src[slots].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=gqa)
        out[t0:t1] = o[0].transpose(0, 1)
    return out


def extra_mask(meta: AttentionMetadata, sliding_window: int | None):
    """The mask_fn of padded_attention for a tree mask and / or a sliding window, or None."""
    tree, window = meta.tree_mask, sliding_window
    if tree is None and window is None:
        return None

    def mask_fn(g: PaddedGroup) -> torch.Tensor:
        # The same for every layer of the step: built once per group (meta._cache).
        key = ("extra_mask", id(g), window)
        if key not in meta._cache:
            meta._cache[key] = build(g)
        return meta._cache[key]

    def build(g: PaddedGroup) -> torch.Tensor:
        q_pos = g.q_positions[:, :, None]  # [Rg, Qg, 1]
        k_pos = g.kv_positions[:, None, :]  # [Rg, 1, Sg]
        allowed = torch.ones(
            q_pos.shape[0], q_pos.shape[1], k_pos.shape[2], dtype=torch.bool, device=q_pos.device
        )
        if window is not None:
            allowed &= q_pos - k_pos < window
        if tree is not None:
            rows = torch.from_numpy(g.req_rows).to(tree.device)
            q_lens = torch.from_numpy(
                meta.query_start_loc_np[g.req_rows + 1] - meta.query_start_loc_np[g.req_rows]
            ).to(q_pos.device)
            ctx = q_pos[:, :1, 0]  # [Rg, 1] the first row's position = the context length
            j = (k_pos[:, 0, :] - ctx).clamp(min=0)  # [Rg, Sg] step row of each key
            i = torch.arange(q_pos.shape[1], device=q_pos.device)
            m = tree.shape[1]
            bits = tree.bool()[
                rows[:, None, None],
                i.clamp(max=m - 1)[None, :, None],
                j.clamp(max=m - 1)[:, None, :],
            ]
            in_step = (k_pos >= ctx[:, :, None]) & (j[:, None, :] < q_lens[:, None, None])
            allowed &= torch.where(in_step, bits, True)
        return allowed.unsqueeze(1)

    return mask_fn


class TorchPagedAttentionImpl:
    """Standard multi-head / grouped-query attention over a paged [2, slots, Hkv, D] cache."""

    name = "TORCH_SDPA"
    # A captured CUDA graph replays the launches of one step: this impl builds its layout
    # from the step's host arrays, so it cannot be captured.
    supports_cuda_graphs = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window

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
        if q.shape[0] != T:  # padded rows (a decode step has none: no slicing to pay for)
            q, k, v = q[:T], k[:T], v[:T]
        q = q.view(T, self.num_heads, self.head_size)
        k = k.view(T, self.num_kv_heads, self.head_size)
        v = v.view(T, self.num_kv_heads, self.head_size)
        write_kv(kv_cache, meta.slot_mapping, k, v)
        k_cache, v_cache = kv_cache.unbind(0)
        if self.sliding_window is None:  # causal, or a tree mask: paged_attention takes both
            out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        else:
            mask_fn = extra_mask(meta, self.sliding_window)
            out = padded_attention(q, k_cache, v_cache, meta, self.scale, mask_fn)
        return out.reshape(T, self.num_heads * self.head_size)
