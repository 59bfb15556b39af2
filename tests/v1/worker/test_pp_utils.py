# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""PPHandler: fixed-width broadcasts of a StepResult, dropping rows of freed slots, the FIFO
apply rule, and the stage-to-stage tensor-dict transfer, over real gloo groups (two ranks as two
threads); apply_step_result on its own."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from vllm.distributed.parallel_state import PPGroup, recv_tensor_dict, send_tensor_dict
from vllm.v1.worker.gpu.pp_utils import PendingRecv, PPHandler, compute_need_sampled_mask
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID, RequestStates, StepResult, apply_step_result

K = 2  # draft tokens per step


def _states(num_reqs: int = 4) -> RequestStates:
    st = RequestStates(num_reqs, max_model_len=32, max_blocks_per_req=4, num_spec=K)
    for s in range(num_reqs):
        st.token_ids[s, :3] = [100 + s, 200 + s, 300 + s]
        st.num_tokens[s] = 3
        st.num_computed[s] = 3 + K  # after an optimistic advance over 1 + K tokens
    return st


def _batch(slots: list[int], need: list[bool]) -> SimpleNamespace:
    return SimpleNamespace(
        num_reqs=len(slots),
        idx_mapping_np=np.array(slots, dtype=np.int64),
        need_sample_np=np.array(need, dtype=bool),
    )


def _gloo_pair() -> list:
    store = dist.HashStore()
    groups: list = [None, None]

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def _run_ranks(fns) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]


def _handler(rank: int, group, k: int = K) -> PPHandler:
    pp = PPGroup(rank=rank, world_size=2, broadcast_group=group)
    return PPHandler(max_num_reqs=4, num_speculative_steps=k, device="cpu", pp_group=pp)


def _result(sampled, num_sampled, num_rejected, drafts=None) -> StepResult:
    return StepResult(
        np.array(sampled, dtype=np.int64),
        np.array(num_sampled, dtype=np.int64),
        np.array(num_rejected, dtype=np.int64),
        None if drafts is None else np.array(drafts, dtype=np.int64),
    )


# ---- applying a result and the skip rule -----------------------------------------------------
def test_apply_step_result_rolls_back_appends_and_stores_drafts():
    st = _states()
    result = _result(
        [[5, 6, 7], [8, PAD_TOKEN_ID, PAD_TOKEN_ID], [PAD_TOKEN_ID] * 3, [1, 2, PAD_TOKEN_ID]],
        [3, 1, 0, 2],
        [0, 2, 0, 1],
        [[11, 12], [13, 14], [15, 16], [17, 18]],
    )
    # Row 2 skipped (a freed slot / no sample); rows map to slots out of order.
    apply_step_result(st, result, np.array([3, 0, -1, 1]))
    assert st.token_ids[3, :6].tolist() == [103, 203, 303, 5, 6, 7] and st.num_tokens[3] == 6
    assert st.token_ids[0, :4].tolist() == [100, 200, 300, 8] and st.num_tokens[0] == 4
    assert st.token_ids[1, :5].tolist() == [101, 201, 301, 1, 2] and st.num_tokens[1] == 5
    assert st.num_computed.tolist() == [3 + K - 2, 3 + K - 1, 3 + K, 3 + K]
    assert st.draft_tokens.tolist() == [[13, 14], [17, 18], [0, 0], [11, 12]]
    assert st.num_tokens[2] == 3
    assert result.sampled_token_lists() == [[5, 6, 7], [8], [], [1, 2]]


def test_need_sampled_mask_is_none_when_no_row_samples():
    assert compute_need_sampled_mask(_batch([0, 1], [False, False])) is None
    assert compute_need_sampled_mask(_batch([0, 1], [False, True])).tolist() == [False, True]


