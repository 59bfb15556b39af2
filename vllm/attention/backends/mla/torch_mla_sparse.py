# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Reference sparse MLA in torch (CPU and CUDA): each query token gathers its selected latent
cache rows and attends over them alone."""

from __future__ import annotations

import torch

from vllm.attention.backends.mla.sparse_common import SparseMLACommonImpl

# Bound on the gathered [tokens, topk, rank + rope] block, in elements.
_GATHER_BUDGET = 1 << 25


class TorchMLASparseImpl(SparseMLACommonImpl):
    def sparse_attend(
        self, q: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        T, H, D = q.shape
        rank = self.kv_lora_rank
        out = q.new_zeros(T, H, rank)
        kv = latent[:, 0]
        chunk = max(1, _GATHER_BUDGET // max(1, slots.shape[1] * D))
        for s in range(0, T, chunk):
            sl = slots[s : s + chunk]
            valid = sl >= 0
            rows = kv[sl.clamp(min=0)]  # [n, topk, D]
            scores = torch.einsum("nhd,nkd->nhk", q[s : s + chunk].float(), rows.float())
            scores = (scores * self.scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row selecting nothing -> 0
            o = torch.einsum("nhk,nkr->nhr", probs, rows[..., :rank].float())
            out[s : s + chunk] = o.to(q.dtype)
        return out
