# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The draft's first pass, deferred while nobody drafts.

A draft head's first pass (step 0) runs over every row the target computed, and most of its
cost is writing the draft's KV there: a request drafting later attends to it. When the
scheduler verifies no draft next step for any request of a decode batch (the adaptive K at a
batch where drafting does not pay: the first pass is then all the speculation costs), the pass
is put off: each valid row's input - the token after it, its position, the target's hidden
states the draft reads (EAGLE3: the aux taps, before the fc) - is kept per request-state slot,
and the draft's KV there is written later in one batched pass ("catch-up") over every kept row
of a request, before its next first pass, when its kept rows would outgrow the buffer, or when
it leaves its slot (finished, aborted, preempted: its blocks may be served from the prefix
cache, so their draft KV must be complete before anything can hit them).

The catch-up runs the kept rows through the same products as the pass it replaces (all of them
decode rows: the small-M kernel, whose rows never depend on their neighbours), so the draft KV
it writes is bit-identical to what the deferred passes would have written, and so are every
later draft and the acceptance. Only drafts with one attention layer defer: a row's KV there
depends on nothing but the row's own inputs (a deeper layer's KV would read the attention
over the row's context, which a request that has left its slot no longer owns).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.attention.backends.torch_paged import build_attn_metadata
from vllm.forward_context import ALL_SHORT
from vllm.logger import init_logger
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import (
        AutoRegressiveSpeculator,
        DraftBatch,
    )
    from vllm.v1.worker.gpu.spec_decode.speculator import ProposeInputs

logger = init_logger(__name__)

# Memory for the kept rows of all request-state slots, and the rows one slot may keep.
BUDGET_BYTES = 64 * 2**20
MAX_ROWS = 256
MIN_ROWS = 8


