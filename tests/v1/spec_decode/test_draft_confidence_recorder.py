# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The worker's half of adaptive_draft_confidence on its own: the running product of the
draft's top probabilities, the requests it drafts no further (its next draft can not pay its
row, or the pass would not pay for itself), TP rank 0's decision, and what it reports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.metrics.stats import JUMP_FORWARD
from vllm.v1.worker.gpu.spec_decode.autoregressive.confidence import (
    CONTINUE_RATE,
    DraftConfidenceRecorder,
)


def _logits(tops: list[float], vocab: int = 6) -> torch.Tensor:
    """Rows whose softmax puts `top` on token 0 and the rest evenly on the others."""
    rows = []
    for t in tops:
        p = torch.full((vocab,), (1 - t) / (vocab - 1), dtype=torch.float64)
        p[0] = t
        rows.append(p.log())
    return torch.stack(rows).float()


def test_the_running_product_of_the_top_probabilities():
    rec = DraftConfidenceRecorder(4, 3)
    rec.begin(3)
    rows = np.array([0, 1, 2])
    rec.record(_logits([0.9, 0.5, 0.2]), 0, rows)
    rec.record(_logits([0.8, 0.5]), 1, np.array([0, 2]))
    np.testing.assert_allclose(rec.conf[:3, 0], [0.9, 0.5, 0.2], rtol=1e-5)
    np.testing.assert_allclose(rec.conf[[0, 2], 1], [0.72, 0.1], rtol=1e-5)
    assert rec.conf[1, 1] == 0.0  # row 1 did not draft a second token


def _after_first(tops: list[float], floor: tuple[float, float] | None, k: int = 3):
    rec = DraftConfidenceRecorder(8, k)
    rec.begin(len(tops))
    rows = np.arange(len(tops))
    rec.record(_logits(tops), 0, rows)
    rec.floor = floor
    ks = np.full(len(tops), k, np.int64)
    verify = ks.copy()
    seen: list[torch.Tensor] = []

    def agree(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.clone())
        return t

    rec.stop_unconfident(ks, verify, 0, rows, agree)
    return rec, ks, verify, seen


def test_a_request_whose_next_draft_can_not_pay_its_row_stops():
    # Row floor 0.3: a next draft expected at 0.65 x the confidence must reach it.
    rec, ks, verify, seen = _after_first([0.95, 0.4, 0.5], (0.3, 0.0))
    assert 0.4 * CONTINUE_RATE < 0.3 < 0.5 * CONTINUE_RATE
    assert ks.tolist() == [3, 1, 3] and verify.tolist() == [3, 1, 3]
    assert rec.num_stopped == 2  # row 1's drafts 1 and 2 are never drafted
    assert len(seen) == 1  # the decision went through agree()


def test_a_pass_runs_only_if_its_requests_together_pay_for_it():
    # Each of the three clears its row, but their next drafts sum to 0.65 x 1.0 < 0.8.
    _, ks, _, _ = _after_first([0.4, 0.3, 0.3], (0.1, 0.8))
    assert ks.tolist() == [1, 1, 1]
    _, ks, _, _ = _after_first([0.9, 0.3, 0.3], (0.1, 0.8))
    assert ks.tolist() == [3, 3, 3]


def test_tp_rank_0_decides():
    """What agree() returns is what every rank does, whatever this rank's own numbers say."""
    rec = DraftConfidenceRecorder(4, 3)
    rec.begin(2)
    rec.record(_logits([0.99, 0.99]), 0, np.arange(2))
    rec.floor = (0.0, 0.0)
    ks, verify = np.full(2, 3, np.int64), np.full(2, 3, np.int64)
    rec.stop_unconfident(ks, verify, 0, np.arange(2), lambda t: torch.tensor([1, 0]))
    assert ks.tolist() == [1, 3]


def test_no_floor_no_stop_and_what_is_reported():
    rec, ks, verify, seen = _after_first([0.01, 0.02], None)
    assert ks.tolist() == [3, 3] and not seen
    rec.conf[0, :3] = [0.5, 0.25, 0.1]
    rec.conf[1, :3] = [0.9, 0.8, 0.7]
    assert rec.report([2, 0], None) == [[0.5, 0.25], []]
    # Jump-forward drafts are the grammar's, not the draft's: no confidence for them.
    assert rec.report([3, 3], [JUMP_FORWARD, "eagle3"]) == [[], pytest.approx([0.9, 0.8, 0.7])]


def test_a_dynamic_trees_path_probabilities_are_its_confidences():
    rec = DraftConfidenceRecorder(4, 3)
    rec.set(np.exp(np.array([[-0.1, -0.7, -np.inf], [-np.inf] * 3], dtype=np.float32)))
    assert rec.report([2, 0], None) == [pytest.approx([np.exp(-0.1), np.exp(-0.7)]), []]
