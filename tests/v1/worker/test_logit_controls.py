# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""apply_logit_controls on a speculative step: row j of a request sees the request's tokens so
far plus the drafts of rows 0 .. j - 1 (written out here per row), and requests without
controls are left alone."""

from __future__ import annotations

import numpy as np
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.gpu.sample.logit_controls import apply_logit_controls
from vllm.v1.worker.gpu.states import RequestStates

V = 16


def _expected(logits: torch.Tensor, prompt: list[int], output: list[int], sp) -> torch.Tensor:
    x = logits.clone()
    if sp.allowed_token_ids is not None:
        for t in range(V):
            if t not in sp.allowed_token_ids:
                x[t] = float("-inf")
    for ids in sp.bad_words_token_ids:
        if len(ids) == 1 or output[len(output) - len(ids) + 1 :] == ids[:-1]:
            x[ids[-1]] = float("-inf")
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    if len(output) < sp.min_tokens:
        for t in sp.all_stop_token_ids:
            x[t] = float("-inf")
    for t in range(V):
        n = output.count(t)
        if (n or t in prompt) and sp.repetition_penalty != 1.0:
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
        x[t] -= sp.frequency_penalty * n + sp.presence_penalty * (n > 0)
    return x


def test_each_verify_row_counts_the_drafts_before_it() -> None:
    st = RequestStates(4, max_model_len=64, max_blocks_per_req=4, num_spec=3)
    sp = SamplingParams(
        temperature=0,
        repetition_penalty=1.5,
        frequency_penalty=0.75,
        presence_penalty=0.5,
        logit_bias={3: 1.0},
        min_tokens=4,
        stop_token_ids=[7],
        max_tokens=20,
    )
    sp._bad_words_token_ids = [[5, 9], [11]]
    plain = SamplingParams(temperature=0, max_tokens=20)
    prompt, outputs = [1, 2, 3], [5, 4]
    st.add(NewRequestData("a", prompt + outputs, 3, sp, 0, [0], 5))
    st.add(NewRequestData("b", [2, 2, 2], 3, plain, 0, [1], 3))
    # Request a verifies drafts 5, 9, 4 (rows at positions 5..8); b samples one token.
    drafts = [5, 9, 4]
    row_slots = np.array([0, 0, 0, 0, 1])
    positions = np.array([5, 6, 7, 8, 3])
    row_inputs = np.array([4, *drafts, 2])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g) * 3
    got = apply_logit_controls(logits, st, row_slots, positions, row_inputs)
    for j in range(4):
        want = _expected(logits[j], prompt, outputs + drafts[:j], sp)
        torch.testing.assert_close(got[j], want)
    assert got[1, 9] == float("-inf") and got[0, 9] != float("-inf")  # [5, 9] after draft 5
    assert got[1, 7] == float("-inf") and got[3, 7] != float("-inf")  # min_tokens = 4
    torch.testing.assert_close(got[4], logits[4])
    allowed = SamplingParams(temperature=0, allowed_token_ids=[2, 6])
    st.add(NewRequestData("c", [1, 2], 2, allowed, 0, [2], 2))
    got = apply_logit_controls(logits[:1], st, np.array([2]), np.array([2]), np.array([2]))
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [2, 6]
