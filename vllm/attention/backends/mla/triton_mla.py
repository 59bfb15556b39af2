# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""TRITON_MLA: dense MLA whose latent-cache write and attention core are the Triton kernels
(vllm/attention/ops): absorbed queries attend over the paged latent cache in place, no gather.
The projections around the core are TorchMLAImpl's. A layer given an extra mask (mask_fn) runs
the torch reference core, as does a device Triton cannot run on here (CPU without
TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from vllm.attention.backends.mla.torch_mla import TorchMLAImpl
from vllm.attention.backends.torch_paged import AttentionMetadata
from vllm.attention.ops.triton_kv_cache import triton_write_mla_cache
from vllm.attention.ops.triton_mla_attention import triton_mla_attention
from vllm.triton_utils import triton_runs_on


class TritonMLAImpl(TorchMLAImpl):
    name = "TRITON_MLA"
    supports_cuda_graphs = True

    def write_cache(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, meta
    ) -> None:
        if not triton_runs_on(kv_cache.device.type):
            return super().write_cache(kv_c, k_pe, kv_cache, meta)
        T = meta.num_tokens
        triton_write_mla_cache(kv_c[:T], k_pe[:T], kv_cache, meta.slot_mapping)

    def attend_latent(
        self, q: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata, mask_fn=None
    ) -> torch.Tensor:
        if mask_fn is not None or not triton_runs_on(q.device.type):
            return super().attend_latent(q, latent, meta, mask_fn)
        block_table, seq_lens, qsl, max_query_len = meta.device_layout()
        out = None
        if meta.static_layout is not None:
            # A captured step's padding rows are never written by the kernel: zeros, not garbage.
            out = q.new_zeros(q.shape[0], q.shape[1], self.kv_lora_rank)
        return triton_mla_attention(
            q,
            latent,
            block_table,
            seq_lens,
            qsl,
            self.scale,
            meta.block_size,
            self.kv_lora_rank,
            max_query_len,
            out=out,
            tree_mask=meta.tree_mask,
        )
