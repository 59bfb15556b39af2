# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""PPHandler: the last pipeline stage tells every other stage what it sampled (and drafted).

Non-last stages never sample, yet the first stage must embed each request's last sampled token
and its draft tokens, and every stage must roll its computed-token count back by the drafts
the last stage rejected. After sampling, the last stage broadcasts, per batch row,
  1. sampled tokens    [R, K+1] int64 (padded with PAD_TOKEN_ID: the width never depends on
                       how many drafts were accepted),
  2. counts            [2, R] int32 (num_sampled; num_rejected),
and after proposing (K > 0 only)
  3. draft tokens      [R, K] int64.
The other stages post the matching receives (asynchronously) right after running the same batch
and apply them before that batch's requests run again. Both sides skip a batch with no row
needing a sample (only non-final prefill chunks) from CPU state they share, so collectives
always pair one-to-one, in the same order. A separate process group (broadcast_group) carries
them so they never queue behind the stage-to-stage tensors.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

PAD_TOKEN_ID = -1
SENDS_PER_BATCH = 3  # sampled tokens, counts, drafts


def pad_sampled_token_ids(sampled: torch.Tensor, width: int) -> torch.Tensor:
    """Widen [R, n <= width] int64 to [R, width], filling with PAD_TOKEN_ID."""
    if sampled.dim() != 2 or sampled.shape[1] > width:
        raise ValueError(
            f"sampled token ids of shape {tuple(sampled.shape)} do not fit width {width}"
        )
    if sampled.shape[1] == width:
        return sampled.contiguous()
    out = torch.full(
        (sampled.shape[0], width), PAD_TOKEN_ID, dtype=sampled.dtype, device=sampled.device
    )
    out[:, : sampled.shape[1]] = sampled
    return out


def compute_need_sampled_mask(input_batch: Any) -> np.ndarray | None:
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

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


