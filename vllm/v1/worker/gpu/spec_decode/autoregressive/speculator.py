# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""AutoRegressiveSpeculator: a draft model that proposes K tokens one after another.

Step 0 runs the draft over the target's scheduled tokens of this step (same layout, attention
metadata and KV slots as the target; inputs shifted left by one so each position sees the token
after it), which also fills the draft's KV cache for every position the target computed. Each
request's first draft comes from its last accepted row.

A draft with n chained layers (DeepSeek-style MTP: draft step s uses layer s mod n) is run the
way such layers are trained: layer s at target position t reads layer s-1's output at t and the
token at t + s + 1. So for s < n, step s runs layer s over every position whose KV it lacks, up
to the request's last accepted one (the first s of them fed by the drafts already proposed;
those rows are recomputed once the real tokens are known, from a one-row carry of layer s-1's
output), and drafts from that last row; every layer's KV is then valid for every position it
attends to, whatever the blocks held before. Steps s >= n reuse layer s mod n on the n rows
after its previous ones (with n = 1: one new row per step, the plain autoregressive decode).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.interfaces import CombinesHiddenStates, TargetShares
from vllm.v1.attention.backends.torch_paged import AttentionMetadata, build_attn_metadata
from vllm.v1.worker.gpu.sample.sampler import SamplingArrays
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator, ProposeInputs

if TYPE_CHECKING:
    from vllm.model_executor.models.base import CausalLMBase

logger = init_logger(__name__)


@dataclass
class DraftBatch:
    """The target's step as the draft sees it (one entry per request unless noted)."""

    slots: np.ndarray  # request-state slot (indexes the draft's per-request bookkeeping)
    new_req: np.ndarray  # bool: the request entered its slot this step (nothing to carry)
    start: np.ndarray  # first position the target computed this step
    last: np.ndarray  # last valid (accepted) position
    last_token_indices: np.ndarray  # flat row of `last` in the target layout
    query_start_loc: np.ndarray  # [R + 1] the target layout
    num_scheduled: np.ndarray  # rows of each request in the target layout
    target_ids: np.ndarray  # [T] the target's input tokens
    input_ids: np.ndarray  # [num_tokens_padded] step 0's tokens (target's, shifted left)
    positions: np.ndarray  # [num_tokens_padded]
    next_tokens: np.ndarray  # [R, L] known tokens after `last` (first: its next token)
    num_known: np.ndarray  # known tokens of the sequence after this step
    block_table: np.ndarray  # [R, max_blocks]
    attn_metadata: AttentionMetadata  # the target's (step 0 reuses it)
    sampling: SamplingArrays

    @property
    def num_reqs(self) -> int:
        return len(self.slots)


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


