# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""TRITON_ATTN: standard multi-head / grouped-query attention over the paged [2, slots, Hkv, D]
cache with the Triton kernels (vllm/attention/ops): the KV-cache write by slot mapping, then one
paged-attention launch for every row of the step (prefill, decode, verify; tree masks and
sliding windows included), reading keys and values straight from the cache. The CUDA path's
default; on CPU it runs in Triton's interpreter (TRITON_INTERPRET=1), for tests.

Everything it reads per step is a device tensor of the metadata (device_layout()), so the same
launches replay correctly from a captured CUDA graph whose buffers the runner refills."""

from __future__ import annotations

import torch

from vllm.attention.backends.torch_paged import AttentionMetadata, TorchPagedAttentionImpl
from vllm.attention.ops.triton_kv_cache import triton_write_kv_cache
from vllm.attention.ops.triton_paged_attention import triton_paged_attention


class TritonPagedAttentionImpl(TorchPagedAttentionImpl):
    name = "TRITON_ATTN"
    supports_cuda_graphs = True

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
        triton_write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        block_table, seq_lens, qsl, max_query_len = meta.device_layout()
        # A captured step's padding rows are never written by the kernel: zeros, not garbage.
        out = None
        if meta.static_layout is not None:
            out = q.new_zeros(T, self.num_heads, self.head_size)
        out = triton_paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            block_table,
            seq_lens,
            qsl,
            self.scale,
            meta.block_size,
            max_query_len,
            sliding_window=self.sliding_window,
            out=out,
            tree_mask=meta.tree_mask,
        )
        return out.reshape(T, self.num_heads * self.head_size)
