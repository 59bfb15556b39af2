# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""AutoRegressiveSpeculator: a draft model that proposes K tokens one after another.

One "prefill" pass runs the draft over the target's scheduled tokens of this step (same layout,
attention metadata and KV slots as the target; inputs shifted left by one so each position sees
the token after it), which also fills the draft's KV cache for every position the target
computed. Each request's first draft comes from its last accepted row; K - 1 single-token decode
passes then feed the draft its own token and hidden state back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backends.torch_paged import AttentionMetadata, build_attn_metadata
from vllm.v1.worker.gpu.sample.sampler import SamplingArrays
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.input_batch import InputBatch

logger = init_logger(__name__)


class AutoRegressiveSpeculator(DraftModelSpeculator):
    # Whether positions and sequence lengths advance between draft steps (False for drafts that
    # only query the target's KV).
    advance_draft_positions = True

    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        # Index (into the flattened prefill pass) of each request's last accepted row.
        self.last_token_indices = torch.zeros(self.max_num_reqs, dtype=torch.int64, device=device)
        self.current_draft_step = 0

    # ---- lifecycle hooks (no-ops here; MTP top-k sharing uses them) ------------------------
    def on_prefill_begin(self, num_reqs: int) -> None:
        pass

    def on_prefill_end(self, num_reqs: int) -> None:
        pass

    def on_multi_step_decode_begin(self, num_reqs: int) -> None:
        pass

    def on_multi_step_decode_end(self, num_reqs: int) -> None:
        pass

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
            except Exception:  # noqa: BLE001 - the phase's own error is the one to report
                logger.exception("speculator hook %s failed while unwinding", end.__name__)
            raise
        end(num_reqs)

    # ---- model-specific pieces (overridden by MTP) -------------------------------------------
    def _forward_kwargs(self, draft_step: int) -> dict[str, Any]:
        return {}

    def _compute_logits(self, hidden: torch.Tensor, draft_step: int) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def _prefill_hidden(
        self, last_hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor] | None
    ) -> torch.Tensor:
        """Hidden states the prefill pass reads: the target's last hidden states, or (EAGLE3)
        the draft's combination of the target's aux hidden states."""
        if aux_hidden_states and hasattr(self.model, "combine_hidden_states"):
            return self.model.combine_hidden_states(torch.cat(aux_hidden_states, dim=-1))
        return last_hidden_states

    def _num_aux_hidden_states(self) -> int:
        return 0

    def _run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        attn_metadata: AttentionMetadata,
        draft_step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden for the logits, hidden fed back to the next draft step)."""
        self.current_draft_step = draft_step
        with set_forward_context(attn_metadata):
            out = self.model(
                input_ids=input_ids,
                positions=positions,
                hidden_states=hidden_states.to(self.dtype),
                **self._forward_kwargs(draft_step),
            )
        if isinstance(out, tuple):
            return out[0], out[1]
        return out, out

    # ---- the draft loop shared by capture() and propose() ------------------------------------
    def _draft(
        self,
        num_reqs: int,
        input_ids: np.ndarray,
        positions: np.ndarray,
        hidden_states: torch.Tensor,
        attn_metadata: AttentionMetadata,
        last_token_indices: np.ndarray,
        block_table: np.ndarray,
        sampling: SamplingArrays,
    ) -> np.ndarray:
        """Run the prefill pass and K - 1 decode passes; returns drafts [num_reqs, K].

        input_ids / positions cover num_tokens_padded rows (the forward runs on all of them);
        the hooks see the real num_reqs. sampling: the requests' parameters (probabilistic
        drafts draw with them)."""
        K = self.num_speculative_steps
        dev = self.device
        lti = torch.from_numpy(last_token_indices).to(dev)
        self.last_token_indices[:num_reqs] = lti
        pos = positions[last_token_indices].copy()
        # The last row's input is the token at pos + 1, so draft step s proposes the token at
        # pos + 2 + s: the position the verifier keys its sample of that token by.
        draft_pos = pos + 2
        drafts = self.draft_tokens[:num_reqs]
        with self._hooked(self.on_prefill_begin, self.on_prefill_end, num_reqs):
            logits_h, feedback = self._run_model(
                torch.from_numpy(input_ids).to(dev),
                torch.from_numpy(positions).to(dev),
                hidden_states,
                attn_metadata,
                0,
            )
            logits = self._compute_logits(logits_h[lti], 0)
            tok = self.sample_draft(logits, draft_pos, sampling)
            hidden = feedback[lti]
        drafts[:, 0] = tok.cpu().numpy()
        if K == 1:
            return drafts.copy()
        qsl = np.arange(num_reqs + 1, dtype=np.int64)
        with self._hooked(self.on_multi_step_decode_begin, self.on_multi_step_decode_end, num_reqs):
            for step in range(1, K):
                if self.advance_draft_positions:
                    pos = np.minimum(pos + 1, self.max_model_len - 1)
                meta = build_attn_metadata(
                    qsl,
                    pos + 1,
                    block_table,
                    self.block_size,
                    dev,
                    positions=pos,
                    short_query_len=1,
                )
                logits_h, hidden = self._run_model(
                    tok, torch.from_numpy(pos).to(dev), hidden, meta, step
                )
                logits = self._compute_logits(logits_h, step)
                tok = self.sample_draft(logits, draft_pos + step, sampling)
                drafts[:, step] = tok.cpu().numpy()
        return drafts.copy()

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
        with torch.inference_mode():
            hidden = self.stage_hidden_states(self._prefill_hidden(h, [h] * n_aux or None))
            self.last_token_indices.zero_()
            self._draft(
                R,
                np.zeros(T, dtype=np.int64),
                positions,
                hidden,
                meta,
                qsl[1:] - 1,
                block_table,
                SamplingArrays.greedy(R),
            )

    def propose(
        self,
        runner: Any,
        input_batch: InputBatch,
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        sampled_token_ids: list[list[int]],
        num_sampled: np.ndarray,
        num_rejected: np.ndarray,
    ) -> list[list[int]]:
        b = input_batch
        st = runner.states
        R = b.num_reqs
        num_tokens = b.num_tokens
        num_tokens_padded = b.num_tokens_after_padding
        slots = b.idx_mapping_np
        num_rejected = np.asarray(num_rejected, dtype=np.int64)
        # Each request's last row that is still valid after rejection.
        last_idx = b.query_start_loc_np[:-1] + b.num_scheduled_tokens - num_rejected - 1
        last_pos = b.positions_np[last_idx]
        # The token after that row: the one just sampled, or (non-final prefill chunk) the
        # next prompt token.
        next_tokens = np.array(
            [
                toks[-1] if toks else int(st.token_ids[s, p + 1])
                for toks, s, p in zip(sampled_token_ids, slots.tolist(), last_pos.tolist())
            ],
            dtype=np.int64,
        )
        input_ids = np.zeros(num_tokens_padded, dtype=np.int64)
        input_ids[: num_tokens - 1] = b.input_ids_np[1:num_tokens]
        input_ids[last_idx] = next_tokens
        positions = np.zeros(num_tokens_padded, dtype=np.int64)
        positions[:num_tokens] = b.positions_np
        hidden = self.stage_hidden_states(
            self._prefill_hidden(last_hidden_states, aux_hidden_states)
        )
        if hidden.shape[0] != num_tokens_padded:
            raise RuntimeError(
                f"the target's hidden states have {hidden.shape[0]} rows but the batch has "
                f"{num_tokens_padded} (padded) tokens"
            )
        drafts = self._draft(
            R,
            input_ids,
            positions,
            hidden,
            b.attn_metadata,
            last_idx,
            st.block_table[slots],
            SamplingArrays.of(st, slots),
        )
        K = self.num_speculative_steps
        st.draft_tokens[slots, :K] = drafts
        return drafts.tolist()