class AutoRegressiveSpeculator(DraftModelSpeculator):
    # Chained draft layers (MTP: the checkpoint's MTP layers); draft step s uses layer s mod n.
    num_draft_layers = 1

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        super().__init__(vllm_config, device)
        # Index (into the flattened step-0 pass) of each request's last accepted row.
        self.last_token_indices = torch.zeros(self.max_num_reqs, dtype=torch.int64, device=device)
        # Rows of the previous draft step each row of the next one continues (DSA top-k reuse).
        self.topk_src_rows = torch.zeros(0, dtype=torch.int64, device=device)
        # The draft's fc over the target's aux taps (EAGLE3), when it reads them.
        self.combiner: CombinesHiddenStates | None = None
        # Chained layers only: per request slot and layer, how many leading positions hold
        # final KV (its rows before it were computed from known tokens), and one row of each
        # layer's output that the next layer's first recomputed row reads.
        self.kv_final_len = np.zeros((1, self.max_num_reqs), dtype=np.int64)
        self.carry: torch.Tensor | None = None

    @property
    def num_chained_layers(self) -> int:
        """Draft layers one propose runs over the prefill positions (layers 0 .. n-1)."""
        return max(1, min(self.num_speculative_steps, self.num_draft_layers))

    @property
    def num_lookahead_tokens(self) -> int:
        """Known tokens after a request's last position the draft may read (layer s reads the
        token s + 1 positions ahead)."""
        return self.num_chained_layers

    def on_draft_bound(self, draft: DraftModel, shares: TargetShares) -> None:
        if isinstance(draft, CombinesHiddenStates) and shares.aux_hidden_state_layers:
            self.combiner = draft

    def load_model(self, target_model: CausalLMBase) -> None:
        super().load_model(target_model)
        self.kv_final_len = np.zeros((self.num_chained_layers, self.max_num_reqs), np.int64)

    # ---- lifecycle hooks (no-ops here; MTP top-k sharing uses them) ------------------------
    def on_prefill_begin(self, num_reqs: int) -> None:
        pass

    def on_prefill_end(self, num_reqs: int) -> None:
        pass

    def on_multi_step_decode_begin(self, num_reqs: int) -> None:
        pass

    def on_multi_step_decode_end(self, num_reqs: int) -> None:
        pass

    def on_draft_rows_changed(self, num_reqs: int) -> None:
        """A decode step runs on other rows than the one before (topk_src_rows maps them)."""

    @contextmanager
    def _hooked(
        self, begin: Callable[[int], None], end: Callable[[int], None], num_reqs: int
    ) -> Iterator[None]:
        """begin / end around a phase; end also runs when the phase raises, so no hook state
        outlives a failed step (an error in end itself then must not hide the original)."""
        begin(num_reqs)
        try:
            yield
        except BaseException:
            try:
                end(num_reqs)
            except Exception:
                logger.exception("speculator hook %s failed while unwinding", end.__name__)
            raise
        end(num_reqs)

    # ---- model-specific pieces ----------------------------------------------------------------
    def _compute_logits(self, hidden: torch.Tensor, draft_step: int) -> torch.Tensor:
        return self.draft.compute_logits(hidden, spec_step_idx=draft_step)

    def _prefill_hidden(
        self, last_hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor] | None
    ) -> torch.Tensor:
        """Hidden states the prefill pass reads: the target's last hidden states, or (EAGLE3)
        the draft's combination of the target's aux hidden states."""
        if self.combiner is not None and aux_hidden_states:
            return self.combiner.combine_hidden_states(torch.cat(aux_hidden_states, dim=-1))
        return last_hidden_states

    def _num_aux_hidden_states(self) -> int:
        bound = self.draft.bound_shares
        return len(bound.aux_hidden_state_layers) if self.combiner and bound else 0

    def _run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        attn_metadata: AttentionMetadata,
        draft_step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden for the logits, hidden fed back to the next draft step)."""
        with set_forward_context(attn_metadata):
            return self.draft(
                input_ids=input_ids,
                positions=positions,
                hidden_states=hidden_states.to(self.dtype),
                spec_step_idx=draft_step,
            )

    # ---- the draft loop shared by capture() and propose() ------------------------------------
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

    def _draft(self, db: DraftBatch, hidden_states: torch.Tensor) -> np.ndarray:
        """Run every draft step; returns drafts [num_reqs, K]. hidden_states covers the padded
        target layout (the step-0 forward runs on all of it); the hooks see the real
        num_reqs."""
        K = self.num_speculative_steps
        nc = self.num_chained_layers
        R = db.num_reqs
        dev = self.device
        lti = torch.from_numpy(db.last_token_indices).to(dev)
        self.last_token_indices[:R] = lti
        # The last row's input is the token at last + 1, so draft step s proposes the token at
        # last + 2 + s: the position the verifier keys its sample of that token by.
        draft_pos = db.last + 2
        drafts = self.draft_tokens[:R]
        prev = _Rows.span(db.start, db.num_scheduled)
        # Positions whose KV is final after this step, per chained layer: rows reading known
        # tokens only (layer s at t reads t + s + 1).
        rows_by_step = [prev] + [self._step_rows(db, s) for s in range(1, K)]
        final_after = np.stack(
            [
                np.maximum(rows_by_step[s].lo, np.minimum(db.last + 1, db.num_known - 1 - s))
                for s in range(nc)
            ]
        )
        with self._hooked(self.on_prefill_begin, self.on_prefill_end, R):
            logits_h, feedback = self._run_model(
                torch.from_numpy(db.input_ids).to(dev),
                torch.from_numpy(db.positions).to(dev),
                hidden_states,
                db.attn_metadata,
                0,
            )
            logits = self._compute_logits(logits_h[lti], 0)
            tok = self.sample_draft(logits, draft_pos, db.sampling)
            drafts[:, 0] = tok.cpu().numpy()
            if K > 1:
                src, found = prev.find(rows_by_step[1].req, rows_by_step[1].t)
                self._set_topk_src_rows(prev, rows_by_step[1], src, found)
        if K == 1:
            self.kv_final_len[:, db.slots] = final_after
            return drafts.copy()
        with self._hooked(self.on_multi_step_decode_begin, self.on_multi_step_decode_end, R):
            for step in range(1, K):
                rows = rows_by_step[step]
                src, found = prev.find(rows.req, rows.t)
                if step > 1 and not (found.all() and np.array_equal(src, np.arange(len(src)))):
                    self._set_topk_src_rows(prev, rows, src, found)
                    self.on_draft_rows_changed(R)
                hidden = self._gather_hidden(db, step, feedback, src, found, rows)
                if step <= nc - 1:
                    self._update_carry(db, step - 1, prev, feedback, final_after)
                meta, positions = self._rows_metadata(db, rows, step)
                logits_h, feedback = self._run_model(
                    torch.from_numpy(self._step_tokens(db, rows, step, drafts)).to(dev),
                    torch.from_numpy(positions).to(dev),
                    hidden,
                    meta,
                    step,
                )
                last_rows = torch.from_numpy(rows.qsl[1:] - 1).to(dev)
                logits = self._compute_logits(logits_h[last_rows], step)
                tok = self.sample_draft(logits, draft_pos + step, db.sampling)
                drafts[:, step] = tok.cpu().numpy()
                prev = rows
        self.kv_final_len[:, db.slots] = final_after
        return drafts.copy()

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
        carry = self._ensure_carry(feedback)[step - 1][torch.from_numpy(db.slots).to(self.device)]
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
        offset = lap * nl
        end = np.minimum(db.last + offset, self.max_model_len - 1)
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

    def capture(self) -> None:
        """Warm-up at max_num_reqs with a dummy batch of K + 1 tokens per request (the shape of a
        verify step), writing only into KV block 0 before any request exists."""
        R = self.max_num_reqs
        q = max(1, min(self.num_speculative_steps + 1, self.max_num_tokens // R))
        T = R * q
        qsl = np.arange(R + 1, dtype=np.int64) * q
        positions = np.tile(np.arange(q, dtype=np.int64), R)
        block_table = np.zeros(
            (R, 1 + (q + self.num_speculative_steps) // self.block_size), dtype=np.int64
        )
        meta = build_attn_metadata(
            qsl,
            np.full(R, q),
            block_table,
            self.block_size,
            self.device,
            positions=positions,
            short_query_len=q,
        )
        h = torch.zeros(T, self.target_hidden_size, dtype=self.dtype, device=self.device)
        n_aux = self._num_aux_hidden_states()
        ids = np.zeros(T, dtype=np.int64)
        db = DraftBatch(
            slots=np.arange(R, dtype=np.int64),
            new_req=np.ones(R, dtype=bool),
            start=np.zeros(R, dtype=np.int64),
            last=np.full(R, q - 1, dtype=np.int64),
            last_token_indices=qsl[1:] - 1,
            query_start_loc=qsl,
            num_scheduled=np.full(R, q, dtype=np.int64),
            target_ids=ids,
            input_ids=ids,
            positions=positions,
            next_tokens=np.zeros((R, self.num_lookahead_tokens), dtype=np.int64),
            num_known=np.full(R, q + 1, dtype=np.int64),
            block_table=block_table,
            attn_metadata=meta,
            sampling=SamplingArrays.greedy(R),
        )
        with torch.inference_mode():
            hidden = self.stage_hidden_states(self._prefill_hidden(h, [h] * n_aux or None))
            self.last_token_indices.zero_()
            self._draft(db, hidden)

    def propose(self, inputs: ProposeInputs) -> np.ndarray:
        b = inputs.input_batch
        num_tokens = b.num_tokens
        num_tokens_padded = b.num_tokens_after_padding
        last_idx = inputs.last_valid_indices()
        last_pos = b.positions_np[last_idx]
        # The tokens after that row: the one just sampled, or (non-final prefill chunk) the
        # next prompt tokens.
        next_tokens = inputs.next_tokens(self.num_lookahead_tokens)
        input_ids = np.zeros(num_tokens_padded, dtype=np.int64)
        input_ids[: num_tokens - 1] = b.input_ids_np[1:num_tokens]
        input_ids[last_idx] = next_tokens[:, 0]
        positions = np.zeros(num_tokens_padded, dtype=np.int64)
        positions[:num_tokens] = b.positions_np
        hidden = self.stage_hidden_states(
            self._prefill_hidden(inputs.last_hidden_states, inputs.aux_hidden_states)
        )
        if hidden.shape[0] != num_tokens_padded:
            raise RuntimeError(
                f"the target's hidden states have {hidden.shape[0]} rows but the batch has "
                f"{num_tokens_padded} (padded) tokens"
            )
        db = DraftBatch(
            slots=b.idx_mapping_np,
            new_req=inputs.new_req_mask,
            start=b.num_computed_tokens_np,
            last=last_pos,
            last_token_indices=last_idx,
            query_start_loc=b.query_start_loc_np,
            num_scheduled=b.num_scheduled_tokens,
            target_ids=b.input_ids_np,
            input_ids=input_ids,
            positions=positions,
            next_tokens=next_tokens,
            num_known=np.where(inputs.has_sample, last_pos + 2, b.prefill_len_np),
            block_table=b.block_table_np,
            attn_metadata=b.attn_metadata,
            sampling=inputs.sampling,
        )
        return self._draft(db, hidden)
