# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The per-forward context: one immutable object with everything a forward's layers read (the
attention metadata, the linear-attention metadata, and the kinds of its rows, which route each
linear layer's rows to the small-M kernel or BLAS). The runner (or a speculator, or the CUDA
graph capture) builds it from the step's metadata and passes it explicitly: the model's forward
takes it as `ctx` and hands it down to every decoder layer, attention block, MLP and MoE; every
linear product is given its rows' kinds as an argument (`ctx.rows`; ALL_SHORT for the rows
being sampled; None outside any forward: BLAS). There is no ambient (thread-local / context
variable) state: what routes a product is visible at its call."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch


@dataclass
class RowKinds:
    """Which rows of one forward's token batch belong to short-query requests (decode, draft
    verification, draft steps: their linears run the small-M CPU kernel, which streams each
    weight row once for all of them) and which to prefill chunks (BLAS). Decided per request by
    its query length, as the attention backend splits them - never by the batch's total row
    count - so a decode row takes the same arithmetic whatever shares its step.

    Rows past num_rows (padding) count as prefill rows when the batch is mixed."""

    num_rows: int
    all_short: bool
    all_long: bool
    short_rows: torch.Tensor | None = None  # int64 row index, only when mixed
    _long_rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def from_query_lens(
        cls, query_start_loc: np.ndarray, short_query_len: int, device: torch.device
    ) -> RowKinds:
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        q_lens = qsl[1:] - qsl[:-1]
        short = np.repeat(q_lens <= short_query_len, q_lens)
        num_rows = int(qsl[-1]) if len(qsl) else 0
        if short.all():
            return cls(num_rows, all_short=True, all_long=False)
        if not short.any():
            return cls(num_rows, all_short=False, all_long=True)
        kinds = cls(
            num_rows,
            all_short=False,
            all_long=False,
            short_rows=torch.from_numpy(np.nonzero(short)[0]).to(device),
        )
        kinds._long_rows[num_rows] = torch.from_numpy(np.nonzero(~short)[0]).to(device)
        return kinds

    def long_rows(self, total: int) -> torch.Tensor:
        """The prefill rows of a [total, ...] activation (total >= num_rows: padding rows
        included)."""
        if total not in self._long_rows:
            base = self._long_rows[self.num_rows]
            pad = torch.arange(self.num_rows, total, dtype=torch.int64, device=base.device)
            self._long_rows[total] = torch.cat([base, pad])
        return self._long_rows[total]


ALL_SHORT = RowKinds(num_rows=0, all_short=True, all_long=False)
"""Every row is a decode / verify / draft row: the kinds the LM head and the draft heads pass
for the rows being sampled."""

ALL_LONG = RowKinds(num_rows=0, all_short=False, all_long=True)
"""Every row is a prefill row (BLAS), whatever the forward's layout."""


def row_kinds_of(attn_metadata: Any) -> RowKinds | None:
    """The decode / prefill rows of a forward laid out as attn_metadata's requests
    (query_start_loc_np, short_query_len); None when the metadata has no such layout."""
    qsl = getattr(attn_metadata, "query_start_loc_np", None)
    short = getattr(attn_metadata, "short_query_len", None)
    if qsl is None or short is None:
        return None
    device = getattr(attn_metadata, "device", torch.device("cpu"))
    return RowKinds.from_query_lens(qsl, int(short), device)


@dataclass(frozen=True)
class ForwardContext:
    """What one forward's layers read; built once per forward, never changed, and passed down
    the call tree as an argument (the model's forward takes it as `ctx`)."""

    attn_metadata: Any = None
    """Metadata every attention layer of this forward reads (slot mapping, sequence layout)."""
    linear_attn_metadata: Any = None
    """Hybrid models: what their linear-attention (state) layers read (state slot per request,
    whether it has a prior state, query_start_loc); None for models without such layers."""
    rows_layout: Any = None
    """Metadata whose request layout the linear rows follow, when not attn_metadata's (the
    EAGLE3 combination of the target's rows, outside the draft's forward)."""
    fixed_row_kinds: RowKinds | None = None
    """Row kinds that hold whatever the layout (ALL_SHORT: the rows being sampled)."""

    @functools.cached_property
    def rows(self) -> RowKinds | None:
        """The kinds of this forward's rows, which every linear layer is given: which rows go
        to the small-M kernel and which to BLAS (None: all to BLAS); derived once, on first
        use, from the request layout."""
        if self.fixed_row_kinds is not None:
            return self.fixed_row_kinds
        kinds = row_kinds_of(self.rows_layout) if self.rows_layout is not None else None
        return kinds if kinds is not None else row_kinds_of(self.attn_metadata)

    @classmethod
    def laid_out_as(cls, attn_metadata: Any) -> ForwardContext:
        """Products outside any forward over rows laid out as attn_metadata's requests (e.g.
        EAGLE3's fc over the target's hidden states): no attention to run, rows by kind."""
        return cls(rows_layout=attn_metadata)

    def with_rows(self, kinds: RowKinds) -> ForwardContext:
        """This forward with its rows' kinds fixed (ALL_SHORT / ALL_LONG) whatever its layout."""
        return replace(self, fixed_row_kinds=kinds)
