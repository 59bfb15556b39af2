# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""PPHandler: the last pipeline stage tells every other stage what it decided for each batch.

Non-last stages never sample, yet the first stage must embed each request's last sampled token
and its draft tokens, and every stage must roll its computed-token count back by the drafts
the last stage rejected. After sampling and proposing, the last stage broadcasts the batch's
StepResult as one unit, per batch row:
  1. sampled tokens    [R, K+1] int64 (padded with PAD_TOKEN_ID: the width never depends on
                       how many drafts were accepted),
  2. counts            [2, R] int32 (num_sampled; num_rejected),
  3. draft tokens      [R, K] int64 (K > 0 only),
  4. draft parents     [R, K] int64 (a dynamic draft tree only: each request's tree shape for
                       the next step, which every stage lays its rows out by).
The other stages post the matching receives (asynchronously) right after running the same batch
and apply them (apply_step_result, as the last stage does) before that batch's requests run
again. Both sides skip a batch with no row needing a sample (only non-final prefill chunks)
from CPU state they share, so collectives always pair one-to-one, in the same order. A
separate process group (broadcast_group) carries them so they never queue behind the
stage-to-stage tensors.

A runner feature: begin_step applies the results a step's requests need (non-last stages),
after_step broadcasts (last stage) or posts the receives (the others).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.v1.worker.gpu.features import RunnerFeature
from vllm.v1.worker.gpu.states import RequestStates, StepResult, apply_step_result

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch

SENDS_PER_BATCH = 4  # sampled tokens, counts, drafts, a dynamic tree's parents


def compute_need_sampled_mask(input_batch: InputBatch) -> np.ndarray | None:
    """Rows that produce a sample this step; None when no row does (then nothing is sent)."""
    need = np.asarray(input_batch.need_sample_np, dtype=bool)
    return need if need.any() else None


class _DoneWork:
    """Stands in for a completed collective (tests; a group of one)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


@dataclass
class PendingRecv:
    """One batch's receives, posted but maybe not finished."""

    works: list
    sampled_tokens: torch.Tensor  # [R, K+1] int64
    counts: torch.Tensor  # [2, R] int32: num_sampled, num_rejected
    draft_tokens: torch.Tensor | None  # [R, K] int64, or None when K == 0
    idx_mapping_np: np.ndarray  # [R] batch row -> request-state slot
    need_sampled_mask: np.ndarray  # [R] bool
    gen_at_receive_np: np.ndarray  # [R] slot generation counters when the receive was posted
    draft_parents: torch.Tensor | None = None  # [R, K] int64 (a dynamic tree), or None

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


