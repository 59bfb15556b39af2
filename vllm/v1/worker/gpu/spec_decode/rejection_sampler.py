# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Verifying draft tokens against the target (lossless speculative sampling).

A request with d drafts has d + 1 logits rows: row j is the target's distribution p_j for the
position of draft j, the last row the one after all drafts. The sampler has already drawn the
target's own token y_j of every row, keyed by (request seed, position): exactly the token
sampling without speculation would draw there (argmax for greedy requests). The verifier keeps
the longest prefix of drafts equal to those tokens and emits y_0 .. y_a (the accepted drafts, then
the target's token at the first mismatch, or the bonus token after d acceptances).

This is lossless for any drafter: every emitted token is the target's keyed sample given the
emitted prefix, so a seeded request's text depends on nothing but its seed and the target -
not on the batch, chunking, preemption, P, or which drafts happened to be proposed (where the
classic accept-with-min(1, p/q) test plus residual resample would make the text depend on the
drafts, hence on how they were aligned). Acceptance: a greedy draft x is accepted with
probability p(x), as in the classic test; a probabilistic draft is drawn with the same keyed
noise as the target (Gumbel-max over q instead of p), so it matches y_j with probability
sum_i 1 / sum_k max(p_k / p_i, q_k / q_i), equal to 1 when q = p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.input_batch import InputBatch


def rejection_sample_tokens(
    target_tokens: np.ndarray,
    cu_num_logits: np.ndarray,
    draft_token_ids: np.ndarray,
    width: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per request: (sampled [R, width] int64, padded with PAD_TOKEN_ID;
    num_sampled [R]: 1 to d + 1 each, 0 for a request without logits rows).

    target_tokens [N]: the target's keyed sample of every logits row. cu_num_logits [R + 1]:
    request r owns rows cu[r] .. cu[r+1] - 1. draft_token_ids [N]: the draft each row verifies
    (a request's last row verifies none; its value is ignored). width: at least the most rows
    of any request (default: exactly that).
    """
    tokens = np.asarray(target_tokens, dtype=np.int64)
    drafts = np.asarray(draft_token_ids, dtype=np.int64)
    cu = np.asarray(cu_num_logits, dtype=np.int64)
    R = len(cu) - 1
    n_rows = np.diff(cu)
    d = np.maximum(n_rows - 1, 0)
    row_req = np.repeat(np.arange(R), n_rows)
    j = np.arange(len(tokens)) - cu[:-1][row_req]  # index of each row within its request
    mismatch = (j < d[row_req]) & (drafts != tokens)
    first_bad = np.where(mismatch, j, np.iinfo(np.int64).max)
    accepted = np.zeros(R, dtype=np.int64)
    nonempty = n_rows > 0
    if nonempty.any():
        accepted[nonempty] = np.minimum.reduceat(first_bad, cu[:-1][nonempty])
    num_sampled = np.where(nonempty, np.minimum(accepted, d) + 1, 0)
    W = int(n_rows.max(initial=0)) if width is None else width
    cols = np.arange(W)
    keep = cols < num_sampled[:, None]
    src = np.minimum(cu[:-1, None] + cols, max(len(tokens) - 1, 0))
    picked = tokens[src] if len(tokens) else np.zeros(src.shape, dtype=np.int64)
    sampled = np.where(keep, picked, PAD_TOKEN_ID)
    return sampled, num_sampled


class RejectionSampler:
    """Verifies one step's drafts against the target's sampled tokens (module docstring).
    Built once by the model runner of the last stage; without drafts it degenerates to one
    token per request that has a logits row."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.max_sample_len = num_speculative_tokens + 1

    def __call__(
        self, input_batch: InputBatch, target_tokens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(sampled [R, K + 1], num_sampled [R]) for the batch; target_tokens [N] are the
        sampler's tokens for its logits rows (per request: its last known token, then each of
        its drafts)."""
        b = input_batch
        # The draft verified by a row is the input token of the request's next logits row.
        inputs = b.input_ids_np[b.logits_indices_np]
        drafts = np.full(len(inputs), -1, dtype=np.int64)
        drafts[:-1] = inputs[1:]
        return rejection_sample_tokens(
            target_tokens, b.cu_num_logits_np, drafts, self.max_sample_len
        )

    def layout(self, input_batch: InputBatch) -> InputBatch:
        """The batch as the target runs it (draft trees change positions and the mask)."""
        return input_batch

    def draft_view(self, input_batch: InputBatch, hidden, aux, logits):
        """(batch, hidden, aux hidden, logits) as the draft and the logprobs read them after
        the last __call__ (draft trees reorder the accepted path into a chain)."""
        return input_batch, hidden, aux, logits
