# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Verifying draft tokens against the target (lossless speculative sampling).

A request with d drafts has d + 1 logits rows: row j is the target's distribution p_j for the
position of draft j, the last row the one after all drafts. Greedy requests keep the longest
prefix of drafts equal to the target's argmax, then the target's token (correction or bonus).
Sampling requests accept draft j with probability min(1, p_j(x) / q_j(x)) (q_j: the draft's
distribution, one-hot for argmax drafts) and, at the first rejection, draw from the normalised
max(p_j - q_j, 0); after d acceptances the bonus token is the target's own sample of the last
row. Every draw is keyed by (request seed, position), like the sampler's, so a seeded request
reproduces whatever else is in the batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm.v1.worker.gpu.sample.sampler import (
    apply_temperature_and_filters,
    exponential_noise,
    uniform_noise,
)

ACCEPT_NOISE_STREAM = 1
RESAMPLE_NOISE_STREAM = 2


def rejection_sample_tokens(
    target_probs: torch.Tensor | None,
    target_tokens: np.ndarray,
    cu_num_logits: np.ndarray,
    draft_token_ids: np.ndarray,
    draft_probs: torch.Tensor | None,
    greedy: np.ndarray,
    seeds: np.ndarray,
    positions: np.ndarray,
) -> list[list[int]]:
    """Output tokens per request (1 to d + 1 each).

    target_probs [N, V]: p of every row (rows of greedy requests are not read; may be None when
    all requests are greedy). target_tokens [N]: the target's own sample (argmax when greedy)
    of every row. cu_num_logits [R + 1]: request r owns rows cu[r] .. cu[r+1] - 1.
    draft_token_ids [N]: the draft each row verifies (a request's last row: ignored).
    draft_probs [N, V] or None (drafts were argmax: q one-hot). greedy / seeds [R].
    positions [N]: position of the token each row predicts.
    """
    tokens = np.asarray(target_tokens, dtype=np.int64)
    drafts = np.asarray(draft_token_ids, dtype=np.int64)
    cu = np.asarray(cu_num_logits, dtype=np.int64)
    greedy = np.asarray(greedy, dtype=bool)
    R = len(cu) - 1
    n_rows = np.diff(cu)
    d = np.maximum(n_rows - 1, 0)
    row_req = np.repeat(np.arange(R), n_rows)
    j = np.arange(len(tokens)) - cu[:-1][row_req]  # index of each row within its request
    is_draft = j < d[row_req]
    ok = np.zeros(len(tokens), dtype=bool)
    g = is_draft & greedy[row_req]
    ok[g] = drafts[g] == tokens[g]
    s_rows = np.nonzero(is_draft & ~greedy[row_req])[0]
    if len(s_rows):
        dev = target_probs.device
        rt = torch.from_numpy(s_rows).to(dev)
        ids = torch.from_numpy(drafts[s_rows]).to(dev)
        p_x = target_probs[rt, ids]
        q_x = draft_probs[rt, ids] if draft_probs is not None else torch.ones_like(p_x)
        u = uniform_noise(seeds[row_req[s_rows]], positions[s_rows], dev, ACCEPT_NOISE_STREAM)
        ok[s_rows] = (u * q_x < p_x).cpu().numpy()
    # Accepted drafts = leading run of ok rows.
    first_bad = np.where(is_draft & ~ok, j, np.iinfo(np.int64).max)
    a = np.zeros(R, dtype=np.int64)
    nonempty = n_rows > 0
    if nonempty.any():
        a[nonempty] = np.minimum.reduceat(first_bad, cu[:-1][nonempty])
    a = np.minimum(a, d)
    final_row = cu[:-1] + a
    final = np.zeros(R, dtype=np.int64)
    final[nonempty] = tokens[final_row[nonempty]]
    rej = np.nonzero(nonempty & ~greedy & (a < d))[0]
    if len(rej):
        rows = final_row[rej]
        rt = torch.from_numpy(rows).to(target_probs.device)
        p = target_probs[rt]
        if draft_probs is not None:
            residual = (p - draft_probs[rt]).clamp_min(0)
        else:
            residual = p.clone()
            residual[torch.arange(len(rows)), torch.from_numpy(drafts[rows]).to(p.device)] = 0
        # p == q up to rounding: then any draw from p is exact.
        empty = residual.sum(-1) <= 0
        residual[empty] = p[empty]
        noise = exponential_noise(
            seeds[rej], positions[rows], p.shape[-1], p.device, RESAMPLE_NOISE_STREAM
        )
        final[rej] = (residual / noise).argmax(-1).cpu().numpy()
    drafts_l, final_l, a_l, cu_l = drafts.tolist(), final.tolist(), a.tolist(), cu.tolist()
    return [
        drafts_l[cu_l[r] : cu_l[r] + a_l[r]] + [final_l[r]] if n_rows[r] else [] for r in range(R)
    ]


