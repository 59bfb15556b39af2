# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""AutoRegressiveSpeculator: a draft model that proposes K tokens one after another.

Step 0 runs the draft over the target's scheduled tokens of this step (same layout, attention
metadata and KV slots as the target; inputs shifted left by one so each position sees the token
after it), which also fills the draft's KV cache for every position the target computed. Each
request's first draft comes from its last accepted row. Steps 1 .. K-1 run one row per request:
the previous draft token at the next position, fed the draft's own hidden state. (MTP's chained
layers run other rows; see mtp/speculator.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.attention.backends.torch_paged import AttentionMetadata, build_attn_metadata
from vllm.config import VllmConfig
from vllm.forward_context import ALL_SHORT, ForwardContext, RowKinds
from vllm.logger import init_logger
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.interfaces import CombinesHiddenStates, TargetShares
from vllm.v1.core.sched.draft_confidence import uses_draft_confidence
from vllm.v1.worker.gpu.spec_decode.autoregressive.capture import capture_verify_shape
from vllm.v1.worker.gpu.spec_decode.autoregressive.confidence import DraftConfidenceRecorder
from vllm.v1.worker.gpu.spec_decode.autoregressive.deferral import (
    FirstPassDeferral,
    propose_deferring,
)
from vllm.v1.worker.gpu.spec_decode.autoregressive.draft_batch import DraftBatch
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator, ProposeInputs
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

if TYPE_CHECKING:
    from vllm.model_executor.models.base import CausalLMBase
    from vllm.v1.worker.gpu.sample.structured_outputs import DraftGrammar

logger = init_logger(__name__)


@dataclass
class StepInputs:
    """What one draft decode step (1 .. K-1) runs on, N rows."""

    input_ids: np.ndarray  # [N]
    positions: np.ndarray  # [N]
    hidden_states: torch.Tensor  # [N, H] what each row reads of the step before
    attn_metadata: AttentionMetadata
    draft_rows: np.ndarray  # [R] the row each request drafts its next token from