class PPHandler:
    """Broadcast of the last stage's sampling results and their application elsewhere."""

    def __init__(
        self,
        max_num_reqs: int,
        num_speculative_steps: int,
        device: torch.device | str,
        pp_group: Any = None,
    ) -> None:
        if pp_group is None:
            from vllm.distributed.parallel_state import get_pp_group

            pp_group = get_pp_group()
        self.max_num_reqs = max_num_reqs
        self.num_speculative_steps = num_speculative_steps
        self.max_sample_len = num_speculative_steps + 1
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
        # EAGLE3 on a middle stage: aux_hidden_states_<i> slots of upstream stages to forward.
        self.aux_relay_keys: tuple[str, ...] = ()

    # ---- both sides ------------------------------------------------------------------------
    def on_req_idx_freed(self, req_idx: int) -> None:
        self.req_idx_gen_np[req_idx] += 1

    def _bcast(self, tensor: torch.Tensor):
        if self.broadcast_group is None:
            return _DoneWork()
        return self.broadcast_group.broadcast(tensor, self.last_rank)

    def configure_aux_hidden_state_relay(self, model: Any) -> tuple[str, ...]:
        """Remember which upstream aux slots this (middle) stage must forward (EAGLE3)."""
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
            aux_hidden_state_relay_keys,
        )

        self.aux_relay_keys = aux_hidden_state_relay_keys(model)
        return self.aux_relay_keys

    def relay_aux_hidden_states(self, intermediate_tensors: Any, output: Any) -> Any:
        """Copy the upstream aux slots, unchanged, from what this stage received into what it
        sends on; a slot that did not arrive is an error, never zero-filled."""
        if not self.aux_relay_keys or output is None:
            return output
        for key in self.aux_relay_keys:
            if intermediate_tensors is None or key not in intermediate_tensors:
                raise RuntimeError(
                    f"Missing {key} in the intermediate tensors to relay "
                    f"(expected {list(self.aux_relay_keys)})"
                )
            output[key] = intermediate_tensors[key]
        return output

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

    def broadcast(
        self,
        sampled_token_ids: torch.Tensor,
        num_sampled: torch.Tensor | np.ndarray,
        num_rejected: torch.Tensor | np.ndarray,
        input_batch: Any,
    ) -> bool:
        """Send this batch's sampled tokens and counts; False when the batch sent nothing."""
        assert self.is_last_rank, "only the last pipeline stage broadcasts"
        if compute_need_sampled_mask(input_batch) is None:
            return False
        if sampled_token_ids.dtype != torch.int64:
            raise TypeError(f"sampled token ids must be int64, got {sampled_token_ids.dtype}")
        num_reqs = input_batch.num_reqs
        if sampled_token_ids.shape[0] != num_reqs:
            raise ValueError(
                f"sampled token ids have {sampled_token_ids.shape[0]} rows, the batch {num_reqs}"
            )
        tokens = pad_sampled_token_ids(sampled_token_ids.to(self.device), self.max_sample_len)
        counts = torch.stack(
            [
                torch.as_tensor(num_sampled, dtype=torch.int32).reshape(num_reqs),
                torch.as_tensor(num_rejected, dtype=torch.int32).reshape(num_reqs),
            ]
        ).to(self.device)
        self._post_send(tokens)
        self._post_send(counts)
        return True

    def broadcast_drafts(self, draft_tokens: torch.Tensor | list, input_batch: Any) -> bool:
        """Send the drafts proposed for this batch ([R, K]); call right after propose."""
        assert self.is_last_rank, "only the last pipeline stage broadcasts"
        if self.num_speculative_steps == 0 or compute_need_sampled_mask(input_batch) is None:
            return False
        drafts = torch.as_tensor(draft_tokens, dtype=torch.int64, device=self.device)
        expected = (input_batch.num_reqs, self.num_speculative_steps)
        if tuple(drafts.shape) != expected:
            raise ValueError(f"draft tokens have shape {tuple(drafts.shape)}, expected {expected}")
        self._post_send(drafts.contiguous())
        return True

    def wait_sends(self) -> None:
        while self._sends:
            self._sends.popleft()[0].wait()

    # ---- other ranks -----------------------------------------------------------------------
    def receive(self, input_batch: Any) -> bool:
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
        drafts = None
        if self.num_speculative_steps > 0:
            drafts = torch.empty(
                num_reqs, self.num_speculative_steps, dtype=torch.int64, device=self.device
            )
            works.append(self._bcast(drafts))
        self.queue.append(
            PendingRecv(
                works=works,
                sampled_tokens=tokens,
                counts=counts,
                draft_tokens=drafts,
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

    def get_prev_sampled_outputs(self, states: Any) -> dict[str, np.ndarray] | None:
        """Wait for the oldest pending batch and apply it to the request states.

        For each kept row: append its sampled tokens to the slot's history, roll num_computed
        back by its rejected drafts, store its drafts. Rows whose slot was freed since the
        receive, or that did not need a sample, are dropped (idx_mapping -1). Returns the
        applied arrays, or None when nothing was pending or every row was dropped."""
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
        tokens = entry.sampled_tokens.cpu().numpy()
        counts = entry.counts.cpu().numpy()
        num_sampled, num_rejected = counts[0].astype(np.int64), counts[1].astype(np.int64)
        drafts = None if entry.draft_tokens is None else entry.draft_tokens.cpu().numpy()
        for i in np.nonzero(keep)[0].tolist():
            s = int(idx_mapping[i])
            n = int(num_sampled[i])
            if n > 0:
                states.num_computed[s] -= num_rejected[i]
                states.append_sampled(s, tokens[i, :n].tolist())
            if drafts is not None:
                states.draft_tokens[s, : drafts.shape[1]] = drafts[i]
        return {
            "idx_mapping": idx_mapping,
            "sampled_tokens": tokens,
            "num_sampled": num_sampled,
            "num_rejected": num_rejected,
            "draft_tokens": drafts,
        }

    def apply_pending(self, states: Any, scheduled_req_idxs: np.ndarray | list[int]) -> int:
        """Bring the states of the requests scheduled this step up to date.

        Applies pending batches in FIFO order: first those already complete (free), then, if
        needed, waits until no pending batch holds a row of a scheduled request. Later batches
        of other requests stay in flight, so independent batches overlap. Returns how many
        batches were applied."""
        req_idxs = np.asarray(scheduled_req_idxs, dtype=np.int64)
        applied = 0
        while self.queue and self.queue[0].is_completed():
            self.get_prev_sampled_outputs(states)
            applied += 1
        if len(req_idxs) == 0:
            return applied
        last_needed = -1
        for j, entry in enumerate(self.queue):
            if self._holds_any(entry, req_idxs):
                last_needed = j
        for _ in range(last_needed + 1):
            self.get_prev_sampled_outputs(states)
            applied += 1
        return applied
