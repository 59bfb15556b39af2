# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""FLASHINFER: standard attention through FlashInfer's batched paged prefill kernel (the
optional `flashinfer` package; CUDA only), for layers whose shapes it fits (registry.py:
head size 64 / 128 / 256, fp16 / bf16).

The cache stays the engine's [2, slots, Hkv, D] (slot = block * block_size + offset), which is
FlashInfer's NHD page layout once each half is viewed as [num_blocks, block_size, Hkv, D]; the
KV-cache write is the Triton kernel. One plan per step (shared by every layer of the same head
shape through the step's metadata) turns the block table into FlashInfer's page lists; its
causal mask is aligned to the end of each request's keys, as the engine's is. A step with a tree
mask runs the Triton kernel. Eager only: the plan is host work per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm.attention.backends.torch_paged import AttentionMetadata, TorchPagedAttentionImpl
from vllm.attention.ops.triton_kv_cache import triton_write_kv_cache
from vllm.attention.ops.triton_paged_attention import triton_paged_attention

_WORKSPACE_BYTES = 128 << 20
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACES:
        _WORKSPACES[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[device]


def page_lists(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's CSR page lists of the step: (page indptr [R + 1], page indices, last page
    lengths [R]), from the block table and sequence lengths."""
    bs = meta.block_size
    seq = meta.seq_lens_np.astype(np.int64)
    pages = -(-seq // bs)
    indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    indices = np.concatenate(
        [meta.block_table_np[r, : pages[r]] for r in range(len(seq))] or [np.zeros(0)]
    ).astype(np.int32)
    last = np.where(pages > 0, seq - (pages - 1) * bs, 0).astype(np.int32)
    return indptr, indices, last


class FlashInferAttentionImpl(TorchPagedAttentionImpl):
    name = "FLASHINFER"
    supports_cuda_graphs = False

    def _wrapper(self, meta: AttentionMetadata, dtype: torch.dtype) -> Any:
        key = (
            "flashinfer",
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            dtype,
            self.scale,
            self.sliding_window,
        )
        if key not in meta._cache:
            import flashinfer

            dev = meta.device
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(dev), "NHD")
            indptr, indices, last = page_lists(meta)
            to_dev = lambda a: torch.from_numpy(a).to(dev)
            wrapper.plan(
                to_dev(meta.query_start_loc_np.astype(np.int32)),
                to_dev(indptr),
                to_dev(indices),
                to_dev(last),
                self.num_heads,
                self.num_kv_heads,
                self.head_size,
                meta.block_size,
                causal=True,
                sm_scale=self.scale,
                window_left=-1 if self.sliding_window is None else self.sliding_window - 1,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
            meta._cache[key] = wrapper
        return meta._cache[key]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = meta.num_tokens
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_size
        q = q[:T].view(T, H, D)
        triton_write_kv_cache(
            k[:T].view(T, Hkv, D), v[:T].view(T, Hkv, D), kv_cache, meta.slot_mapping
        )
        if meta.tree_mask is not None or meta.static_layout is not None:
            block_table, seq_lens, qsl, max_q = meta.device_layout()
            out = triton_paged_attention(
                q,
                kv_cache[0],
                kv_cache[1],
                block_table,
                seq_lens,
                qsl,
                self.scale,
                meta.block_size,
                max_q,
                sliding_window=self.sliding_window,
                tree_mask=meta.tree_mask,
            )
            return out.reshape(T, H * D)
        num_blocks = kv_cache.shape[1] // meta.block_size
        pages = (
            kv_cache[0].view(num_blocks, meta.block_size, Hkv, D),
            kv_cache[1].view(num_blocks, meta.block_size, Hkv, D),
        )
        out = self._wrapper(meta, q.dtype).run(q.contiguous(), pages)
        return out.reshape(T, H * D)
