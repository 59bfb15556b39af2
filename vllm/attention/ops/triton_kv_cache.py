# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The KV-cache write in Triton (CUDA and ROCm from one source; Triton's interpreter on CPU),
and its torch reference.

Token t's rows go to cache slot slot_mapping[t] (block * block_size + offset; -1: a padding
token of a captured step, skipped). Two sources are written per launch: the keys and values of
a [2, slots, Hkv, D] cache (each token's [Hkv, D] row into its slot of each half), or an MLA
token's kv_c and k_pe into the first kv_lora_rank and the last rope channels of its latent row.
Values are cast to the cache's dtype.
"""

from __future__ import annotations

import torch

from vllm.triton_utils import LazyKernel, next_pow2, tl


def _write_slots_kernel(
    a_ptr,
    b_ptr,
    a_dst_ptr,
    b_dst_ptr,
    slot_ptr,
    stride_a,
    stride_b,
    stride_ad,
    stride_bd,
    WIDTH_A: tl.constexpr,
    WIDTH_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    a_ok = offs < WIDTH_A
    a = tl.load(a_ptr + t.to(tl.int64) * stride_a + offs, mask=a_ok)
    tl.store(a_dst_ptr + slot * stride_ad + offs, a.to(a_dst_ptr.dtype.element_ty), mask=a_ok)
    b_ok = offs < WIDTH_B
    b = tl.load(b_ptr + t.to(tl.int64) * stride_b + offs, mask=b_ok)
    tl.store(b_dst_ptr + slot * stride_bd + offs, b.to(b_dst_ptr.dtype.element_ty), mask=b_ok)


_KERNEL = LazyKernel(_write_slots_kernel)


def _rows(x: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """x as [T, width] rows, each contiguous (a view when it already is)."""
    flat = x.reshape(x.shape[0], -1)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, flat.shape[1]


def _slot_rows(cache: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    if cache.dim() < 2:
        raise ValueError(f"{name} must be [slots, ...], got shape {tuple(cache.shape)}")
    inner = cache[0]
    if cache.shape[1:].numel() > 1 and not inner.is_contiguous():
        raise ValueError(f"{name} must hold each slot's row contiguously")
    return cache, cache.stride(0)


def write_slots(
    a: torch.Tensor,
    b: torch.Tensor,
    a_cache: torch.Tensor,
    b_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Row t of a (and of b) into row slot_mapping[t] of a_cache (b_cache); -1 skips a token.
    a_cache / b_cache may be column slices of one cache (a view: stride(0) is the slot's)."""
    T = slot_mapping.shape[0]
    a_rows, wa = _rows(a[:T], "a")
    b_rows, wb = _rows(b[:T], "b")
    _, sa = _slot_rows(a_cache, "a_cache")
    _, sb = _slot_rows(b_cache, "b_cache")
    if a_cache[0].numel() != wa or b_cache[0].numel() != wb:
        raise ValueError(
            f"slot rows of {a_cache[0].numel()} / {b_cache[0].numel()} elements cannot take "
            f"token rows of {wa} / {wb}"
        )
    if T == 0:
        return
    block = min(next_pow2(max(wa, wb), 16), 1024)
    grid = (T, -(-max(wa, wb) // block))
    _KERNEL[grid](
        a_rows,
        b_rows,
        a_cache,
        b_cache,
        slot_mapping,
        a_rows.stride(0),
        b_rows.stride(0),
        sa,
        sb,
        WIDTH_A=wa,
        WIDTH_B=wb,
        BLOCK=block,
    )


def triton_write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key / value [T, Hkv, D] into kv_cache [2, slots, Hkv, D] at slot_mapping [T]."""
    write_slots(key, value, kv_cache[0], kv_cache[1], slot_mapping)


def triton_write_mla_cache(
    kv_c: torch.Tensor, k_pe: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_c [T, rank] and k_pe [T, rope] into latent [slots, 1, rank + rope] at slot_mapping."""
    rank = kv_c.shape[-1]
    if latent.dim() != 3 or latent.shape[2] != rank + k_pe.shape[-1]:
        raise ValueError(f"latent {tuple(latent.shape)} must be [slots, 1, rank + rope]")
    write_slots(kv_c, k_pe, latent[:, 0, :rank], latent[:, 0, rank:], slot_mapping)


def write_slots_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    a_cache: torch.Tensor,
    b_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    T = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    a_cache[slots] = a[:T][keep].reshape(-1, *a_cache.shape[1:]).to(a_cache.dtype)
    b_cache[slots] = b[:T][keep].reshape(-1, *b_cache.shape[1:]).to(b_cache.dtype)
