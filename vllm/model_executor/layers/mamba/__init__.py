# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Layers with a fixed-size per-request state (linear attention, Gated DeltaNet); their kernels
are in ops/. The model runner allocates their states next to the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn


class MambaBase(nn.Module):
    """A layer whose per-request context is a fixed-size state instead of paged KV.

    The runner allocates, for every state this layer names in state_shapes(), one tensor
    [num_state_slots, num_positions, *shape] (num_positions = 1 + num_speculative_tokens, so a
    verify pass can keep the state after each of its tokens) and binds the list to `states`.
    """

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.layer_name = prefix
        self.states: list[torch.Tensor] | None = None
        # Prefix caching: the same tensors [num_checkpoints, *shape] holding states saved at
        # block boundaries (None: no checkpoints).
        self.checkpoints: list[torch.Tensor] | None = None

    def state_shapes(self) -> list[tuple[int, ...]]:
        """Per-request shape of each state tensor."""
        raise NotImplementedError

    def state_dtypes(self, model_dtype: torch.dtype) -> list[torch.dtype]:
        """dtype of each state tensor."""
        raise NotImplementedError

    def state_bytes_per_slot(self, model_dtype: torch.dtype) -> int:
        total = 0
        for shape, dtype in zip(self.state_shapes(), self.state_dtypes(model_dtype)):
            n = 1
            for d in shape:
                n *= d
            total += n * torch.empty((), dtype=dtype).element_size()
        return total