class AutoRegressiveSpeculator(DraftModelSpeculator):
    # The first pass may be put off while nobody drafts (deferral.py; drafts with one
    # attention layer only).
    defers_first_pass = False
    # Every draft step runs the network of step 0 (an MTP tree on several layers: the first).
    first_layer_only = False

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        super().__init__(vllm_config, device)
        # Index (into the flattened step-0 pass) of each request's last accepted row.
        self.last_token_indices = torch.zeros(self.max_num_reqs, dtype=torch.int64, device=device)
        # The draft's fc over the target's aux taps (EAGLE3), when it reads them.
        self.combiner: CombinesHiddenStates | None = None
        # First-pass rows that read an image's encoder outputs (the multimodal gather), so far.
        self.num_mm_rows_gathered = 0
        self.deferral: FirstPassDeferral | None = None
        self.confidence = (
            DraftConfidenceRecorder(self.max_num_reqs, self.num_speculative_steps)
            if uses_draft_confidence(self.speculative_config)
            else None
        )

    def on_draft_bound(self, draft: DraftModel, shares: TargetShares) -> None:
        if isinstance(draft, CombinesHiddenStates) and shares.aux_hidden_state_layers:
            self.combiner = draft

    def load_model(self, target_model: CausalLMBase) -> None:
        super().load_model(target_model)
        if self.defers_first_pass and self._one_attention_layer():
            width = self.target_hidden_size * max(1, self._num_aux_hidden_states())
            self.deferral = FirstPassDeferral.for_speculator(self, width)

    def _one_attention_layer(self) -> bool:
        """Whether the draft has one attention layer (its KV at a row: the row's alone)."""
        return len(self.draft_attn_layer_names) == 1

    def on_request_removed(self, slot: int, output_token_ids: np.ndarray) -> None:
        if self.deferral is not None:
            self.deferral.on_removed(slot)

    def after_requests_removed(self) -> None:
        if self.deferral is not None:
            self.deferral.flush_removed()

    # ---- lifecycle hooks (no-ops here; MTP top-k sharing uses them) ------------------------
    def on_prefill_begin(self, num_reqs: int) -> None:
        pass

    def on_prefill_end(self, num_reqs: int) -> None:
        pass

    def on_multi_step_decode_begin(self, num_reqs: int) -> None:
        pass

    def on_multi_step_decode_end(self, num_reqs: int) -> None:
        pass

    def tree_pass(self, root_rows: np.ndarray, nodes: int) -> AbstractContextManager[None]:
        """Around a tree's node pass of `nodes` rows per request (roots: root_rows before)."""
        return nullcontext()

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

    # ---- the draft model ----------------------------------------------------------------------
    def _compute_logits(self, hidden: torch.Tensor, draft_step: int) -> torch.Tensor:
        """The draft head over the rows being sampled: all decode rows (ALL_SHORT)."""
        step = 0 if self.first_layer_only else draft_step
        return self.draft.compute_logits(hidden, ALL_SHORT, spec_step_idx=step)

    def _prefill_hidden(
        self,
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        layout: ForwardContext,
    ) -> torch.Tensor:
        """Hidden states the prefill pass reads: the target's last hidden states, or (EAGLE3)
        the draft's combination of the target's aux hidden states, whose rows' kinds are
        layout.rows (derived only here, when there is a combination)."""
        if self.combiner is not None and aux_hidden_states:
            aux = torch.cat(aux_hidden_states, dim=-1)
            return self.combiner.combine_hidden_states(aux, layout.rows)
        return last_hidden_states

    def combine_kept(self, raw: torch.Tensor) -> torch.Tensor:
        """_prefill_hidden of decode rows kept by the deferral (raw: the aux taps side by
        side, or the last hidden states)."""
        if self.combiner is not None:
            return self.combiner.combine_hidden_states(raw, ALL_SHORT)
        return raw

    def _num_aux_hidden_states(self) -> int:
        bound = self.draft.bound_shares
        return len(bound.aux_hidden_state_layers) if self.combiner and bound else 0

    def run_step0(
        self, db: DraftBatch, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's first pass over every row the target computed (writes its KV there):
        (the hidden states the logits are read from, the ones fed back)."""
        dev = self.device
        ids0 = torch.from_numpy(db.input_ids).to(dev)
        embeds0 = None
        if db.mm_rows is not None and db.mm_embeds is not None and len(db.mm_rows):
            # The multimodal gather: placeholder inputs take the image's encoder outputs.
            embeds0 = self.draft.embed_input_ids(ids0, 0).clone()
            embeds0[torch.from_numpy(db.mm_rows).to(dev)] = db.mm_embeds.to(embeds0.dtype)
        return self._run_model(
            ids0,
            torch.from_numpy(db.positions).to(dev),
            hidden_states,
            db.attn_metadata,
            0,
            inputs_embeds=embeds0,
        )

    def _run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        attn_metadata: AttentionMetadata,
        draft_step: int,
        inputs_embeds: torch.Tensor | None = None,
        row_kinds: RowKinds | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden for the logits, hidden fed back to the next draft step); row_kinds: the
        rows' kinds whatever the layout (None: by the layout)."""
        ctx = ForwardContext(attn_metadata)
        return self.draft(
            input_ids=None if inputs_embeds is not None else input_ids,
            positions=positions,
            hidden_states=hidden_states.to(self.dtype),
            spec_step_idx=0 if self.first_layer_only else draft_step,
            inputs_embeds=inputs_embeds,
            ctx=ctx if row_kinds is None else ctx.with_rows(row_kinds),
        )

    # ---- the draft loop shared by capture() and propose() ------------------------------------
    def _begin_draft(self, db: DraftBatch) -> None:
        """Before the draft steps of one batch (subclasses plan their rows)."""

    def _end_draft(self, db: DraftBatch) -> None:
        """After every draft step of one batch succeeded."""

    def _decode_inputs(
        self,
        db: DraftBatch,
        step: int,
        feedback: torch.Tensor,
        drafts: np.ndarray,
        rows: np.ndarray,
        prev_rows: np.ndarray,
    ) -> StepInputs:
        """Draft step >= 1: one row for each request of `rows` (still drafting; a subset of
        prev_rows, the requests of the step before, whose outputs feedback holds), the
        previous draft token at the position after the previous step's, reading that step's
        output at the request's row."""
        n = len(rows)
        src = db.last_token_indices[rows] if step == 1 else np.searchsorted(prev_rows, rows)
        end = np.minimum(db.last[rows] + step, self.max_model_len - 1)
        meta = build_attn_metadata(
            np.arange(n + 1, dtype=np.int64),
            end + 1,
            db.block_table[rows],
            self.block_size,
            self.device,
            positions=end,
            short_query_len=self.num_speculative_steps + 1,
        )
        hidden = feedback[torch.from_numpy(np.asarray(src)).to(self.device)]
        return StepInputs(drafts[rows, step - 1], end, hidden, meta, np.arange(n))

    # A dynamic draft tree (num_tree_nodes): each row's node parents from the last propose.
    tree_parents: np.ndarray | None = None
    # Structured-output rows' grammar forks for the propose() in progress (None: none).
    draft_grammar: DraftGrammar | None = None
    # At most this many draft steps (a hybrid's draft model within wider drafts; None: K).
    max_draft_steps: int | None = None

    # Draft steps >= 1 run only the requests still drafting at that depth (MTP: its chained
    # layers run every request's rows, so every request drafts the batch's deepest count).
    drafts_row_subsets = True

    def _masked(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Draft logits (logits row i: batch row rows[i]) with what each grammar row forbids
        at -inf (draft vocabulary: through the head's draft -> target map)."""
        if self.draft_grammar is None:
            return logits
        vocab = getattr(self, "draft_vocab", None)
        d2t = vocab.draft_to_target if vocab is not None else None
        return self.draft_grammar.mask(logits, d2t, rows)

    def _sample_step(
        self,
        logits: torch.Tensor,
        step: int,
        rows: np.ndarray,
        draft_pos: np.ndarray,
        db: DraftBatch,
        drafts: np.ndarray,
    ) -> None:
        """Draft column `step` of `rows` from their logits (and their grammar forks advance)."""
        sampling = db.sampling if len(rows) == db.num_reqs else db.sampling.take(rows)
        masked = self._masked(logits, rows)
        tok = self.agree(self.sample_draft(masked, draft_pos[rows] + step, sampling))
        drafts[rows, step] = tok.cpu().numpy()
        if self.confidence is not None:
            self.confidence.record(masked, step, rows)
        if self.draft_grammar is not None:
            self.draft_grammar.advance(drafts[rows, step], rows)

    @property
    def min_draft_steps(self) -> int:
        """Draft steps every propose runs whatever the scheduler asks for (step 0 always runs:
        it writes the draft's KV at every position the target computed)."""
        return 1

    def _draft(
        self, db: DraftBatch, hidden_states: torch.Tensor, num_steps: int | np.ndarray | None = None
    ) -> np.ndarray:
        """Run the draft steps; returns drafts [num_reqs, K]. hidden_states covers the padded
        target layout (the step-0 forward runs on all of it); the hooks see the real
        num_reqs. num_steps: the drafts the scheduler will verify next step, per request or
        one count for all (None: K); a request's columns after them are PAD_TOKEN_ID, and the
        steps past a request's count skip it (drafts_row_subsets; else every request runs the
        batch's deepest), except the min_draft_steps that keep the draft's own state (its KV)
        complete."""
        K = self.num_speculative_steps
        R = db.num_reqs
        cap = K if self.max_draft_steps is None else min(K, self.max_draft_steps)
        ks = np.full(R, cap, np.int64) if num_steps is None else np.broadcast_to(num_steps, (R,))
        ks = np.clip(ks, 0, cap)
        want = int(ks.max()) if R else 0
        steps = max(want, self.min_draft_steps)
        verify = ks  # what each request reports (the rest of its row: PAD)
        if not self.drafts_row_subsets:
            ks = np.full(R, want, np.int64)
        dev = self.device
        lti = torch.from_numpy(db.last_token_indices).to(dev)
        self.last_token_indices[:R] = lti
        # The last row's input is the token at last + 1, so draft step s proposes the token at
        # last + 2 + s: the position the verifier keys its sample of that token by.
        draft_pos = db.last + 2
        drafts = self.draft_tokens[:R]
        # Step s runs the requests whose count reaches past it (every one while the
        # min_draft_steps run) and samples those that report its draft or whose next step
        # reads it.
        every = np.arange(R)
        mins, conf = self.min_draft_steps, self.confidence
        if conf is not None:
            conf.begin(R)

        def run(s: int) -> np.ndarray:  # ks may shrink as the drafts' confidence falls
            return every if s < mins else np.flatnonzero(ks > s)

        def sample(s: int) -> np.ndarray:
            return every[(ks > s) | (s + 1 < mins)]

        self._begin_draft(db)
        with self._hooked(self.on_prefill_begin, self.on_prefill_end, R):
            logits_h, feedback = self.run_step0(db, hidden_states)
            take, ran = sample(0), run(0)
            if len(take):
                at = lti[torch.from_numpy(take).to(dev)]
                self._sample_step(
                    self._compute_logits(logits_h[at], 0), 0, take, draft_pos, db, drafts
                )
        if steps > 1:
            with self._hooked(self.on_multi_step_decode_begin, self.on_multi_step_decode_end, R):
                for step in range(1, steps):
                    if conf is not None:
                        conf.stop_unconfident(ks, verify, step - 1, take, self.agree)
                    rows = run(step)
                    if not len(rows):
                        break
                    inp = self._decode_inputs(db, step, feedback, drafts, rows, ran)
                    ran = rows
                    logits_h, feedback = self._run_model(
                        torch.from_numpy(np.asarray(inp.input_ids)).to(dev),
                        torch.from_numpy(np.asarray(inp.positions)).to(dev),
                        inp.hidden_states,
                        inp.attn_metadata,
                        step,
                    )
                    take = sample(step)
                    if not len(take):
                        continue
                    # inp.draft_rows[i]: the output row of rows[i] (take is a subset of rows).
                    pick = inp.draft_rows[np.searchsorted(rows, take)]
                    pick_t = torch.from_numpy(np.asarray(pick)).to(dev)
                    logits = self._compute_logits(logits_h[pick_t], step)
                    self._sample_step(logits, step, take, draft_pos, db, drafts)
        self._end_draft(db)
        drafts[np.arange(K)[None, :] >= verify[:, None]] = PAD_TOKEN_ID
        return drafts.copy()

    def capture(self) -> None:
        """Warm-up at max_num_reqs with a dummy batch of K + 1 tokens per request (the shape of a
        verify step), writing only into KV block 0 before any request exists."""
        capture_verify_shape(self)

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
        if inputs.last_hidden_states.shape[0] != num_tokens_padded:
            raise RuntimeError(
                f"the target's hidden states have {inputs.last_hidden_states.shape[0]} rows but "
                f"the batch has {num_tokens_padded} (padded) tokens"
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
        if inputs.mm_embeds is not None:
            if not self.draft.gather_mm_embeds:
                raise RuntimeError(
                    "encoder outputs were passed to a draft whose binding does not gather them"
                )
            db.mm_rows, db.mm_embeds = inputs.mm_embeds
            self.num_mm_rows_gathered += len(db.mm_rows)
        # EAGLE3's fc over the target's rows: their kinds are the target step's layout.
        target_layout = ForwardContext.laid_out_as(b.attn_metadata)
        if self.confidence is not None:
            self.confidence.floor = inputs.draft_confidence_floor
        if self.deferral is not None:
            out = propose_deferring(self, inputs, db, target_layout)
            if out is not None:
                return out
        hidden = self.stage_hidden_states(
            self._prefill_hidden(inputs.last_hidden_states, inputs.aux_hidden_states, target_layout)
        )
        self.draft_grammar = inputs.draft_grammar
        steps = inputs.req_draft_steps
        try:
            return self._draft(db, hidden, inputs.num_draft_steps if steps is None else steps)
        finally:
            self.draft_grammar = None
