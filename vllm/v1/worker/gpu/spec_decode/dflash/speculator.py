# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DFlashSpeculator: one block-parallel draft forward proposes all K tokens (DFlash, DSpark).

Each step, the target's aux hidden states of every scheduled position become the draft's
context keys / values (written into the draft's paged KV cache at the target's slots; positions
that end up rejected are rewritten by the next step before any block reads them). Then each
request drafts one block at its anchor - the token just sampled, at position a = last accepted
position + 1 - attending to its context 0 .. a-1 and to the block itself. DSpark's sequential
Markov head then turns the block's logits into tokens slot by slot, each slot biased by the
token drafted before it; its confidence head's estimates are accumulated and logged.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.config.draft import block_query_len, sample_from_anchor
from vllm.forward_context import ForwardContext
from vllm.logger import init_logger
from vllm.model_executor.models.dflash import (
    BlockAttentionMetadata,
    DFlashDraftModel,
    DSparkDraftModel,
)
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.interfaces import TargetShares
from vllm.v1.worker.gpu.sample.sampler import SamplingArrays
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator, ProposeInputs
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

logger = init_logger(__name__)

# Proposals between two log lines of the confidence head's per-position estimates.
CONFIDENCE_LOG_INTERVAL = 500


class DFlashSpeculator(DraftModelSpeculator):
    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        super().__init__(vllm_config, device)
        cfg = self.draft_model_config.hf_text_config
        K = self.num_speculative_steps
        self.query_len = block_query_len(cfg, K)
        # Block slot of draft 0: the anchor's own slot drafts only with sample_from_anchor.
        self.first_draft_slot = 0 if sample_from_anchor(cfg) else 1
        # DSpark confidence head: sum of its acceptance estimates per draft position, and
        # the number of drafted blocks they cover.
        self.confidence_sum = np.zeros(K, dtype=np.float64)
        self.confidence_blocks = 0
        self._blocks_since_log = 0
        # The last block's anchor positions, and per draft position its logits over the
        # draft vocabulary (DSpark: with the Markov bias) and confidence estimates.
        self.last_anchor_pos = np.zeros(0, dtype=np.int64)
        self.last_logits: list[torch.Tensor] = []
        self.last_confidence: list[torch.Tensor] = []

    def on_draft_bound(self, draft: DraftModel, shares: TargetShares) -> None:
        if not isinstance(draft, DFlashDraftModel):
            raise TypeError(f"{self.method} needs a DFlash draft, got {type(draft).__name__}")
        if not shares.aux_hidden_state_layers:
            raise RuntimeError(
                f"{self.method} drafts from the target's aux hidden states, but the target taps "
                "none (its taps were not configured)"
            )

    @property
    def sequential(self) -> bool:
        """Whether drafting runs slot by slot (DSpark's heads read the previous token)."""
        m = self._dflash
        return m is not None and (m.markov_head is not None or m.confidence_head is not None)

    def confidence_stats(self) -> np.ndarray | None:
        """Mean acceptance estimate of the confidence head per draft position (None without
        a confidence head or before any block)."""
        if self.confidence_blocks == 0:
            return None
        return self.confidence_sum / self.confidence_blocks

    @property
    def _dflash(self) -> DFlashDraftModel:
        # on_draft_bound refuses any other draft.
        return cast(DFlashDraftModel, self.model)

    # ---- drafting ---------------------------------------------------------------------------
    def _sample(
        self, draft_logits: torch.Tensor, positions: np.ndarray, sampling: SamplingArrays
    ) -> torch.Tensor:
        """Tokens (target ids) from draft-vocabulary logits [R, Vd]."""
        m = self._dflash
        if self.draft_sample_method != "probabilistic":
            tok = draft_logits.argmax(-1)
            return self.agree(tok if m.draft_to_target is None else m.draft_to_target[tok])
        return self.agree(self.sample_draft(m.scatter_to_target(draft_logits), positions, sampling))

    def _draft_block(
        self,
        anchor_tokens: np.ndarray,
        anchor_pos: np.ndarray,
        block_table: np.ndarray,
        sampling: SamplingArrays,
    ) -> np.ndarray:
        """Drafts [R, K] of one block per request (anchor token at anchor_pos, the context
        before it in the draft's cache)."""
        m = self._dflash
        assert m is not None
        R, Q, K = len(anchor_tokens), self.query_len, self.num_speculative_steps
        dev = self.device
        ids = np.full((R, Q), m.mask_token_id, dtype=np.int64)
        ids[:, 0] = anchor_tokens
        # Slots past the model length only draft tokens the scheduler drops.
        pos = np.minimum(anchor_pos[:, None] + np.arange(Q), self.max_model_len - 1)
        meta = BlockAttentionMetadata.build(anchor_pos, block_table, self.block_size, Q, dev)
        hidden = m(
            torch.from_numpy(ids.reshape(-1)).to(dev),
            torch.from_numpy(pos.reshape(-1)).to(dev),
            ctx=ForwardContext(meta),
        ).view(R, Q, -1)
        # Draft k is the token at anchor + 1 + k (the position the verifier keys it by).
        draft_pos = anchor_pos + 1
        first = self.first_draft_slot
        drafts = self.draft_tokens[:R]
        self.last_anchor_pos = anchor_pos
        self.last_logits, self.last_confidence = [], []
        # The backbone's logits of every drafted slot in one projection.
        # Prefill-kind rows (BLAS), as the block's own forward (its metadata has no layout).
        base = m.compute_draft_logits(hidden[:, first : first + K].reshape(R * K, -1), None)
        base = base.view(R, K, -1)
        if not self.sequential:
            toks = []
            for k in range(K):
                self.last_logits.append(base[:, k])
                toks.append(self._sample(base[:, k], draft_pos + k, sampling))
            drafts[:] = torch.stack(toks, dim=1).cpu().numpy()
            return drafts.copy()
        # Sequential drafting runs only for DSpark heads (their Markov / confidence heads).
        ds = cast(DSparkDraftModel, m)
        prev = torch.from_numpy(np.asarray(anchor_tokens, dtype=np.int64)).to(dev)
        state = None
        toks, confs = [], []
        for s in range(first + K):
            k = s - first
            if k < 0:
                # The anchor's slot drafts nothing but feeds the rnn head's state.
                if ds.markov_head is not None and ds.markov_head.head_type == "rnn":
                    _, _, state = ds.markov_step(prev, hidden[:, s], state)
                continue
            bias, conf, state = ds.markov_step(prev, hidden[:, s], state)
            logits = base[:, k] if bias is None else base[:, k] + bias.float()
            prev = self._sample(logits, draft_pos + k, sampling)
            toks.append(prev)
            self.last_logits.append(logits)
            if conf is not None:
                confs.append(conf)
        drafts[:] = torch.stack(toks, dim=1).cpu().numpy()
        if confs:
            self.last_confidence = confs
            self._note_confidence(torch.stack(confs, dim=1).double().sum(0).cpu().numpy(), R)
        return drafts.copy()

    def _note_confidence(self, conf_sum: np.ndarray, num_blocks: int) -> None:
        self.confidence_sum += conf_sum
        self.confidence_blocks += num_blocks
        self._blocks_since_log += 1
        if self._blocks_since_log >= CONFIDENCE_LOG_INTERVAL:
            self._blocks_since_log = 0
            logger.info(
                "DSpark confidence head: mean predicted acceptance per draft position %s",
                np.round(self.confidence_sum / self.confidence_blocks, 3).tolist(),
            )

    # ---- the runner's interface -------------------------------------------------------------
    def capture(self) -> None:
        """Warm-up at max_num_reqs: one block per request reading KV block 0 only."""
        R = self.max_num_reqs
        saved = (self.confidence_sum.copy(), self.confidence_blocks, self._blocks_since_log)
        with torch.inference_mode():
            self._draft_block(
                np.zeros(R, dtype=np.int64),
                np.ones(R, dtype=np.int64),
                np.zeros((R, 1), dtype=np.int64),
                SamplingArrays.greedy(R),
            )
        self.confidence_sum, self.confidence_blocks, self._blocks_since_log = saved

    def propose(self, inputs: ProposeInputs) -> np.ndarray:
        assert self.model is not None
        aux = inputs.aux_hidden_states
        if not aux:
            raise RuntimeError(
                f"{self.method} drafts from the target's aux hidden states, but the target "
                "returned none (its taps were not configured)"
            )
        b = inputs.input_batch
        T = b.num_tokens
        ctx = self._dflash.combine_hidden_states(torch.cat(aux, dim=-1)[:T], None)
        positions = torch.from_numpy(np.asarray(b.positions_np[:T], dtype=np.int64))
        self._dflash.write_context(positions.to(self.device), ctx, b.attn_metadata.slot_mapping[:T])
        if inputs.num_draft_steps == 0:
            # The scheduler verifies no drafts next step: the context is written (the draft's
            # only state), the block forward is skipped.
            return np.full((b.num_reqs, self.num_speculative_steps), PAD_TOKEN_ID, np.int64)
        # The anchor is the token after each request's last valid row: the one just sampled,
        # or (non-final prefill chunk) the next prompt token.
        last_idx = inputs.last_valid_indices()
        anchor_pos = b.positions_np[last_idx].astype(np.int64) + 1
        anchor = inputs.next_tokens(1)[:, 0]
        return self._draft_block(anchor, anchor_pos, b.block_table_np, inputs.sampling)
