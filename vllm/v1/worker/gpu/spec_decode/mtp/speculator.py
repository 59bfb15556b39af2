# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""MTPSpeculator: drafts with the multi-token-prediction layers shipped in the target checkpoint
(draft step s uses MTP layer s mod n), optionally sharing DSA top-k indices across steps.

A draft with n chained layers is run the way such layers are trained: layer s at target position
t reads layer s-1's output at t and the token at t + s + 1. So for s < n, step s runs layer s
over every position whose KV it lacks, up to the request's last accepted one (the first s of
them fed by the drafts already proposed; those rows are recomputed once the real tokens are
known, from a one-row carry of layer s-1's output), and drafts from that last row; every
layer's KV is then valid for every position it attends to, whatever the blocks held before.
Steps s >= n reuse layer s mod n on the n rows after its previous ones (with n = 1: one new row
per step, the plain autoregressive decode of the base class).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.attention.backends.torch_paged import AttentionMetadata, build_attn_metadata
from vllm.config import VllmConfig, num_mtp_layers
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.interfaces import SupportsTopkSharing, TargetShares
from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import (
    AutoRegressiveSpeculator,
    DraftBatch,
    StepInputs,
)
from vllm.v1.worker.gpu.spec_decode.tree import StaticTree
from vllm.v1.worker.gpu.spec_decode.tree_draft import propose_tree

if TYPE_CHECKING:
    from vllm.model_executor.models.base import CausalLMBase


