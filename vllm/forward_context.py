# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The per-forward attention metadata, set by the runner around each model call, and which rows
of the forward are decode / verify / draft rows (the linear layers route them by kind)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_local = threading.local()


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


@dataclass
class ForwardContext:
    attn_metadata: Any
    """Metadata every attention layer of this forward reads (slot mapping, sequence layout)."""
    linear_attn_metadata: Any = None
    """Hybrid models: what their linear-attention (state) layers read (state slot per request,
    whether it has a prior state, query_start_loc); None for models without such layers."""
    _row_kinds: RowKinds | None = field(default=None, repr=False)
    _row_kinds_known: bool = field(default=False, repr=False)

    @property
    def row_kinds(self) -> RowKinds | None:
        """The forward's decode / prefill rows, from the attention metadata's request layout
        (query_start_loc_np, short_query_len); None when the metadata has no such layout."""
        if not self._row_kinds_known:
            self._row_kinds_known = True
            meta = self.attn_metadata
            qsl = getattr(meta, "query_start_loc_np", None)
            short = getattr(meta, "short_query_len", None)
            if qsl is not None and short is not None:
                device = getattr(meta, "device", torch.device("cpu"))
                self._row_kinds = RowKinds.from_query_lens(qsl, int(short), device)
        return self._row_kinds


@contextmanager
def set_forward_context(
    attn_metadata: Any, linear_attn_metadata: Any = None
) -> Iterator[ForwardContext]:
    """Make attn_metadata visible to the attention layers for the duration of one forward."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ForwardContext(attn_metadata, linear_attn_metadata)
    try:
        yield _local.ctx
    finally:
        _local.ctx = prev


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention layer called outside set_forward_context()")
    return ctx


@contextmanager
def linear_rows(kinds: RowKinds | None) -> Iterator[None]:
    """The linear layers' rows inside are of these kinds, whatever forward context is set."""
    prev = getattr(_local, "rows", None)
    _local.rows = kinds
    try:
        yield
    finally:
        _local.rows = prev


def decode_rows() -> contextlib.AbstractContextManager[None]:
    """Every row of the products inside is a decode / verify / draft row: the LM head and the
    draft heads over the rows being sampled."""
    return linear_rows(ALL_SHORT)


def rows_of(attn_metadata: Any) -> contextlib.AbstractContextManager[None]:
    """The rows inside are laid out as attn_metadata's requests (e.g. the EAGLE3 combination
    of the target's hidden states, outside the draft's forward)."""
    return linear_rows(ForwardContext(attn_metadata).row_kinds)


def current_row_kinds() -> RowKinds | None:
    """The kinds of the rows linear layers multiply now: decode_rows() inside, else the
    forward context's, else None (no forward: everything goes to BLAS)."""
    rows = getattr(_local, "rows", None)
    if rows is not None:
        return rows
    ctx = getattr(_local, "ctx", None)
    return None if ctx is None else ctx.row_kinds