# ---- the real collective: shapes, order, dropped rows ----------------------------------------
def test_broadcast_receive_apply_over_gloo():
    groups = _gloo_pair()
    last, other = _handler(1, groups[1]), _handler(0, groups[0])
    st = _states()
    batch_a = _batch([0, 1, 2], [True, False, True])  # slot 1: a non-final prefill chunk
    batch_b = _batch([3], [False])  # only a prefill chunk: nothing is sent at all
    batch_c = _batch([1, 3], [True, True])

    def last_rank() -> None:
        # Batch A: slot 0 accepted both drafts (3 tokens), slot 2 rejected one (2 tokens).
        a = _result([[5, 6, 7], [-1, -1, -1], [8, 9, -1]], [3, 0, 2], [0, 0, 1])
        a.drafts = np.array([[1, 2], [3, 4], [5, 6]])
        assert last.broadcast(a, batch_a)
        assert not last.broadcast(_result([[-1] * 3], [0], [0], [[0, 0]]), batch_b)
        # Batch C: nothing accepted anywhere: the same width, padded.
        c = _result([[11, -1, -1], [12, -1, -1]], [1, 1], [2, 2], [[21, 22], [23, 24]])
        assert last.broadcast(c, batch_c)
        last.wait_sends()

    def other_rank() -> None:
        assert other.receive(batch_a)
        assert not other.receive(batch_b)
        assert other.receive(batch_c)
        assert len(other.queue) == 2
        assert other.queue[0].sampled_tokens.shape == (3, K + 1)
        assert other.queue[0].counts.shape == (2, 3)
        assert other.queue[0].draft_tokens.shape == (3, K)
        other.on_req_idx_freed(2)  # slot 2 finished before its result was applied
        # Only slot 0 runs next: batch A must be applied; batch C is applied too only if its
        # receive has already completed (free), else it stays in flight.
        applied = other.apply_pending(st, [0])
        assert applied >= 1
        assert st.token_ids[0, :6].tolist() == [100, 200, 300, 5, 6, 7]
        assert st.num_tokens[0] == 6 and st.num_computed[0] == 3 + K
        assert st.draft_tokens[0].tolist() == [1, 2]
        if applied == 1:  # C in flight: slot 1 as batch A left it (a chunk, no sample)
            assert st.num_tokens[1] == 3 and st.draft_tokens[1].tolist() == [0, 0]
            assert len(other.queue) == 1
        assert st.num_tokens[2] == 3 and st.num_computed[2] == 3 + K  # freed: dropped
        other.apply_pending(st, [1, 3])
        assert not other.queue
        assert st.token_ids[1, :4].tolist() == [101, 201, 301, 11]
        assert st.num_computed[1] == 3 + K - 2 and st.draft_tokens[1].tolist() == [21, 22]
        assert st.token_ids[3, :4].tolist() == [103, 203, 303, 12]
        assert st.draft_tokens[3].tolist() == [23, 24]

    _run_ranks([last_rank, other_rank])


def test_width_is_k_plus_one_without_drafts():
    groups = _gloo_pair()
    last, other = _handler(1, groups[1], k=0), _handler(0, groups[0], k=0)
    st = _states()
    batch = _batch([2, 0], [True, True])

    def last_rank() -> None:
        assert last.broadcast(_result([[7], [9]], [1, 1], [0, 0]), batch)
        last.wait_sends()

    def other_rank() -> None:
        other.receive(batch)
        assert other.queue[0].draft_tokens is None
        idx, result = other.get_prev_sampled_outputs()
        assert idx.tolist() == [2, 0] and result.drafts is None
        assert result.sampled.tolist() == [[7], [9]]
        apply_step_result(st, result, idx)
        assert st.token_ids[2, 3] == 7 and st.token_ids[0, 3] == 9

    _run_ranks([last_rank, other_rank])


def test_broadcast_rejects_wrong_shapes():
    last = _handler(1, None)
    batch = _batch([0], [True])
    with pytest.raises(TypeError, match="int64"):
        bad = _result([[1, 2, 3]], [1], [0], [[0, 0]])
        bad.sampled = bad.sampled.astype(np.int32)
        last.broadcast(bad, batch)
    with pytest.raises(ValueError, match="expected \\(1, 3\\)"):
        last.broadcast(_result([[1, 2]], [1], [0], [[0, 0]]), batch)
    with pytest.raises(ValueError, match="expected \\(1, 2\\)"):
        last.broadcast(_result([[1, 2, 3]], [1], [0], [[0, 0, 0]]), batch)


# ---- the FIFO apply rule, with hand-controlled completion ------------------------------------
class _Work:
    def __init__(self, done: bool) -> None:
        self.done = done
        self.waited = 0

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waited += 1
        self.done = True
        return True


def _entry(handler: PPHandler, slots: list[int], token: int, done: bool) -> PendingRecv:
    n = len(slots)
    idx = np.array(slots, dtype=np.int64)
    return PendingRecv(
        works=[_Work(done)],
        sampled_tokens=torch.full((n, K + 1), PAD_TOKEN_ID, dtype=torch.int64).index_fill_(
            1, torch.tensor([0]), token
        ),
        counts=torch.tensor([[1] * n, [K] * n], dtype=torch.int32),
        draft_tokens=torch.full((n, K), token + 1, dtype=torch.int64),
        idx_mapping_np=idx,
        need_sampled_mask=np.ones(n, dtype=bool),
        gen_at_receive_np=handler.req_idx_gen_np[idx].copy(),
    )


