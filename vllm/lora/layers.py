# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The batched LoRA product of one linear layer: every adapter slot's A and B stacked, so a
step's rows, whatever adapter each uses (or none), take two products in one path:
y += ((x @ A_all^T) * mask) @ B_all^T, the mask keeping each row's own slot's columns."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearLayerBase,
    MergedColumnParallelLinear,
    MergedReplicatedLinear,
    RowParallelLinear,
    linear,
)


@dataclass
class LoRABatch:
    """Per step: each row's adapter slot (-1: none) and the masks built from it."""

    row_slots: np.ndarray
    rank: int
    device: torch.device
    dtype: torch.dtype
    num_slots: int = 0
    """Slots 0 .. num_slots - 1 cover every row's slot (0: no row uses an adapter)."""
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        used = self.row_slots[self.row_slots >= 0]
        self.num_slots = int(used.max()) + 1 if used.size else 0

    def mask(self, width: int) -> torch.Tensor:
        """[rows, num_slots * width]: 1 where column block s is the row's slot, else 0."""
        if width not in self._masks:
            cols = np.arange(self.num_slots * width) // width
            m = (self.row_slots[:, None] == cols[None, :]).astype(np.float32)
            self._masks[width] = torch.from_numpy(m).to(self.device, self.dtype)
        return self._masks[width]


class LoRALayer:
    """The stacked adapters of one linear layer and the forward hook that adds their product.
    Packed layers (qkv_proj, gate_up_proj) give each sub-projection its own rank block in A,
    and B is block-diagonal over them. Under TP, A and B are split like the base layer:
    column-parallel B on its output rows, row-parallel A on its input columns (the shrunk
    product summed over the ranks before B)."""

    def __init__(
        self, module: LinearLayerBase, max_loras: int, rank: int, dtype: torch.dtype
    ) -> None:
        if isinstance(module, ColumnParallelLinear) and module.gather_output:
            raise ValueError("LoRA on a column-parallel layer that gathers its output")
        self.module = module
        self.rank = rank
        self.merged = module if isinstance(module, MergedReplicatedLinear) else None
        self.num_parts = len(self.merged.output_sizes) if self.merged is not None else 1
        self.width = self.num_parts * rank
        # Row-parallel under TP: the shrunk product is summed over the group the base layer
        # was built over (held here: the hook looks nothing up).
        self.reduce_group = (
            module.tp if isinstance(module, RowParallelLinear) and module.tp_size > 1 else None
        )
        device = next(module.parameters()).device
        cols = max_loras * self.width
        self.a = torch.zeros(cols, module.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(module.out_features, cols, dtype=dtype, device=device)
        self._b_cache: tuple[int, torch.Tensor] | None = None
        self.batch: LoRABatch | None = None
        self.handle = module.register_forward_hook(self._hook)

    def part_of(self, shard: int | None, a: torch.Tensor, b: torch.Tensor):
        """This rank's (A, B) of a whole checkpoint pair, checked against the layer."""
        m = self.module
        if isinstance(m, MergedColumnParallelLinear) and shard is not None:
            b = m.tp_shard_checkpoint_tensor(shard, b)
        elif isinstance(m, ColumnParallelLinear):
            b = m.tp_shard_checkpoint_tensor("weight", b)
        elif isinstance(m, RowParallelLinear):
            a = m.tp_shard_checkpoint_tensor("weight", a)
        rows = m.out_features
        if shard is not None:
            assert self.merged is not None
            rows = self.merged.output_sizes[shard]
        if a.shape[1] != m.in_features or b.shape[0] != rows:
            raise ValueError(
                f"LoRA pair of shapes {tuple(a.shape)} / {tuple(b.shape)} does not fit a layer "
                f"of {m.in_features} -> {rows} features"
            )
        return a, b

    def set_slot(self, slot: int, parts: dict[int | None, tuple[torch.Tensor, torch.Tensor]]):
        """Write an adapter's (A, B) parts (B already scaled) into slot; nothing: zeros."""
        w = self.width
        self.a[slot * w : (slot + 1) * w].zero_()
        self.b[:, slot * w : (slot + 1) * w].zero_()
        for shard, (a, b) in parts.items():
            r = a.shape[0]
            col = slot * w + (shard or 0) * self.rank
            self.a[col : col + r].copy_(a)
            if shard is None:
                self.b[:, col : col + r].copy_(b)
            else:
                assert self.merged is not None
                start, n = self.merged.shard_rows(shard)
                self.b[start : start + n, col : col + r].copy_(b)
        self._b_cache = None

    def _hook(self, module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        if batch is None or batch.num_slots == 0:
            return y
        x, rows = args  # layer(x, rows): the LoRA products take the layer's row kinds
        if x.dim() != 2 or x.shape[0] != batch.row_slots.shape[0]:
            raise RuntimeError(
                f"LoRA layer got {tuple(x.shape)} inputs for a step of "
                f"{batch.row_slots.shape[0]} rows"
            )
        cols = batch.num_slots * self.width
        h = linear(x, self.a[:cols], None, rows)
        if self.reduce_group is not None:
            h = self.reduce_group.all_reduce(h)
        h = h * batch.mask(self.width)
        return y + linear(h, self._b(cols), None, rows)

    def _b(self, cols: int) -> torch.Tensor:
        if self._b_cache is None or self._b_cache[0] != cols:
            self._b_cache = (cols, self.b[:, :cols].contiguous())
        return self._b_cache[1]
