"""Sparse MLA in Triton: one kernel for CUDA and ROCm GPUs (and Triton's CPU interpreter).

One program per (query token, block of heads) streams that token's selected latent cache rows
with an online softmax: the dense MLA kernel (vllm/attention/ops/triton_mla_attention.py) in its
sparse mode. The selection itself (ties at the top-k boundary resolved toward the lower
position) is the indexer's, shared with the torch backend, so both attend over the same set
whatever the batch layout. Dots use IEEE precision (no TF32 rounding of fp32 inputs; the only
precision every backend accepts; bf16 inputs are unaffected). Importing this module never
needs triton; running it does (vllm/triton_utils.py).
"""

from __future__ import annotations

import torch

from vllm.attention.backends.mla.sparse_common import SparseMLACommonImpl
from vllm.attention.backends.mla.triton_mla import TritonMLAImpl
from vllm.attention.ops.triton_mla_attention import triton_sparse_mla_attention
from vllm.triton_utils import HAS_TRITON

__all__ = ["HAS_TRITON", "TritonMLASparseImpl"]


class TritonMLASparseImpl(SparseMLACommonImpl, TritonMLAImpl):
    """Sparse top-k attention in Triton; the latent-cache write and the dense path (contexts
    within top-k) are TritonMLAImpl's."""

    name = "TRITON_MLA_SPARSE"
    supports_cuda_graphs = False  # the top-k selection is built from the step's host layout
    block_k = 32

    def sparse_attend(
        self, q: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        if not HAS_TRITON:
            raise RuntimeError(
                "the TRITON_MLA_SPARSE backend needs the triton package; install it or set "
                "VLLM_SPARSE_MLA_BACKEND=TORCH_MLA_SPARSE"
            )
        return triton_sparse_mla_attention(
            q, latent, slots, self.scale, self.kv_lora_rank, block_k=self.block_k
        )