class FirstPassDeferral:
    """Kept first-pass rows per request-state slot, contiguous from positions start[slot]."""

    def __init__(
        self,
        spec: AutoRegressiveSpeculator,
        width: int,
        dtype: torch.dtype,
        cap: int,
    ) -> None:
        self.spec = spec
        R = spec.max_num_reqs
        self.cap = cap
        self.width = width
        self.hidden = torch.zeros(R * cap, width, dtype=dtype, device=spec.device)
        self.ids = np.zeros((R, cap), dtype=np.int64)
        self.start = np.zeros(R, dtype=np.int64)
        self.count = np.zeros(R, dtype=np.int64)
        max_blocks = -(-spec.max_model_len // spec.block_size) + 1
        self.block_table = np.zeros((R, max_blocks), dtype=np.int64)
        self.removed: list[int] = []
        # Since start-up: rows kept, rows written by a catch-up (flushes included), rows
        # flushed after their request left, steps whose rows would have outgrown a slot.
        self.num_deferred_rows = 0
        self.num_caught_up_rows = 0
        self.num_flushed_rows = 0
        self.num_overflows = 0

    @classmethod
    def for_speculator(cls, spec: AutoRegressiveSpeculator, width: int) -> FirstPassDeferral | None:
        """A deferral sized to the memory budget, or None where a slot could keep too few rows
        for deferring to pay."""
        itemsize = torch.empty(0, dtype=spec.dtype).element_size()
        per_row = spec.max_num_reqs * width * itemsize
        cap = min(MAX_ROWS, spec.max_model_len, spec.max_num_tokens, BUDGET_BYTES // per_row)
        if cap < MIN_ROWS:
            return None
        return cls(spec, width, spec.dtype, cap)

    # ---- the decision ---------------------------------------------------------------------
    def try_defer(
        self, db: DraftBatch, raw: torch.Tensor, ks: np.ndarray | None, all_decode: bool
    ) -> bool:
        """Keep this step's rows instead of running the first pass, when nobody drafts next
        step (ks: the scheduler's counts per request, all 0; None: a forced count), every row
        is a decode row and every request's rows fit its slot; returns whether they were kept.
        raw: what the first pass reads [T, width] (before the EAGLE3 fc), in the target's row
        layout."""
        slots = db.slots
        self._forget(slots[db.new_req])
        if ks is None or ks.any() or not all_decode:
            return False
        if db.mm_rows is not None and len(db.mm_rows):
            return False
        n = db.last - db.start + 1  # valid rows (rejected drafts' rows are not kept)
        kept = self.count[slots]
        # A request's kept rows end where this step's begin (else: catch up, run the pass).
        contiguous = (kept == 0) | (self.start[slots] + kept == db.start)
        if not contiguous.all() or (n < 1).any():
            return False
        if (kept + n > self.cap).any():
            self.num_overflows += 1
            return False
        first = np.where(kept == 0, db.start, self.start[slots])
        self.start[slots] = first
        # Flat rows of the target's layout -> flat rows of the kept buffer.
        src = np.concatenate([db.query_start_loc[i] + np.arange(n[i]) for i in range(len(n))])
        base = slots * self.cap + kept
        dst = np.concatenate([base[i] + np.arange(n[i]) for i in range(len(n))])
        rows = raw[torch.from_numpy(src).to(raw.device)]
        self.hidden.index_copy_(0, torch.from_numpy(dst).to(self.hidden.device), rows)
        flat_ids = self.ids.reshape(-1)
        flat_ids[dst] = db.input_ids[src]
        width = min(db.block_table.shape[1], self.block_table.shape[1])
        self.block_table[slots, :width] = db.block_table[:, :width]
        self.count[slots] = kept + n
        self.num_deferred_rows += int(n.sum())
        return True

    def _forget(self, slots: np.ndarray) -> None:
        """Slots whose request is new this step: nothing of theirs is kept."""
        if len(slots):
            self.count[slots] = 0

    # ---- writing the draft's KV -----------------------------------------------------------
    def catch_up_batch(self, db: DraftBatch) -> None:
        """Before this step's first pass: the kept rows of its requests (their KV first)."""
        slots = db.slots[~db.new_req]
        has = slots[self.count[slots] > 0]
        if len(has):
            # Rows recomputed this step (a rollback) are the pass's to write; none are
            # expected: a step starts where the last one's valid rows ended.
            starts = db.start[~db.new_req][self.count[slots] > 0]
            self.count[has] = np.clip(starts - self.start[has], 0, self.count[has])
            self.catch_up(has)

    def on_removed(self, slot: int) -> None:
        if self.count[slot] > 0:
            self.removed.append(slot)

    def flush_removed(self) -> None:
        """The kept rows of the requests that left their slots (before the slots are reused)."""
        if self.removed:
            slots, self.removed = np.array(sorted(set(self.removed)), dtype=np.int64), []
            self.num_flushed_rows += int(self.count[slots].sum())
            self.catch_up(slots)

    def catch_up(self, slots: np.ndarray) -> None:
        """Draft forwards over the kept rows of these slots (writes their KV), at most a step's
        tokens each; forgets the rows."""
        slots = slots[self.count[slots] > 0]
        limit = max(self.spec.max_num_tokens, self.cap)
        while len(slots):
            ends = np.cumsum(self.count[slots])
            n = max(1, int(np.searchsorted(ends, limit, side="right")))
            self._catch_up(slots[:n])
            slots = slots[n:]

    def _catch_up(self, slots: np.ndarray) -> None:
        spec = self.spec
        dev = spec.device
        counts = self.count[slots]
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        offs = np.concatenate([np.arange(c) for c in counts])
        owner = np.repeat(slots, counts)
        positions = self.start[owner] + offs
        flat = torch.from_numpy(owner * self.cap + offs).to(dev)
        meta = build_attn_metadata(
            qsl,
            self.start[slots] + counts,
            self.block_table[slots],
            spec.block_size,
            dev,
            positions=positions,
            short_query_len=spec.num_speculative_steps + 1,
        )
        hidden = spec.combine_kept(self.hidden[flat])
        spec._run_model(
            torch.from_numpy(self.ids[owner, offs]).to(dev),
            torch.from_numpy(positions).to(dev),
            hidden,
            meta,
            0,
            row_kinds=ALL_SHORT,
        )
        self.count[slots] = 0
        self.num_caught_up_rows += int(counts.sum())


def verified_next(inputs: ProposeInputs) -> np.ndarray | None:
    """[R] the drafts each request verifies next step, where the scheduler decided them per
    request; None where one count was forced on every request (the start-up's step-cost
    measurement prices steps as a drafting batch runs them: never deferred)."""
    if inputs.req_draft_steps is None:
        return None
    return np.asarray(inputs.req_draft_steps, dtype=np.int64)


def no_drafts(spec: AutoRegressiveSpeculator, num_reqs: int) -> np.ndarray:
    """What propose returns when nobody drafts: PAD everywhere (a dynamic tree's parents: a
    chain, never verified)."""
    width = spec.draft_tokens.shape[1]
    if spec.speculative_config.num_tree_nodes is not None:
        parents = np.full((num_reqs, width), -1, dtype=np.int64)
        parents[:, 1:] = np.arange(width - 1)
        spec.tree_parents = parents
    return np.full((num_reqs, width), PAD_TOKEN_ID, dtype=np.int64)