@dataclass
class _Rows:
    """The rows one draft step runs on: per request, consecutive target positions lo .. last."""

    lo: np.ndarray  # [R]
    count: np.ndarray  # [R]
    qsl: np.ndarray  # [R + 1]
    req: np.ndarray  # [N] request of each row
    t: np.ndarray  # [N] target position of each row

    @classmethod
    def span(cls, lo: np.ndarray, count: np.ndarray) -> _Rows:
        qsl = np.zeros(len(lo) + 1, dtype=np.int64)
        np.cumsum(count, out=qsl[1:])
        req = np.repeat(np.arange(len(lo)), count)
        t = lo[req] + np.arange(int(qsl[-1])) - qsl[:-1][req]
        return cls(lo, count, qsl, req, t)

    def find(self, req: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flat row of (req, t) here, whether it exists)."""
        found = (t >= self.lo[req]) & (t < self.lo[req] + self.count[req])
        return self.qsl[:-1][req] + t - self.lo[req], found


@dataclass
class _Plan:
    """One batch's draft steps: the rows of each, and per chained layer the positions whose KV
    is final after it (rows reading known tokens only: layer s at t reads t + s + 1)."""

    rows_by_step: list[_Rows]
    final_after: np.ndarray  # [chained layers, R]


class MTPSpeculator(AutoRegressiveSpeculator):
    # DeepSeek-V3.2: the draft whose steps 1.. reuse step 0's sparse-attention top-k indices
    # (its config sets index_share_for_mtp_iteration); None: every step selects its own.
    topk_sharing: SupportsTopkSharing | None = None
    # The chained layers run every request's rows each step (see _decode_inputs).
    drafts_row_subsets = False
    # One MTP layer puts its first pass off while nobody drafts (autoregressive/deferral.py).
    defers_first_pass = True
    # Chained draft layers (the checkpoint's MTP layers); draft step s uses layer s mod n.
    num_draft_layers = 1

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        super().__init__(vllm_config, device)
        # Rows of the previous draft step each row of the next one continues (DSA top-k reuse).
        self.topk_src_rows = torch.zeros(0, dtype=torch.int64, device=device)
        # Per request slot and chained layer, how many leading positions hold final KV (its
        # rows before it were computed from known tokens), and one row of each layer's output
        # that the next layer's first recomputed row reads.
        self.kv_final_len = np.zeros((1, self.max_num_reqs), dtype=np.int64)
        self.carry: torch.Tensor | None = None
        self._plan: _Plan | None = None

    @property
    def share_mtp_topk_indices(self) -> bool:
        return self.topk_sharing is not None

    @property
    def num_chained_layers(self) -> int:
        """Draft layers one propose runs over the prefill positions (layers 0 .. n-1)."""
        return max(1, min(self.num_speculative_steps, self.num_draft_layers))

    @property
    def num_lookahead_tokens(self) -> int:
        """Known tokens after a request's last position the draft may read (layer s reads the
        token s + 1 positions ahead)."""
        return self.num_chained_layers

    @property
    def min_draft_steps(self) -> int:
        """Every chained layer runs each step (its KV stays final up to the last accepted
        position), whatever the scheduler verifies next."""
        return self.num_chained_layers

    def on_draft_bound(self, draft: DraftModel, shares: TargetShares) -> None:
        super().on_draft_bound(draft, shares)
        n = max(1, num_mtp_layers(self.draft_model_config.hf_text_config))
        # A tree on several MTP layers drafts every depth with the first (a chained layer
        # needs one row per position; a tree has several).
        self.first_layer_only = self.speculative_config.is_tree and n > 1
        self.num_draft_layers = 1 if self.speculative_config.is_tree else n
        if isinstance(draft, SupportsTopkSharing) and draft.shares_topk_across_steps:
            self.topk_sharing = draft

    def load_model(self, target_model: CausalLMBase) -> None:
        super().load_model(target_model)
        self.kv_final_len = np.zeros((self.num_chained_layers, self.max_num_reqs), np.int64)

    # ---- top-k sharing across draft steps (the lifecycle hooks) ----------------------------
    def on_prefill_begin(self, num_reqs: int) -> None:
        if self.topk_sharing is not None:
            # Unconditional: a step that failed half-way must not leave reuse switched on.
            self.topk_sharing.set_skip_topk(False)

    def on_prefill_end(self, num_reqs: int) -> None:
        # Step 1's rows continue step 0's rows topk_src_rows (one layer: each request's last
        # accepted row, last_token_indices).
        if self.topk_sharing is not None and self.num_speculative_steps > 1:
            self.topk_sharing.compact_topk_indices(self.topk_src_rows)

    def on_draft_rows_changed(self, num_reqs: int) -> None:
        """A decode step runs on other rows than the one before (topk_src_rows maps them)."""
        if self.topk_sharing is not None:
            self.topk_sharing.compact_topk_indices(self.topk_src_rows)

    def on_multi_step_decode_begin(self, num_reqs: int) -> None:
        if self.topk_sharing is not None:
            self.topk_sharing.set_skip_topk(True)

    def on_multi_step_decode_end(self, num_reqs: int) -> None:
        if self.topk_sharing is not None:
            self.topk_sharing.set_skip_topk(False)

    def _one_attention_layer(self) -> bool:
        """One MTP layer's attention - of the only layer a tree drafts with, on a checkpoint
        with several; a DSA layer's indexer keys are a second cache, also computed from the
        row alone."""
        names, draft = self.draft_attn_layer_names, self.model
        if self.first_layer_only and draft is not None:
            net = draft.step_network(0)
            used = {id(m) for m in net.modules()} if isinstance(net, torch.nn.Module) else set()
            names = {n for n, m in draft.named_modules() if n in names and id(m) in used}
        return len({n for n in names if not n.endswith(".indexer.k_cache")}) == 1

    @contextmanager
    def tree_pass(self, root_rows: np.ndarray, nodes: int) -> Iterator[None]:
        """A draft tree's node pass with top-k sharing: every node reads the selection its
        request's root row made in step 0 (the chain's steps 1.. read their last row's), moved
        to the pass's rows (root_rows: where the roots' rows are now)."""
        if self.topk_sharing is None:
            yield
            return
        R = len(root_rows)
        self.topk_src_rows = torch.from_numpy(np.repeat(root_rows, nodes)).to(self.device)
        self.on_draft_rows_changed(R)
        with self._hooked(self.on_multi_step_decode_begin, self.on_multi_step_decode_end, R):
            yield

    # ---- the chained rows ---------------------------------------------------------------------
    def _begin_draft(self, db: DraftBatch) -> None:
        K, nc = self.num_speculative_steps, self.num_chained_layers
        prev = _Rows.span(db.start, db.num_scheduled)
        rows_by_step = [prev] + [self._step_rows(db, s) for s in range(1, K)]
        final_after = np.stack(
            [
                np.maximum(rows_by_step[s].lo, np.minimum(db.last + 1, db.num_known - 1 - s))
                for s in range(nc)
            ]
        )
        self._plan = _Plan(rows_by_step, final_after)
        if K > 1:
            src, found = prev.find(rows_by_step[1].req, rows_by_step[1].t)
            self._set_topk_src_rows(prev, rows_by_step[1], src, found)

    def _draft(
        self, db: DraftBatch, hidden_states: torch.Tensor, num_steps: int | np.ndarray | None = None
    ) -> np.ndarray:
        """A draft tree runs every node through the first MTP layer (tree_pass: reading the
        root's top-k); else the chained drafts."""
        tree = StaticTree.from_config(self.vllm_config)
        if tree is None and self.speculative_config.num_tree_nodes is None:
            return super()._draft(db, hidden_states, num_steps)
        self._begin_draft(db)
        drafts = propose_tree(self, db, hidden_states, tree, num_steps)
        assert drafts is not None
        self._end_draft(db)
        return drafts

    def _end_draft(self, db: DraftBatch) -> None:
        assert self._plan is not None
        self.kv_final_len[:, db.slots] = self._plan.final_after

    def _decode_inputs(
        self,
        db: DraftBatch,
        step: int,
        feedback: torch.Tensor,
        drafts: np.ndarray,
        rows: np.ndarray,
        prev_rows: np.ndarray,
    ) -> StepInputs:
        # Every request (drafts_row_subsets is off: the plan covers the whole batch).
        assert len(rows) == db.num_reqs and self._plan is not None
        plan = self._plan
        prev, cur = plan.rows_by_step[step - 1], plan.rows_by_step[step]
        src, found = prev.find(cur.req, cur.t)
        if step > 1 and not (found.all() and np.array_equal(src, np.arange(len(src)))):
            self._set_topk_src_rows(prev, cur, src, found)
            self.on_draft_rows_changed(db.num_reqs)
        hidden = self._gather_hidden(db, step, feedback, src, found, cur)
        if step <= self.num_chained_layers - 1:
            self._update_carry(db, step - 1, prev, feedback, plan.final_after)
        meta, positions = self._rows_metadata(db, cur, step)
        ids = self._step_tokens(db, cur, step, drafts)
        return StepInputs(ids, positions, hidden, meta, cur.qsl[1:] - 1)

    def _step_rows(self, db: DraftBatch, step: int) -> _Rows:
        """Rows of draft step >= 1 (module docstring)."""
        nl = self.num_draft_layers
        if step < self.num_chained_layers:
            final = self.kv_final_len[step, db.slots]
            lo = np.where(db.new_req, db.start, np.minimum(final, db.start))
            return _Rows.span(lo, db.last - lo + 1)
        return _Rows.span(db.last - nl + 1, np.full(db.num_reqs, nl, dtype=np.int64))

    def _step_tokens(
        self, db: DraftBatch, rows: _Rows, step: int, drafts: np.ndarray
    ) -> np.ndarray:
        """The token each row of a draft step reads: the one step + 1 positions ahead."""
        req = rows.req
        x = rows.t + step + 1
        last = db.last[req]
        ahead = x - last - 1  # 0: the token after the last valid position
        in_batch = ahead < 0
        flat = db.query_start_loc[:-1][req] + np.where(in_batch, x - db.start[req], 0)
        L = db.next_tokens.shape[1]
        known = ~in_batch & (x < db.num_known[req]) & (ahead < L)
        from_draft = np.clip(ahead - 1, 0, drafts.shape[1] - 1)
        return np.where(
            in_batch,
            db.target_ids[np.minimum(flat, len(db.target_ids) - 1)],
            np.where(
                known,
                db.next_tokens[req, np.clip(ahead, 0, L - 1)],
                drafts[req, from_draft],
            ),
        )

    def _set_topk_src_rows(
        self, prev: _Rows, rows: _Rows, src: np.ndarray, found: np.ndarray
    ) -> None:
        # A row with no counterpart (a carried position) reuses its request's first row.
        first = prev.qsl[:-1][rows.req]
        self.topk_src_rows = torch.from_numpy(np.where(found, src, first)).to(self.device)

    def _gather_hidden(
        self,
        db: DraftBatch,
        step: int,
        feedback: torch.Tensor,
        src: np.ndarray,
        found: np.ndarray,
        rows: _Rows,
    ) -> torch.Tensor:
        """The hidden state each row of a draft step reads: the previous step's output at the
        same target position; a chained layer's one recomputed row before that, the carry;
        anything else (rows before a sequence's start), zeros."""
        if found.all():
            return feedback[torch.from_numpy(src).to(self.device)]
        R = db.num_reqs
        n = feedback.shape[0]
        use_carry = ~found & (step < self.num_chained_layers) & ~db.new_req[rows.req]
        index = np.where(found, src, np.where(use_carry, n + rows.req, n + R))
        if step < self.num_chained_layers:
            slots = torch.from_numpy(db.slots).to(self.device)
            carry = self._ensure_carry(feedback)[step - 1][slots]
        else:  # past the chained layers nothing is carried (and the carry has no such row)
            carry = feedback.new_zeros(R, *feedback.shape[1:])
        src_t = torch.cat([feedback, carry, feedback.new_zeros(1, *feedback.shape[1:])])
        return src_t[torch.from_numpy(index).to(self.device)]

    def _ensure_carry(self, like: torch.Tensor) -> torch.Tensor:
        """[chained layers - 1, max_num_reqs, H] carried rows, allocated like the draft's
        output on first use."""
        if self.carry is None or self.carry.shape[2:] != like.shape[1:]:
            n = max(self.num_chained_layers - 1, 1)
            self.carry = like.new_zeros(n, self.max_num_reqs, *like.shape[1:])
        return self.carry

    def _update_carry(
        self,
        db: DraftBatch,
        layer: int,
        rows: _Rows,
        feedback: torch.Tensor,
        final_after: np.ndarray,
    ) -> None:
        """Keep layer `layer`'s output at the first position layer + 1 will recompute next
        step, where layer `layer` itself will not recompute it."""
        need = final_after[layer + 1]
        req = np.arange(db.num_reqs)
        src, found = rows.find(req, need)
        keep = found & (need < final_after[layer])
        if not keep.any():
            return
        carry = self._ensure_carry(feedback)
        slots = torch.from_numpy(db.slots[keep]).to(self.device)
        carry[layer][slots] = feedback[torch.from_numpy(src[keep]).to(self.device)]

    def _rows_metadata(
        self, db: DraftBatch, rows: _Rows, step: int
    ) -> tuple[AttentionMetadata, np.ndarray]:
        """Attention metadata and positions of a draft step's rows: chained layers at their
        target positions; a reused layer on the positions after its previous rows (clamped to
        the model length)."""
        nl = self.num_draft_layers
        lap = step // nl if step >= self.num_chained_layers else 0
        end = np.minimum(db.last + lap * nl, self.max_model_len - 1)
        positions = end[rows.req] - (db.last[rows.req] - rows.t)
        meta = build_attn_metadata(
            rows.qsl,
            end + 1,
            db.block_table,
            self.block_size,
            self.device,
            positions=positions,
            short_query_len=self.num_speculative_steps + nl,
        )
        return meta, positions
