# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Reference MLA attention in torch over a compressed latent cache [slots, kv_lora_rank + rope].

The cache holds the normalised latent kv_c and the rotated k_pe per token, not full K/V. Attention
runs in the absorbed form: queries are projected into latent space with W_UK, attend over the
latent cache as a single-KV-head MQA, and the latent output is projected out with W_UV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.attention.backends.torch_paged import (
    AttentionMetadata,
    padded_attention,
    paged_attention,
)


@dataclass(frozen=True)
class MLADims:
    """The sizes of one MLA attention layer (what its layer, impl and cache are built from)."""

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scale: float


class TorchMLAImpl:
    name = "TORCH_SDPA"
    supports_cuda_graphs = False  # its core builds the step's layout from host arrays

    def __init__(self, dims: MLADims) -> None:
        self.dims = dims
        self.num_heads = dims.num_heads
        self.qk_nope_head_dim = dims.qk_nope_head_dim
        self.qk_rope_head_dim = dims.qk_rope_head_dim
        self.v_head_dim = dims.v_head_dim
        self.kv_lora_rank = dims.kv_lora_rank
        self.scale = dims.scale

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks * block_size, 1, self.kv_lora_rank + self.qk_rope_head_dim)

    def split_kv_b(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v, rank] from kv_b_proj.weight."""
        w = kv_b_weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def write_cache(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, meta
    ) -> None:
        T = meta.num_tokens
        kv_cache[meta.slot_mapping, 0] = torch.cat([kv_c[:T], k_pe[:T]], dim=-1).to(kv_cache.dtype)

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_pe: torch.Tensor,  # [T, H, rope]
        kv_c: torch.Tensor,  # [T, rank]
        k_pe: torch.Tensor,  # [T, rope]
        kv_b_weight: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        mask_fn=None,
    ) -> torch.Tensor:
        T = meta.num_tokens
        self.write_cache(kv_c, k_pe, kv_cache, meta)
        w_uk, w_uv = self.split_kv_b(kv_b_weight)
        q_lat = torch.einsum("thn,hnr->thr", q_nope[:T], w_uk.to(q_nope.dtype))
        q = torch.cat([q_lat, q_pe[:T]], dim=-1)
        latent = kv_cache.to(q.dtype) if kv_cache.dtype != q.dtype else kv_cache
        out_lat = self.attend_latent(q, latent, meta, mask_fn)  # [T, H, rank]
        out = torch.einsum("thr,hvr->thv", out_lat, w_uv.to(out_lat.dtype))
        return out.reshape(T, self.num_heads * self.v_head_dim)

    def attend_latent(
        self, q: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata, mask_fn=None
    ) -> torch.Tensor:
        """Single-KV-head attention of absorbed queries [T, H, rank + rope] over the latent
        cache [slots, 1, rank + rope]; returns [T, H, rank]. Sparse backends override it."""
        v = latent[..., : self.kv_lora_rank]
        if mask_fn is None:  # causal or a tree mask: paged_attention takes both
            return paged_attention(q, latent, v, meta, self.scale)
        return padded_attention(q, latent, v, meta, self.scale, mask_fn)