class PPHandler(RunnerFeature):
    """Broadcast of the last stage's sampling results and their application elsewhere."""

    def __init__(
        self,
        max_num_reqs: int,
        num_speculative_steps: int,
        device: torch.device | str,
        pp_group: Any = None,
        draft_parents: bool = False,
    ) -> None:
        """draft_parents: the drafts form a dynamic tree (num_tree_nodes), whose parents travel
        with them."""
        if pp_group is None:
            from vllm.distributed.parallel_state import get_pp_group

            pp_group = get_pp_group()
        self.max_num_reqs = max_num_reqs
        self.num_speculative_steps = num_speculative_steps
        self.max_sample_len = num_speculative_steps + 1
        self.draft_parents = draft_parents and num_speculative_steps > 0
        self.device = torch.device(device)
        self.is_last_rank = pp_group.is_last_rank
        self.last_rank = pp_group.last_rank
        self.broadcast_group = pp_group.broadcast_group
        # Receives posted, in batch order (non-last ranks).
        self.queue: deque[PendingRecv] = deque()
        # Sends posted and not yet reaped (last rank): keeps their tensors alive. At most
        # three per batch and world_size batches in flight (the engine's limit).
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()
        self.max_pending_sends = SENDS_PER_BATCH * pp_group.world_size
        # Bumped when a slot is freed: results addressed to its previous owner are dropped.
        self.req_idx_gen_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.recv_wait_s = 0.0  # time spent blocked on broadcasts not yet arrived (benchmarks)
        # Called with (states, result, idx_mapping) before a result is applied (draft trees
        # compact this stage's KV from it); None: nothing.
        self.before_apply: Any = None

    # ---- runner hooks -----------------------------------------------------------------------
    def begin_step(self, so: SchedulerOutput, states: RequestStates) -> None:
        """Non-last stages: apply the last stage's results that this step's requests need
        (before the finished requests' slots are freed and the new ones taken)."""
        if self.is_last_rank:
            return
        for rid in so.finished_req_ids:
            if rid in states.req_id_to_slot:
                self.on_req_idx_freed(states.slot(rid))
        cached = so.scheduled_cached_reqs.req_ids
        self.apply_pending(states, [states.slot(r) for r in cached if r in states.req_id_to_slot])

    def after_step(self, batch: InputBatch, result: StepResult | None) -> None:
        if result is not None:
            self.broadcast(result, batch)
        else:
            self.receive(batch)

    # ---- both sides ------------------------------------------------------------------------
    def on_req_idx_freed(self, req_idx: int) -> None:
        self.req_idx_gen_np[req_idx] += 1

    def _bcast(self, tensor: torch.Tensor):
        if self.broadcast_group is None:
            return _DoneWork()
        return self.broadcast_group.broadcast(tensor, self.last_rank)

    # ---- last rank -------------------------------------------------------------------------
    def _post_send(self, tensor: torch.Tensor) -> None:
        # gloo's is_completed() stays False until wait() is called, so waiting on completion
        # alone would keep every batch's tensors forever. A send older than the batches in
        # flight has been received (its batch's output reached the engine before this batch
        # was started), so waiting on it returns at once and frees it.
        sends = self._sends
        while sends and (len(sends) >= self.max_pending_sends or sends[0][0].is_completed()):
            sends.popleft()[0].wait()
        sends.append((self._bcast(tensor), tensor))

    @property
    def num_pending_sends(self) -> int:
        """Broadcasts posted and not reaped yet (bounded by max_pending_sends)."""
        return len(self._sends)

    def broadcast(self, result: StepResult, input_batch: InputBatch) -> bool:
        """Send this batch's result (sampled tokens, counts, drafts, a dynamic tree's
        parents); False when the batch sent nothing."""
        assert self.is_last_rank, "only the last pipeline stage broadcasts"
        if compute_need_sampled_mask(input_batch) is None:
            return False
        R, K = input_batch.num_reqs, self.num_speculative_steps
        if result.sampled.shape != (R, self.max_sample_len):
            raise ValueError(
                f"sampled token ids have shape {result.sampled.shape}, expected "
                f"{(R, self.max_sample_len)}"
            )
        if result.sampled.dtype != np.int64:
            raise TypeError(f"sampled token ids must be int64, got {result.sampled.dtype}")
        counts = np.stack([result.num_sampled, result.num_rejected]).astype(np.int32)
        self._post_send(torch.from_numpy(result.sampled).to(self.device))
        self._post_send(torch.from_numpy(counts).to(self.device))
        if K > 0:
            if result.drafts is None or result.drafts.shape != (R, K):
                shape = None if result.drafts is None else result.drafts.shape
                raise ValueError(f"draft tokens have shape {shape}, expected {(R, K)}")
            drafts = np.ascontiguousarray(result.drafts, dtype=np.int64)
            self._post_send(torch.from_numpy(drafts).to(self.device))
        if self.draft_parents:
            parents = result.draft_parents
            if parents is None or parents.shape[1] != K or len(parents) < R:
                shape = None if parents is None else parents.shape
                raise ValueError(f"draft tree parents have shape {shape}, expected {(R, K)}")
            parents = np.ascontiguousarray(parents[:R], dtype=np.int64)
            self._post_send(torch.from_numpy(parents).to(self.device))
        return True

    def wait_sends(self) -> None:
        while self._sends:
            self._sends.popleft()[0].wait()

    # ---- other ranks -----------------------------------------------------------------------
    def receive(self, input_batch: InputBatch) -> bool:
        """Post the receives matching the last rank's broadcasts for this batch (non-blocking).

        Returns False when the batch expects nothing (no row needs a sample)."""
        assert not self.is_last_rank, "the last pipeline stage does not receive"
        mask = compute_need_sampled_mask(input_batch)
        if mask is None:
            return False
        num_reqs = input_batch.num_reqs
        idx = np.asarray(input_batch.idx_mapping_np, dtype=np.int64).copy()
        tokens = torch.empty(num_reqs, self.max_sample_len, dtype=torch.int64, device=self.device)
        counts = torch.empty(2, num_reqs, dtype=torch.int32, device=self.device)
        works = [self._bcast(tokens), self._bcast(counts)]

        def per_draft() -> torch.Tensor:  # [R, K] int64: the drafts, a tree's parents
            K = self.num_speculative_steps
            t = torch.empty(num_reqs, K, dtype=torch.int64, device=self.device)
            works.append(self._bcast(t))
            return t

        drafts = per_draft() if self.num_speculative_steps > 0 else None
        parents = per_draft() if self.draft_parents else None
        self.queue.append(
            PendingRecv(
                works=works,
                sampled_tokens=tokens,
                counts=counts,
                draft_tokens=drafts,
                draft_parents=parents,
                idx_mapping_np=idx,
                need_sampled_mask=mask.copy(),
                gen_at_receive_np=self.req_idx_gen_np[idx].copy(),
            )
        )
        return True

    def _live_rows(self, entry: PendingRecv) -> np.ndarray:
        """Rows still addressed to their slot's current owner and that sampled something."""
        same_owner = self.req_idx_gen_np[entry.idx_mapping_np] == entry.gen_at_receive_np
        return same_owner & entry.need_sampled_mask

    def _holds_any(self, entry: PendingRecv, req_idxs: np.ndarray) -> bool:
        return bool(np.isin(entry.idx_mapping_np[self._live_rows(entry)], req_idxs).any())

    def get_prev_sampled_outputs(self) -> tuple[np.ndarray, StepResult] | None:
        """Wait for the oldest pending batch; returns (idx_mapping, its StepResult), or None
        when nothing was pending or every row was dropped.

        idx_mapping [R] is each row's request-state slot, or -1 for a row whose slot was freed
        since the receive or that did not need a sample."""
        if not self.queue:
            return None
        entry = self.queue.popleft()
        t0 = time.perf_counter()
        entry.wait()
        self.recv_wait_s += time.perf_counter() - t0
        keep = self._live_rows(entry)
        if not keep.any():
            return None
        idx_mapping = np.where(keep, entry.idx_mapping_np, -1)
        counts = entry.counts.cpu().numpy().astype(np.int64)
        result = StepResult(
            sampled=entry.sampled_tokens.cpu().numpy(),
            num_sampled=counts[0],
            num_rejected=counts[1],
            drafts=None if entry.draft_tokens is None else entry.draft_tokens.cpu().numpy(),
            draft_parents=(
                None if entry.draft_parents is None else entry.draft_parents.cpu().numpy()
            ),
        )
        return idx_mapping, result

    def apply_pending(
        self, states: RequestStates, scheduled_req_idxs: np.ndarray | list[int]
    ) -> int:
        """Bring the states of the requests scheduled this step up to date.

        Applies pending batches in FIFO order: first those already complete (free), then, if
        needed, waits until no pending batch holds a row of a scheduled request. Later batches
        of other requests stay in flight, so independent batches overlap. Returns how many
        batches were applied."""
        req_idxs = np.asarray(scheduled_req_idxs, dtype=np.int64)
        applied = 0
        while self.queue and self.queue[0].is_completed():
            self._apply_next(states)
            applied += 1
        if len(req_idxs) == 0:
            return applied
        last_needed = -1
        for j, entry in enumerate(self.queue):
            if self._holds_any(entry, req_idxs):
                last_needed = j
        for _ in range(last_needed + 1):
            self._apply_next(states)
            applied += 1
        return applied

    def _apply_next(self, states: RequestStates) -> None:
        out = self.get_prev_sampled_outputs()
        if out is not None:
            if self.before_apply is not None:
                self.before_apply(states, out[1], out[0])
            apply_step_result(states, out[1], out[0])
