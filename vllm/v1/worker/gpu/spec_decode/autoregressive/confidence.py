# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The worker's half of adaptive_draft_confidence (the scheduler's: core/sched/
draft_confidence.py): each draft's confidence - the draft distribution's top probability at
that step - multiplied along the chain, reported per request with the drafts; a request whose
next draft is not expected to pay what the scheduler said it must (SchedulerOutput.
draft_confidence_floor) is drafted no further (nor could any later draft pay: the product
only falls)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm.v1.metrics.stats import JUMP_FORWARD

# P(draft j + 1 accepted | draft j accepted) is 0.57-0.67 for the bundled SmolLM2 EAGLE3 head
# (held-out prompts, greedy): what a request's next draft is expected to keep of its confidence.
CONTINUE_RATE = 0.65


class DraftConfidenceRecorder:
    def __init__(self, max_num_reqs: int, k: int) -> None:
        self.conf = np.zeros((max_num_reqs, k), dtype=np.float64)
        """[R, K] per batch row of the last propose: the running product up to each draft."""
        self.floor: tuple[float, float] | None = None
        self.num_stopped = 0
        """Draft passes of a request skipped so far: its confidence was below the floor."""

    def begin(self, num_reqs: int) -> None:
        self.conf[:num_reqs] = 0.0

    def record(self, logits: torch.Tensor, step: int, rows: np.ndarray) -> None:
        """Draft column `step` of batch rows `rows` was chosen from these logits."""
        top = torch.softmax(logits.float(), dim=-1).amax(dim=-1).cpu().numpy()
        prev = self.conf[rows, step - 1] if step else 1.0
        self.conf[rows, step] = prev * top

    def stop_unconfident(
        self,
        ks: np.ndarray,
        verify: np.ndarray,
        step: int,
        rows: np.ndarray,
        agree: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """After draft column `step` of `rows`: the rows whose next draft is not expected to
        pay its row, or all of them where together they would not pay the pass, draft no
        further (ks, and what they report, cut to step + 1). The next draft's confidence is
        expected at CONTINUE_RATE of this one's. TP rank 0's decision on every rank (agree),
        as for the tokens: every rank must run the same rows."""
        if self.floor is None or not len(rows):
            return
        row_floor, pass_gain = self.floor
        going = rows[ks[rows] > step + 1]
        nxt = self.conf[going, step] * CONTINUE_RATE
        keep = nxt >= row_floor
        if nxt[keep].sum() < pass_gain:
            keep[:] = False
        low = agree(torch.from_numpy((~keep).astype(np.int64))).cpu().numpy().astype(bool)
        stop = going[low]
        if len(stop):
            self.num_stopped += int((ks[stop] - step - 1).sum())
            ks[stop] = step + 1
            verify[stop] = np.minimum(verify[stop], step + 1)

    def set(self, conf: np.ndarray) -> None:
        """A dynamic tree's nodes [R, N] (most probable first): their path probabilities."""
        self.conf[: conf.shape[0]] = conf

    def report(self, num_valid: list[int], proposers: list[str] | None) -> list[list[float]]:
        """Per batch row, the products of its valid drafts (none where the grammar forced
        them: jump-forward drafts are not the draft's)."""
        return [
            []
            if proposers is not None and proposers[i] == JUMP_FORWARD
            else self.conf[i, :n].tolist()
            for i, n in enumerate(num_valid)
        ]
