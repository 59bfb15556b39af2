# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The vocabulary split over the tensor-parallel ranks: rank r holds rows
[r * V / TP, (r + 1) * V / TP) of the input embedding and of the LM head. The embedding looks up
the ids in its range (zeros elsewhere) and the ranks' rows are summed; the LM head computes its
slice of the logits and the slices are gathered, so every rank holds the full logits where
sampling happens. With TP = 1 both are the plain nn.Embedding / LMHead."""

from __future__ import annotations

import torch
from torch import nn

from vllm.forward_context import RowKinds
from vllm.model_executor.build_context import current_build_context
from vllm.model_executor.layers.linear import RoutedLinear, TPSharded, divide


class VocabParallelEmbedding(nn.Embedding, TPSharded):
    """nn.Embedding over this rank's slice of the vocabulary (the whole one at TP = 1)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.tp = tp = current_build_context().tp
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.org_vocab_size = int(num_embeddings)
        per_rank = divide(self.org_vocab_size, self.tp_size, "vocab_size")
        super().__init__(per_rank, embedding_dim)
        self.vocab_start_index = self.tp_rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank

    def tp_shard_checkpoint_tensor(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        return _vocab_rows(self, tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local = torch.where(outside, 0, input_ids - self.vocab_start_index)
        out = super().forward(local)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class LMHead(RoutedLinear):
    """The vocabulary projection: an nn.Linear (never quantized) whose product runs through
    the shared linear(); its callers pass ALL_SHORT for the rows being sampled (the CPU small-M
    kernel)."""


class ParallelLMHead(LMHead, TPSharded):
    """The LM head over this rank's vocabulary rows; forward gathers every rank's logits, so
    the result is the full [tokens, vocab] on each rank."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False) -> None:
        tp = current_build_context().tp
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.org_vocab_size = int(vocab_size)
        per_rank = divide(self.org_vocab_size, self.tp_size, "vocab_size")
        super().__init__(hidden_size, per_rank, bias=bias)
        self.tp = tp
        self.vocab_start_index = self.tp_rank * per_rank

    def tp_shard_checkpoint_tensor(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        return _vocab_rows(self, tensor)

    def forward(self, x: torch.Tensor, rows: RowKinds | None) -> torch.Tensor:  # type: ignore[override]
        logits = super().forward(x, rows)
        if self.tp_size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)


def _vocab_rows(layer: VocabParallelEmbedding | ParallelLMHead, tensor: torch.Tensor):
    n = layer.weight.shape[0]
    if layer.tp_size == 1 or tensor.dim() == 0 or tensor.shape[0] != layer.org_vocab_size:
        return tensor  # the loader's shape check names a misshaped one
    return tensor.narrow(0, layer.tp_rank * n, n)
