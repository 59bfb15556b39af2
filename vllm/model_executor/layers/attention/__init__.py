# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Attention layers as models see them; each owns its paged cache tensor (bound by the runner)."""

from __future__ import annotations

import torch
from torch import nn

from vllm.attention.backends.mla.torch_mla import MLADims, TorchMLAImpl
from vllm.attention.backends.registry import (
    attention_backend_name,
    get_attention_impl_cls,
    get_mla_impl_cls,
    mla_backend_name,
)
from vllm.attention.backends.torch_paged import TorchPagedAttentionImpl
from vllm.forward_context import ForwardContext
from vllm.model_executor.layers.linear import LinearLayerBase, dequantize_linear_


class AttentionLayerBase(nn.Module):
    """Common part: a layer name and a KV cache the runner allocates and binds."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        raise NotImplementedError

    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        n = 1
        for d in self.kv_cache_shape(1, 1):
            n *= d
        return n * torch.empty((), dtype=dtype).element_size()


class Attention(AttentionLayerBase):
    """Multi-head / grouped-query attention over a paged cache of full K and V. Its impl is
    the registry's choice for the device it is built on (VLLM_ATTENTION_BACKEND, else by
    device: Triton / FlashInfer on GPUs, the torch reference on CPU)."""

    impl: TorchPagedAttentionImpl

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
        sliding_window: int | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(prefix)
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        name = backend or attention_backend_name(
            torch.get_default_device(), head_size, torch.get_default_dtype()
        )
        self.impl = get_attention_impl_cls(name)(
            num_heads, head_size, self.num_kv_heads, scale, sliding_window
        )

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.impl.kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_size)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Attention of this forward's rows (ctx.attn_metadata: None in a dummy run)."""
        meta = ctx.attn_metadata
        if self.kv_cache is not None and meta is not None and meta.num_tokens == q.shape[0]:
            return self.impl.forward(q, k, v, self.kv_cache, meta)  # no padding rows
        out = torch.zeros(
            q.shape[0], self.num_heads * self.head_size, dtype=q.dtype, device=q.device
        )
        if self.kv_cache is None or meta is None:
            # Memory-profiling / dummy run without a cache.
            return out
        out[: meta.num_tokens] = self.impl.forward(q, k, v, self.kv_cache, meta)
        return out


class MLAAttention(AttentionLayerBase):
    """Multi-head latent attention over a cache of (kv_c, k_pe) per token."""

    impl: TorchMLAImpl

    def __init__(
        self,
        dims: MLADims,
        kv_b_proj: nn.Linear | LinearLayerBase,
        prefix: str = "",
        backend: str | None = None,
    ) -> None:
        super().__init__(prefix)
        self.dims = dims
        # Not a submodule: the owning attention block registers kv_b_proj itself.
        self._kv_b_proj = [kv_b_proj]
        name = backend or mla_backend_name(torch.get_default_device())
        self.impl = get_mla_impl_cls(name)(dims)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.impl.kv_cache_shape(num_blocks, block_size)

    def process_weights_after_loading(self) -> None:
        # The absorbed form multiplies by slices of kv_b_proj's weight itself (W_UK, W_UV), so
        # a quantized kv_b_proj is dequantized first, once.
        dequantize_linear_(self._kv_b_proj[0])

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        ctx: ForwardContext,
        mask_fn=None,
    ) -> torch.Tensor:
        meta = ctx.attn_metadata
        out = torch.zeros(
            q_nope.shape[0],
            self.dims.num_heads * self.dims.v_head_dim,
            dtype=q_nope.dtype,
            device=q_nope.device,
        )
        if self.kv_cache is None or meta is None:
            return out
        out[: meta.num_tokens] = self.impl.forward(
            q_nope, q_pe, kv_c, k_pe, self._kv_b_proj[0].weight, self.kv_cache, meta, mask_fn
        )
        return out
