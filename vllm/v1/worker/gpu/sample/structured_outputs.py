# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Grammar state of the requests with structured outputs, on the stage that samples.

Every logits row of such a request gets the grammar's bitmask for its position: row 0 from the
matcher's state, row j after the matcher also accepted the drafts of rows 0 .. j - 1 (they are
rolled back once the masks are built). A draft the grammar forbids cannot equal the target's
masked sample at its row, so the verifier rejects it and the rows after it are never emitted
(their masks are left open). Once the step's tokens are known the matcher accepts them.

With a reasoning parser the grammar starts after the reasoning (vLLM's enable_in_reasoning
False): a request's rows are left open while its history (outputs, plus the drafts before the
row) is inside the reasoning, and the first row after the end marker is masked by the grammar's
start state; the end marker itself never reaches the matcher. A draft step that crosses the end
marker is masked exactly as the same tokens one step at a time would be, so speculation stays
lossless."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.v1.structured_output import XgrammarBackend, get_backend

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams


class StructuredOutputStates:
    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._backend: XgrammarBackend | None = None
        self.matchers: dict[int, Any] = {}  # request-state slot -> GrammarMatcher
        # Slots still inside their reasoning -> the end marker's token id (see the gate).
        self.reasoning: dict[int, int] = {}

    @property
    def backend(self) -> XgrammarBackend:
        if self._backend is None:
            self._backend = get_backend(self.tokenizer_path, self.vocab_size)
        return self._backend

    def add(self, slot: int, params: SamplingParams, output_token_ids: list[int]) -> None:
        """A request entering the batch; a resumed one replays the outputs it already has."""
        self.remove(slot)
        so = params.structured_outputs
        if so is None:
            return
        m = self.backend.new_matcher(so)
        self.matchers[slot] = m
        gate = so._reasoning_gate
        if gate is not None and not gate[2]:
            self.reasoning[slot] = gate[1]
        self._advance(slot, [int(t) for t in output_token_ids])

    def remove(self, slot: int) -> None:
        self.matchers.pop(slot, None)
        self.reasoning.pop(slot, None)

    def _advance(self, slot: int, tokens: list[int]) -> None:
        """The request emitted tokens: the end marker ends its reasoning, the tokens after it
        advance the grammar."""
        m = self.matchers[slot]
        for t in tokens:
            end = self.reasoning.get(slot)
            if end is not None:
                if t == end:
                    del self.reasoning[slot]
                continue
            if m.is_terminated():
                break
            m.accept_token(t)

    def apply_bitmasks(
        self, logits: torch.Tensor, row_slots: np.ndarray, row_inputs: np.ndarray
    ) -> torch.Tensor:
        """logits [N, V] with each grammar row's disallowed tokens at -inf (in place)."""
        if not self.matchers or not len(row_slots):
            return logits
        import xgrammar as xgr

        N, V = logits.shape
        rows_of: dict[int, list[int]] = {}
        for i, s in enumerate(row_slots.tolist()):
            if s in self.matchers:
                rows_of.setdefault(s, []).append(i)
        if not rows_of:
            return logits
        bitmask = xgr.allocate_token_bitmask(N, V)  # all allowed
        masked: list[int] = []
        for s, rows in rows_of.items():
            m = self.matchers[s]
            end = self.reasoning.get(s)  # None: the grammar applies from row 0
            accepted = 0
            for j, row in enumerate(rows):
                if end is None:
                    if m.is_terminated():
                        break  # only a stop token was left; nothing to constrain
                    m.fill_next_token_bitmask(bitmask, row)
                    masked.append(row)
                if j + 1 == len(rows):
                    break
                draft = int(row_inputs[rows[j + 1]])
                if end is not None:
                    if draft == end:
                        end = None  # the rows after the end marker follow the grammar
                    continue
                if not m.accept_token(draft):
                    break  # a forbidden draft: the rows after it are not emitted
                accepted += 1
            if accepted:
                m.rollback(accepted)
        if masked:
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device), vocab_size=V, indices=masked
            )
        return logits

    def accept(self, slots: np.ndarray, sampled: np.ndarray, num_sampled: np.ndarray) -> None:
        """Advance each grammar request's matcher over the tokens the step emitted."""
        if not self.matchers:
            return
        for i, s in enumerate(slots.tolist()):
            if s in self.matchers:
                self._advance(s, [int(t) for t in sampled[i, : int(num_sampled[i])].tolist()])
