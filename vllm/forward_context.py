# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The per-forward context: one immutable object with everything a forward's layers read (the
attention metadata, the linear-attention metadata, and the kinds of its rows, which route each
linear layer's rows to the small-M kernel or BLAS). The runner builds it from the step's
metadata and sets it around the model call; the layers read it, none writes it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
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
"""Every row is a decode / verify / draft row: the LM head and the draft heads over the rows
being sampled."""


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
    """What one forward's layers read; built once per forward, never changed."""

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
    def row_kinds(self) -> RowKinds | None:
        """Which rows the linear layers send to the small-M kernel and which to BLAS (None:
        all to BLAS); derived once, on first use, from the request layout."""
        if self.fixed_row_kinds is not None:
            return self.fixed_row_kinds
        kinds = row_kinds_of(self.rows_layout) if self.rows_layout is not None else None
        return kinds if kinds is not None else row_kinds_of(self.attn_metadata)


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("vllm_forward_context", default=None)


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Run the forward inside with ctx (restored on exit, so contexts nest)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def set_forward_context(
    attn_metadata: Any, linear_attn_metadata: Any = None
) -> contextlib.AbstractContextManager[ForwardContext]:
    """forward_context(ForwardContext(attn_metadata, linear_attn_metadata))."""
    return forward_context(ForwardContext(attn_metadata, linear_attn_metadata))


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("attention layer called outside a forward context")
    return ctx


def _current_or_empty() -> ForwardContext:
    ctx = _CURRENT.get()
    return ctx if ctx is not None else ForwardContext()


def decode_rows() -> contextlib.AbstractContextManager[ForwardContext]:
    """The products inside are over the rows being sampled (the LM head, the draft heads):
    every row a decode row, whatever forward they came from."""
    return forward_context(replace(_current_or_empty(), fixed_row_kinds=ALL_SHORT))


def rows_of(attn_metadata: Any) -> contextlib.AbstractContextManager[ForwardContext]:
    """The products inside are over rows laid out as attn_metadata's requests (e.g. the EAGLE3
    combination of the target's hidden states, outside the draft's forward)."""
    ctx = replace(_current_or_empty(), rows_layout=attn_metadata, fixed_row_kinds=None)
    return forward_context(ctx)


def current_row_kinds() -> RowKinds | None:
    """The kinds of the rows the linear layers multiply now (None outside a forward: BLAS)."""
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.row_kinds
