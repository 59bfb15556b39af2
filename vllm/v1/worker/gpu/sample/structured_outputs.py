# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Grammar state of the requests with structured outputs, on the stage that samples.

Every logits row of such a request gets the grammar's bitmask for its position: row 0 from the
matcher's state, row j after the matcher also accepted the drafts of rows 0 .. j - 1 (they are
rolled back once the masks are built). A draft the grammar forbids cannot equal the target's
masked sample at its row, so the verifier rejects it and the rows after it are never emitted
(their masks are left open). Once the step's tokens are known the matcher accepts them.

Drafting for such requests (speculative_config.grammar_aware_drafting, on by default):
- a draft model's choice at each draft position is masked by a fork of the request's matcher
  that has accepted the drafts before it (DraftGrammar), so it proposes what the grammar allows;
- every drafter's proposals are then checked against the grammar and cut at the first token it
  forbids (counted in num_forbidden_drafts), so no forbidden draft is ever verified;
- where the grammar forces the next tokens (a JSON key, a closing brace: jump-forward), those
  tokens are the drafts; the verify pass checks them like any other draft, so the model's KV is
  written for them and the output is the model's own;
- rows still inside their reasoning are not constrained while drafting.

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
from vllm.v1.worker.gpu.features import LogitRows, RunnerFeature

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.worker.gpu.states import RequestStates


