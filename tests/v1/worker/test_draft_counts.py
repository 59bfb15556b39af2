# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The scheduler <-> worker contract carries draft counts, not values: the worker reports how
many drafts it proposed per request (up to the first pad), verifies the first `count` drafts it
stored for a request, and refuses a count that disagrees with the request's scheduled tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.gpu.input_batch import prepare_inputs
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID, RequestStates, StepResult


def _states(drafts: list[int]) -> RequestStates:
    """One request, tokens [5, 6, 7] known, 2 computed, drafts stored in its slot."""
    st = RequestStates(2, max_model_len=32, max_blocks_per_req=4, num_spec=len(drafts))
    sp = SamplingParams(temperature=0)
    s = st.add(NewRequestData("a", [5, 6, 7], 3, sp, 0, [0, 1], 2))
    st.draft_tokens[s] = drafts
    return st


def _prepare(st: RequestStates, num_scheduled: int, counts: dict[str, int]):
    return prepare_inputs(
        st,
        ["a"],
        np.array([num_scheduled]),
        4,
        torch.device("cpu"),
        short_query_len=4,
        scheduled_drafts=counts,
    )


def test_verify_rows_embed_the_stored_drafts_up_to_the_count():
    st = _states([11, 12, 13])
    b = _prepare(st, 3, {"a": 2})  # the last known token and 2 of the 3 drafts
    assert b.input_ids_np.tolist() == [7, 11, 12]
    assert b.num_draft_tokens_np.tolist() == [2]
    b = _prepare(st, 1, {})  # no drafts verified: the last known token alone
    assert b.input_ids_np.tolist() == [7] and b.num_draft_tokens_np.tolist() == [0]


def test_a_count_that_disagrees_with_the_scheduled_tokens_is_refused():
    st = _states([11, 12, 13])
    with pytest.raises(RuntimeError, match="verifies"):
        _prepare(st, 3, {"a": 1})
    with pytest.raises(RuntimeError, match="verifies"):
        _prepare(st, 3, {})


def test_reported_counts_stop_at_the_first_pad():
    P = PAD_TOKEN_ID
    drafts = np.array([[1, 2, 3], [4, P, 6], [P, P, P]], dtype=np.int64)
    r = StepResult(np.zeros((3, 4), np.int64), np.ones(3, np.int64), np.zeros(3, np.int64), drafts)
    assert r.num_valid_drafts() == [3, 1, 0]
    r.drafts = None
    assert r.num_valid_drafts() is None
