# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The draft's first pass, deferred for the requests nobody drafts for.

A draft head's first pass (step 0) runs over every row the target computed, and most of its
cost is writing the draft's KV there: a request drafting later attends to it. When the
scheduler verifies no draft next step for a request of a decode batch (the adaptive K where
drafting does not pay: at batch 16 the first pass was then all that speculation cost), that
request's pass is put off: each valid row's input - the token after it, its position, the
target's hidden states the draft reads (EAGLE3: the aux taps, before the fc) - is kept per
request-state slot, and the draft's KV there is written later in one batched pass
("catch-up") over the kept rows, before the request's next first pass, when its kept rows
would outgrow the buffer, or when it leaves its slot (finished, aborted, preempted: its blocks
may be served from the prefix cache, so their draft KV must be complete before anything can
hit them; without prefix caching such rows are dropped). In a step where some requests draft,
the first pass runs over their rows alone (laid out on their own, each row in the KV slot the
whole step's pass writes).

The catch-up runs the kept rows through the same products as the pass it replaces (all of them
decode rows: the small-M kernel, whose rows never depend on their neighbours), so the draft KV
it writes is bit-identical to what the deferred passes would have written, and so are every
later draft and the acceptance. Only drafts with one attention layer defer (EAGLE / EAGLE3
heads, a single MTP layer): a row's KV there
depends on nothing but the row's own inputs (a deeper layer's KV would read the attention
over the row's context, which a request that has left its slot no longer owns). A count forced
on every request (the start-up's step-cost measurement) never defers, so the adaptive K prices
a drafting step's first pass as before (it is owed whether it runs now or at a catch-up).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.attention.backends.torch_paged import build_attn_metadata
from vllm.forward_context import ALL_SHORT, ForwardContext
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


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """starts[i], starts[i] + 1, .., starts[i] + lens[i] - 1 for every i, one after another."""
    offs = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + offs


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
        self.flush_on_removal = spec.vllm_config.cache_config.enable_prefix_caching is not False
        # Since start-up: rows kept, rows written by a catch-up (flushes included), rows
        # flushed after their request left, requests whose rows would have outgrown a slot.
        self.num_deferred_rows = 0
        self.num_caught_up_rows = 0
        self.num_flushed_rows = 0
        self.num_dropped_rows = 0  # left with their request, nothing to read them
        self.num_overflows = 0
        # Steps where some requests drafted (their first pass alone) and the others kept.
        self.num_partial_steps = 0

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
    def keepable(
        self, db: DraftBatch, ks: np.ndarray | None, all_decode: bool, grammar: bool
    ) -> np.ndarray:
        """[R] bool: the requests whose rows this step may keep instead of running the first
        pass - nobody drafts for them next step (ks: the scheduler's counts per request; None:
        a count forced on all, never kept), every row of the step is a decode row, and their
        rows fit their slot after the ones kept before. With some requests drafting, the
        others keep theirs only without a grammar (grammar-aware drafting's forks are the whole
        batch's rows)."""
        slots = db.slots
        self._forget(slots[db.new_req])
        none = np.zeros(db.num_reqs, dtype=bool)
        if ks is None or not all_decode or (db.mm_rows is not None and len(db.mm_rows)):
            return none
        idle = ks == 0
        if not idle.all() and grammar:
            return none
        n = db.last - db.start + 1  # valid rows (rejected drafts' rows are not kept)
        kept = self.count[slots]
        # A request's kept rows end where this step's begin (else: caught up, the pass runs).
        contiguous = (kept == 0) | (self.start[slots] + kept == db.start)
        fits = kept + n <= self.cap
        self.num_overflows += int((idle & contiguous & ~fits).sum())
        return idle & contiguous & fits & (n >= 1)

    def keep(self, db: DraftBatch, raw: torch.Tensor) -> None:
        """Keep the valid rows of db's requests (db may be a take() of the step's batch).
        raw: what the first pass reads [T, width] (before the EAGLE3 fc), in the target's row
        layout."""
        slots = db.slots
        n = db.last - db.start + 1
        kept = self.count[slots]
        self.start[slots] = np.where(kept == 0, db.start, self.start[slots])
        # Flat rows of the target's layout (a request's valid rows end at its last row) ->
        # flat rows of the kept buffer.
        src = _ranges(db.last_token_indices - (n - 1), n)
        dst = _ranges(slots * self.cap + kept, n)
        rows = raw[torch.from_numpy(src).to(raw.device)]
        self.hidden.index_copy_(0, torch.from_numpy(dst).to(self.hidden.device), rows)
        flat_ids = self.ids.reshape(-1)
        flat_ids[dst] = db.input_ids[src]
        width = min(db.block_table.shape[1], self.block_table.shape[1])
        self.block_table[slots, :width] = db.block_table[:, :width]
        self.count[slots] = kept + n
        self.num_deferred_rows += int(n.sum())

    def _forget(self, slots: np.ndarray) -> None:
        """Slots whose request is new this step: nothing of theirs is kept."""
        if len(slots):
            self.count[slots] = 0

    # ---- writing the draft's KV -----------------------------------------------------------
    def catch_up_batch(self, db: DraftBatch) -> None:
        """Before this step's first pass: the kept rows of its requests (their KV first)."""
        has = (self.count[db.slots] > 0) & ~db.new_req
        if has.any():
            slots = db.slots[has]
            # Rows recomputed this step (a rollback) are the pass's to write; none are
            # expected: a step starts where the last one's valid rows ended.
            self.count[slots] = np.clip(db.start[has] - self.start[slots], 0, self.count[slots])
            self.catch_up(slots)

    def on_removed(self, slot: int) -> None:
        """A request left `slot`: its kept rows are written before the slot is reused where
        its blocks may be served from the prefix cache; without prefix caching nothing will read
        them (a preempted request recomputes its prompt, rows its first pass writes), so they
        are dropped."""
        if self.count[slot] == 0:
            return
        if self.flush_on_removal:
            self.removed.append(slot)
        else:
            self.num_dropped_rows += int(self.count[slot])
            self.count[slot] = 0

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
        offs = _ranges(np.zeros_like(counts), counts)
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


def drafting_part(db: DraftBatch, run: np.ndarray) -> tuple[DraftBatch, np.ndarray]:
    """The step as the requests `run` alone see it: their rows laid out on their own (the
    first pass over them only, each row in the KV slot the whole step's pass writes), and
    their rows' indices in the step's flat layout."""
    part = db.take(run)
    qsl = db.query_start_loc
    num = db.num_scheduled[run]
    rows = _ranges(qsl[run], num)
    new_qsl = np.concatenate([[0], np.cumsum(num)]).astype(np.int64)
    meta = db.attn_metadata
    sub_meta = build_attn_metadata(
        new_qsl,
        meta.seq_lens_np[run],
        db.block_table[run],
        meta.block_size,
        meta.device,
        slot_mapping=meta.slot_mapping[torch.from_numpy(rows).to(meta.slot_mapping.device)],
        positions=db.positions[rows],
        short_query_len=meta.short_query_len,
    )
    part = replace(
        part,
        last_token_indices=new_qsl[:-1] + (db.last_token_indices[run] - qsl[run]),
        query_start_loc=new_qsl,
        target_ids=db.target_ids[rows],
        input_ids=db.input_ids[rows],
        positions=db.positions[rows],
        attn_metadata=sub_meta,
    )
    return part, rows


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
    if spec.confidence is not None:
        spec.confidence.begin(num_reqs)
    return np.full((num_reqs, width), PAD_TOKEN_ID, dtype=np.int64)


def propose_deferring(
    spec: AutoRegressiveSpeculator,
    inputs: ProposeInputs,
    db: DraftBatch,
    target_layout: ForwardContext,
) -> np.ndarray | None:
    """propose() with the deferral: keep the rows of the requests nobody drafts for next step;
    when some do, draft for them alone (their kept rows caught up first) and return the step's
    drafts; None: every request runs the first pass (their kept rows caught up)."""
    deferral = spec.deferral
    assert deferral is not None
    kinds = target_layout.rows
    all_decode = kinds is not None and kinds.all_short
    ks = verified_next(inputs)
    ok = deferral.keepable(db, ks, all_decode, inputs.draft_grammar is not None)
    if not ok.any():
        deferral.catch_up_batch(db)
        return None
    # What the first pass reads, side by side (only where rows are kept).
    raw = inputs.last_hidden_states
    if spec.combiner is not None and inputs.aux_hidden_states:
        raw = torch.cat(inputs.aux_hidden_states, dim=-1)
    if ok.all():
        deferral.keep(db, raw)
        return no_drafts(spec, db.num_reqs)
    assert ks is not None
    deferral.keep(db.take(np.flatnonzero(ok)), raw)
    deferral.num_partial_steps += 1
    run = np.flatnonzero(~ok)
    part, rows = drafting_part(db, run)
    deferral.catch_up_batch(part)
    rows_t = torch.from_numpy(rows).to(raw.device)
    aux = inputs.aux_hidden_states
    hidden = spec.stage_hidden_states(
        spec._prefill_hidden(
            inputs.last_hidden_states[rows_t],
            [a[rows_t] for a in aux] if aux else None,
            ForwardContext.laid_out_as(part.attn_metadata),
        )
    )
    got = spec._draft(part, hidden, ks[run])
    part_parents = spec.tree_parents
    # The part's confidences, rows 0..len(run) - 1 (no_drafts clears them).
    part_conf = None if spec.confidence is None else spec.confidence.conf[: len(run)].copy()
    drafts = no_drafts(spec, db.num_reqs)
    drafts[run] = got
    if spec.confidence is not None and part_conf is not None:
        spec.confidence.conf[run] = part_conf
    if spec.speculative_config.num_tree_nodes is not None:
        assert part_parents is not None and spec.tree_parents is not None
        spec.tree_parents[run] = part_parents
    return drafts
