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

from typing import Any

import numpy as np
import torch


def rejection_sample_tokens(
    target_tokens: np.ndarray, cu_num_logits: np.ndarray, draft_token_ids: np.ndarray
) -> list[list[int]]:
    """Output tokens per request (1 to d + 1 each; none for a request without logits rows).

    target_tokens [N]: the target's keyed sample of every logits row. cu_num_logits [R + 1]:
    request r owns rows cu[r] .. cu[r+1] - 1. draft_token_ids [N]: the draft each row verifies
    (a request's last row verifies none; its value is ignored).
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
    accepted = np.minimum(accepted, d)
    tok_l, cu_l, a_l = tokens.tolist(), cu.tolist(), accepted.tolist()
    return [tok_l[cu_l[r] : cu_l[r] + a_l[r] + 1] if n_rows[r] else [] for r in range(R)]


class RejectionSampler:
    """Verifies one step's drafts against the target's sampled tokens (module docstring)."""

    def __init__(self, spec_config: Any = None, device: torch.device | str = "cpu") -> None:
        self.spec_config = spec_config
        self.device = torch.device(device)

    def __call__(
        self, input_batch: Any, target_tokens: torch.Tensor
    ) -> tuple[list[list[int]], np.ndarray]:
        """(output tokens per batch row, the logits rows they came from, for logprobs).

        target_tokens [N] are the sampler's tokens for the batch's logits rows."""
        b = input_batch
        cu = b.cu_num_logits_np
        # The draft verified by a row is the input token of the request's next logits row.
        inputs = b.input_ids_np[b.logits_indices_np]
        drafts = np.full(len(inputs), -1, dtype=np.int64)
        drafts[:-1] = inputs[1:]
        sampled = rejection_sample_tokens(target_tokens.cpu().numpy(), cu, drafts)
        keep = np.concatenate(
            [np.arange(cu[r], cu[r] + len(t)) for r, t in enumerate(sampled)] or [np.zeros(0)]
        ).astype(np.int64)
        return sampled, keep


def rejection_sample(
    runner: Any, input_batch: Any, target_tokens: torch.Tensor
) -> tuple[list[list[int]], np.ndarray]:
    """The model runner's entry point: verify this step's drafts (see RejectionSampler)."""
    spec = runner.speculator
    sampler = getattr(spec, "rejection_sampler", None)
    if sampler is None:
        sampler = RejectionSampler(runner.vllm_config.speculative_config, runner.device)
        if spec is not None:
            spec.rejection_sampler = sampler
    return sampler(input_batch, target_tokens)
