# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""NgramSpeculator: prompt-lookup drafts, no draft model and no KV of its own.

For each request, the longest n-gram (prompt_lookup_max down to prompt_lookup_min) at the end of
its known tokens (prompt and output) that occurred earlier in them; the drafts are the tokens
that followed its latest earlier occurrence. Where the continuation runs past the end of the
known tokens, the match is periodic (the suffix repeats the n-gram at the match), so it goes
on with the drafts themselves: a run like "a b a b" drafts "a b a b ..." for any K.

Matching is an incremental index per request slot: a dict from every n-gram (each n in
[min, max]) to the position after its latest occurrence, extended by the tokens appended since
the request's previous step. A step costs O(new tokens x (max - min + 1)) dict operations per
request, never O(context). A request without a match (or a row that sampled nothing: a non-final
prefill chunk) gets no drafts: its row is PAD_TOKEN_ID, and the runner reports it to the
scheduler as 0 drafts.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.v1.worker.gpu.spec_decode.speculator import DraftFreeSpeculator, ProposeInputs
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID


class NgramIndex:
    """One request's tokens and its n-gram -> continuation-start index."""

    __slots__ = ("lo", "hi", "tokens", "table", "indexed_end", "match_length")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], int] = {}
        # n-grams ending before this position are in the table (the one ending at the last
        # token is not: it has no continuation yet, and it is what the lookup searches for).
        self.indexed_end = 0
        self.match_length = 0

    def extend(self, new_tokens: list[int]) -> None:
        toks = self.tokens
        toks.extend(new_tokens)
        end = len(toks) - 1
        table, lo, hi = self.table, self.lo, self.hi
        for e in range(max(self.indexed_end, lo), end + 1):
            for n in range(lo, min(hi, e) + 1):
                table[tuple(toks[e - n : e])] = e
        self.indexed_end = max(self.indexed_end, end + 1)

    def propose(self, k: int) -> list[int] | None:
        """K drafts from the longest matching n-gram, or None without a match (the n-gram's
        length is left in self.match_length)."""
        toks, L = self.tokens, len(self.tokens)
        self.match_length = 0
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            start = self.table.get(tuple(toks[L - n :]))
            if start is None:
                continue
            self.match_length = n
            out: list[int] = []
            for i in range(k):
                j = start + i
                out.append(toks[j] if j < L else out[j - L])
            return out
        return None


class NgramSpeculator(DraftFreeSpeculator):
    """Prompt lookup (module docstring). Built on the last pipeline stage like every
    speculator; its drafts go through the same StepResult broadcast."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        super().__init__(vllm_config, device)
        spec = self.speculative_config
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        self.lo, self.hi = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.indices: list[NgramIndex | None] = [None] * self.max_num_reqs

    def propose(self, inputs: ProposeInputs) -> np.ndarray:
        R, K = inputs.input_batch.num_reqs, self.num_speculative_steps
        drafts = np.full((R, K), PAD_TOKEN_ID, dtype=np.int64)
        k_max = inputs.max_drafts(K)
        self.last_match_lengths = np.zeros(R, dtype=np.int64)
        for i, idx in inputs.follow_histories(
            self.indices,
            lambda: NgramIndex(self.lo, self.hi),
            lambda c: len(c.tokens),
            lambda c, tokens: c.extend(tokens.tolist()),
            k_max,
        ):
            got = idx.propose(k_max)
            if got is not None:
                drafts[i, :k_max] = got
                self.last_match_lengths[i] = idx.match_length
        return drafts


class JumpForwardSpeculator(DraftFreeSpeculator):
    """No drafter of its own (method "jump_forward"): every row proposes nothing here, and the
    model runner fills in, for structured-output requests, the tokens their grammar forces
    (StructuredOutputStates.constrain_drafts)."""

    def propose(self, inputs: ProposeInputs) -> np.ndarray:
        R = inputs.input_batch.num_reqs
        return np.full((R, self.num_speculative_steps), PAD_TOKEN_ID, dtype=np.int64)