def _unpack_bitmask(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N, len(ids)] bool: whether each token id of `ids` is allowed by an xgrammar bitmask
    [N, ceil(V / 32)] (bit t % 32 of word t // 32)."""
    words = bitmask[:, ids // 32]
    return ((words >> (ids % 32).to(words.dtype)) & 1).bool()


class DraftGrammar:
    """Forks of the batch rows' matchers (None: no grammar), advanced over the drafts as a
    draft model chooses them; the originals are never touched."""

    def __init__(self, matchers: list[Any | None], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.forks = [
            m.fork() if m is not None and not m.is_terminated() else None for m in matchers
        ]
        self.num_masked_rows = 0  # (draft position, request) pairs masked, for the tests

    def mask(
        self,
        logits: torch.Tensor,
        draft_to_target: torch.Tensor | None = None,
        rows: np.ndarray | None = None,
    ) -> torch.Tensor:
        """logits [N, V] (target vocabulary, or the draft's with draft_to_target) with what
        each grammar row's fork forbids at -inf (in place); logits row i is batch row rows[i]
        (None: every batch row, in order)."""
        import xgrammar as xgr

        batch_rows = range(len(self.forks)) if rows is None else rows.tolist()
        live = [(i, self.forks[b]) for i, b in enumerate(batch_rows) if self.forks[b] is not None]
        if not live:
            return logits
        idx = [i for i, _ in live]
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for i, f in live:
            f.fill_next_token_bitmask(bitmask, i)
        self.num_masked_rows += len(idx)
        if draft_to_target is None and logits.shape[-1] >= self.vocab_size:
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=idx
            )
            return logits
        ids = (
            draft_to_target.to(torch.int64).cpu()
            if draft_to_target is not None
            else torch.arange(logits.shape[-1])
        )
        r = torch.tensor(idx)
        allowed = _unpack_bitmask(bitmask[r], ids).to(logits.device)
        sub = logits[r.to(logits.device)]
        logits[r.to(logits.device)] = sub.masked_fill(~allowed, float("-inf"))
        return logits

    def advance(self, tokens: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Each grammar row's fork accepts its row's chosen draft (tokens[i] is batch row
        rows[i]'s; None: every row in order; a forbidden one - only a row whose every token
        was masked - ends that row's constraint)."""
        batch_rows = range(len(self.forks)) if rows is None else rows.tolist()
        for i, b in enumerate(batch_rows):
            f = self.forks[b]
            if f is not None and (not f.accept_token(int(tokens[i])) or f.is_terminated()):
                self.forks[b] = None


class StructuredOutputStates(RunnerFeature):
    """A runner feature (last stage): a matcher per request with a grammar, the bitmasks of
    its logits rows, its matcher advanced over the tokens each step emits."""

    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._backend: XgrammarBackend | None = None
        self.matchers: dict[int, Any] = {}  # request-state slot -> GrammarMatcher
        # Drafts cut because the grammar forbids them, and forced tokens proposed (tests,
        # benchmarks).
        self.num_forbidden_drafts = 0
        self.num_jump_forward_tokens = 0
        self.num_masked_draft_rows = 0  # draft positions a draft model chose under a mask
        # Slots still inside their reasoning -> the end marker's token id (see the gate).
        self.reasoning: dict[int, int] = {}

    @property
    def backend(self) -> XgrammarBackend:
        if self._backend is None:
            self._backend = get_backend(self.tokenizer_path, self.vocab_size)
        return self._backend

    # ---- runner hooks -----------------------------------------------------------------------
    def add_requests(
        self, new_reqs: list[NewRequestData], slots: list[int], states: RequestStates
    ) -> None:
        for d, s in zip(new_reqs, slots):
            self.add(s, d.sampling_params, d.prefill_token_ids[d.num_prompt_tokens :])

    def remove_request(self, req_id: str, slot: int | None) -> None:
        if slot is not None:
            self.remove(slot)

    def adjust_logits(self, logits: torch.Tensor, rows: LogitRows) -> torch.Tensor:
        return self.apply_bitmasks(logits, rows.slots, rows.inputs)

    def after_accept(self, slots: np.ndarray, sampled: np.ndarray, num_sampled: np.ndarray) -> None:
        self.accept(slots, sampled, num_sampled)

    # ---- state ------------------------------------------------------------------------------
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
                if m.is_terminated():
                    break  # a drafted stop token: nothing after it is emitted
            if accepted:
                m.rollback(accepted)
        if masked:
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device), vocab_size=V, indices=masked
            )
        return logits

    def draft_grammar(self, slots: np.ndarray) -> DraftGrammar | None:
        """Forks for the rows of a batch (request-state slots), or None without grammars."""
        rows = [self._draft_matcher(int(s)) for s in slots.tolist()]
        if not any(m is not None for m in rows):
            return None
        return DraftGrammar(rows, self.vocab_size)

    def _draft_matcher(self, slot: int) -> Any | None:
        """The matcher drafts of this slot follow (None: unconstrained - no grammar, or still
        inside the reasoning, where the grammar does not apply yet)."""
        if slot in self.reasoning:
            return None
        return self.matchers.get(slot)

    def constrain_drafts(
        self,
        drafts: np.ndarray,
        slots: np.ndarray,
        jump_forward: bool,
        proposers: list[str] | None = None,
    ) -> None:
        """Drafts [R, K] of the batch rows (request-state slots), in place, for the grammar
        rows: the grammar's forced tokens where it forces any (jump-forward: that row's
        proposers entry becomes "jump_forward"), else the drafts cut (PAD) at the first one
        the grammar forbids. The matchers must have accepted the step's sampled tokens
        already (the drafts follow them)."""
        from vllm.v1.metrics.stats import JUMP_FORWARD
        from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

        K = drafts.shape[1]
        for i, s in enumerate(slots.tolist()):
            m = self._draft_matcher(int(s))
            if m is None or m.is_terminated():
                continue
            if jump_forward:
                forced = m.find_jump_forward_tokens()
                if forced:
                    n = min(len(forced), K)
                    drafts[i, :n] = forced[:n]
                    drafts[i, n:] = PAD_TOKEN_ID
                    self.num_jump_forward_tokens += n
                    if proposers is not None:
                        proposers[i] = JUMP_FORWARD
                    continue
            f = m.fork()
            for j in range(K):
                t = int(drafts[i, j])
                if t == PAD_TOKEN_ID:
                    break
                if not f.accept_token(t):
                    self.num_forbidden_drafts += int((drafts[i, j:] != PAD_TOKEN_ID).sum())
                    drafts[i, j:] = PAD_TOKEN_ID
                    break
                if f.is_terminated():  # a stop token: nothing can follow it
                    drafts[i, j + 1 :] = PAD_TOKEN_ID
                    break

    def accept(self, slots: np.ndarray, sampled: np.ndarray, num_sampled: np.ndarray) -> None:
        """Advance each grammar request's matcher over the tokens the step emitted."""
        if not self.matchers:
            return
        for i, s in enumerate(slots.tolist()):
            if s in self.matchers:
                self._advance(s, [int(t) for t in sampled[i, : int(num_sampled[i])].tolist()])