def test_apply_pending_fifo_rule():
    h = _handler(0, None)
    st = _states()
    e1 = _entry(h, [0], 50, done=False)
    e2 = _entry(h, [1], 51, done=False)
    e3 = _entry(h, [2], 52, done=False)
    h.queue.extend([e1, e2, e3])
    # Nothing scheduled from the pending batches and none complete: nothing waits.
    assert h.apply_pending(st, [3]) == 0 and len(h.queue) == 3
    # Slot 1 runs: e1 and e2 are applied in order (e1 waited on first), e3 stays in flight.
    assert h.apply_pending(st, [1]) == 2
    assert list(h.queue) == [e3] and e3.works[0].waited == 0
    assert st.token_ids[0, 3] == 50 and st.token_ids[1, 3] == 51 and st.num_tokens[2] == 3
    assert st.num_computed[1] == 3 and st.draft_tokens[1].tolist() == [52, 52]
    # A completed head is applied for free even when no scheduled request needs it.
    e3.works[0].done = True
    assert h.apply_pending(st, []) == 1 and not h.queue
    assert st.token_ids[2, 3] == 52


def test_rows_of_freed_slots_do_not_force_a_wait():
    h = _handler(0, None)
    st = _states()
    old = _entry(h, [1], 60, done=False)
    h.queue.append(old)
    h.on_req_idx_freed(1)  # slot 1 was freed and handed to a new request
    assert h.apply_pending(st, [1]) == 0  # the new owner does not wait for the old result
    old.works[0].done = True
    assert h.get_prev_sampled_outputs() is None  # every row dropped
    assert st.num_tokens[1] == 3


def test_get_prev_sampled_outputs_marks_dropped_rows():
    h = _handler(0, None)
    st = _states()
    e = _entry(h, [0, 1, 2], 70, done=True)
    e.need_sampled_mask[1] = False
    h.queue.append(e)
    h.on_req_idx_freed(2)
    idx, result = h.get_prev_sampled_outputs()
    assert idx.tolist() == [0, -1, -1]
    apply_step_result(st, result, idx)
    assert st.token_ids[0, 3] == 70 and st.num_tokens[1] == 3 and st.num_tokens[2] == 3


# ---- stage-to-stage tensors ------------------------------------------------------------------
def test_send_recv_tensor_dict_over_gloo():
    groups = _gloo_pair()
    sent = {
        "hidden_states": torch.randn(5, 8),
        "residual": torch.randn(5, 8, dtype=torch.float64),
        "aux_hidden_states_0": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }
    got: dict = {}

    def sender() -> None:
        for _ in range(2):  # two messages back to back stay in order
            send_tensor_dict(sent, 1, device_group=groups[0], cpu_group=groups[0]).wait()

    # The receiver's persistent buffers (more rows than a message needs).
    buffers = {k: torch.zeros(7, *v.shape[1:], dtype=v.dtype) for k, v in sent.items()}

    def receiver() -> None:
        for i in range(2):
            views = recv_tensor_dict(0, buffers, device_group=groups[1], cpu_group=groups[1])
            assert all(
                t.untyped_storage().data_ptr() == buffers[k].untyped_storage().data_ptr()
                for k, t in views.items()
            )
            got[i] = {k: t.clone() for k, t in views.items()}

    _run_ranks([sender, receiver])
    for i in range(2):
        assert list(got[i]) == list(sent)
        for k, v in sent.items():
            assert got[i][k].dtype == v.dtype and torch.equal(got[i][k], v)


@pytest.mark.parametrize(
    "meta, match",
    [
        ([("aux_hidden_states_3", (5, 8), "float32")], "has no slot"),
        ([("hidden_states", (9, 8), "float32")], r"float32 \(9, 8\)"),
        ([("hidden_states", (5, 4), "float32")], "cannot hold"),
        ([("hidden_states", (5, 8), "float64")], "cannot hold"),
    ],
)
def test_receive_refuses_what_the_buffers_cannot_hold(meta, match):
    from vllm.distributed.parallel_state import receive_views

    buffers = {"hidden_states": torch.zeros(8, 8)}
    with pytest.raises(RuntimeError, match=match):
        receive_views(meta, buffers)
