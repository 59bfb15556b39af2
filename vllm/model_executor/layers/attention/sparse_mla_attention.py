# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Sparse MLA attention layer (DeepSeek-V3.2 DSA): MLA whose impl is a registered sparse backend
reading the model-wide top-k indices buffer. The impls and their shared buffer view are in
vllm/attention/backends/mla/sparse_common.py."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.attention.backends.mla.sparse_common import (
    TOPK_PAD,
    SharedTopkIndicesBuffer,
    SparseMLACommonImpl,
)
from vllm.attention.backends.mla.torch_mla import MLADims
from vllm.attention.backends.registry import get_sparse_mla_impl_cls, select_sparse_mla_impl
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.linear import LinearLayerBase

__all__ = [
    "TOPK_PAD",
    "SharedTopkIndicesBuffer",
    "SparseMLAAttention",
    "SparseMLACommonImpl",
]


class SparseMLAAttention(MLAAttention):
    """MLA layer whose impl is a registered sparse backend reading the shared top-k buffer."""

    impl: SparseMLACommonImpl

    def __init__(
        self,
        dims: MLADims,
        kv_b_proj: nn.Linear | LinearLayerBase,
        topk_tokens: int,
        indexer: Any | None = None,
        topk_indices_buffer: torch.Tensor | None = None,
        prefix: str = "",
        backend: str | None = None,
    ) -> None:
        super().__init__(dims, kv_b_proj, prefix=prefix, backend="TORCH_SDPA")
        impl_cls = (
            get_sparse_mla_impl_cls(backend)
            if backend is not None
            else select_sparse_mla_impl(torch.get_default_device())
        )
        self.impl = impl_cls(
            dims,
            topk_tokens,
            indexer=indexer,
            topk_indices_buffer=topk_indices_buffer,
        )

    @property
    def topk_indices_buffer(self) -> torch.Tensor | None:
        return self.impl.topk_indices_buffer

    @topk_indices_buffer.setter
    def topk_indices_buffer(self, buffer: torch.Tensor | None) -> None:
        self.impl.topk_indices_buffer = buffer