class RejectionSampler:
    """Verifies one step's drafts with the target's logits (see the module docstring)."""

    def __init__(self, spec_config: Any = None, device: torch.device | str = "cpu") -> None:
        self.spec_config = spec_config
        self.device = torch.device(device)

    def __call__(
        self,
        states: Any,
        input_batch: Any,
        logits: torch.Tensor,
        target_tokens: torch.Tensor,
        positions: np.ndarray,
        draft_probs: torch.Tensor | None = None,
    ) -> tuple[list[list[int]], np.ndarray]:
        """(output tokens per batch row, the logits rows they came from, for logprobs).

        logits [N, V] are the raw target logits of the batch's logits rows; target_tokens [N]
        the sampler's tokens for them; positions [N] the position each row predicts;
        draft_probs [max_num_reqs, K, V] the drafter's q per request slot (None: argmax drafts).
        """
        b = input_batch
        cu = b.cu_num_logits_np
        R = b.num_reqs
        slots = b.idx_mapping_np
        row_req = np.repeat(np.arange(R), np.diff(cu))
        row_slots = slots[row_req]
        # The draft verified by a row is the input token of the request's next logits row.
        inputs = b.input_ids_np[b.logits_indices_np]
        drafts = np.full(len(inputs), -1, dtype=np.int64)
        drafts[:-1] = inputs[1:]
        drafts[cu[1:][cu[1:] > 0] - 1] = -1
        temperature = states.temperature[slots]
        greedy = temperature < 1e-5
        probs = q = None
        sampling_rows = np.nonzero(~greedy[row_req])[0]
        if len(sampling_rows):
            # p over the whole [N, V] layout (greedy rows left zero; they are never read).
            probs = torch.zeros_like(logits)
            rs = torch.from_numpy(sampling_rows).to(logits.device)
            rsl = row_slots[sampling_rows]
            probs[rs] = apply_temperature_and_filters(
                logits[rs],
                states.temperature[rsl],
                states.top_k[rsl],
                states.top_p[rsl],
                states.min_p[rsl],
            ).softmax(-1)
            if draft_probs is not None:
                # Row j of a request holds draft j's q (its last row has none).
                j = np.arange(len(inputs)) - cu[row_req]
                q = torch.zeros_like(logits)
                has_draft = sampling_rows[drafts[sampling_rows] >= 0]
                if len(has_draft):
                    q[torch.from_numpy(has_draft).to(logits.device)] = draft_probs[
                        torch.from_numpy(row_slots[has_draft]).to(draft_probs.device),
                        torch.from_numpy(j[has_draft]).to(draft_probs.device),
                    ].to(logits.device)
        sampled = rejection_sample_tokens(
            probs,
            target_tokens.cpu().numpy(),
            cu,
            drafts,
            q,
            greedy,
            states.seed[slots],
            positions,
        )
        keep = np.concatenate(
            [np.arange(cu[r], cu[r] + len(t)) for r, t in enumerate(sampled)] or [np.zeros(0)]
        ).astype(np.int64)
        return sampled, keep


def rejection_sample(
    runner: Any,
    input_batch: Any,
    logits: torch.Tensor,
    target_tokens: torch.Tensor,
    rows: np.ndarray,
    positions: np.ndarray,
) -> tuple[list[list[int]], np.ndarray]:
    """The model runner's entry point: verify this step's drafts (see RejectionSampler)."""
    spec = runner.speculator
    sampler = getattr(spec, "rejection_sampler", None)
    if sampler is None:
        sampler = RejectionSampler(runner.vllm_config.speculative_config, runner.device)
        if spec is not None:
            spec.rejection_sampler = sampler
    draft_probs = getattr(spec, "draft_probs", None)
    return sampler(runner.states, input_batch, logits, target_tokens, positions, draft_probs)
