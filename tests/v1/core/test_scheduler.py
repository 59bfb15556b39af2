# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Scheduler and KV block accounting, without a model (pure Python)."""

from __future__ import annotations

import subprocess
import sys

from tests.v1.core.utils import answer as _answer
from tests.v1.core.utils import make_request
from tests.v1.core.utils import sched_config as _config
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus


def _req(rid, n, max_tokens=4):
    return make_request(rid, range(1, n + 1), max_tokens)


def test_scheduler_does_not_import_torch():
    code = (
        "import sys; import vllm.v1.core.sched.scheduler, vllm.v1.core.kv_cache_manager; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_chunked_prefill_respects_budget():
    s = Scheduler(_config(budget=10), num_blocks=64)
    s.add_request(_req("a", 25))
    s.add_request(_req("b", 3))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 10}
    # Non-final chunk: no sampled token.
    out = ModelRunnerOutput(["a"], {"a": 0}, [[]])
    assert s.update_from_output(so, out).outputs == {}
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 10}
    s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[]]))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}
    res = s.update_from_output(so, _answer(so))
    assert res.outputs["a"].new_token_ids == [7]
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}


def test_preemption_picks_the_newest_request():
    # 6 blocks of 4 tokens; two 10-token prompts take 3 blocks each; growth forces preemption.
    s = Scheduler(_config(budget=64, block_size=4), num_blocks=6)
    a, b = _req("a", 10, max_tokens=8), _req("b", 10, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    for _ in range(10):
        so = s.schedule()
        if s.num_preemptions:
            break
        s.update_from_output(so, _answer(so))
    assert s.num_preemptions == 1
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert a.status == RequestStatus.RUNNING
    assert "b" in so.finished_req_ids and "b" not in so.num_scheduled_tokens
    assert s.waiting[0] is b


def test_priority_policy_orders_waiting_and_preempts_the_lowest_priority():
    """Under --scheduling-policy priority the waiting queue runs by (priority, arrival) and
    preemption takes the lowest-priority running request, not the newest."""
    s = Scheduler(_config(max_num_seqs=1, budget=64, policy="priority"), num_blocks=64)
    for rid, prio, t in [("late", 5, 1.0), ("urgent", -1, 3.0), ("mid", 0, 2.0), ("mid2", 0, 4.0)]:
        s.add_request(make_request(rid, range(1, 4), priority=prio, arrival_time=t))
    assert [r.request_id for r in s.waiting] == ["urgent", "mid", "mid2", "late"]
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["urgent"]
    # fcfs keeps arrival order whatever the priorities say.
    f = Scheduler(_config(max_num_seqs=1, budget=64), num_blocks=64)
    for rid, prio in [("a", 5), ("b", -1)]:
        f.add_request(make_request(rid, range(1, 4), priority=prio))
    assert list(f.schedule().num_scheduled_tokens) == ["a"]

    # 6 blocks of 4 tokens: two 10-token prompts; the first added has the LOWER priority, so
    # it is the one preempted (fcfs would preempt the newest).
    s = Scheduler(_config(budget=64, block_size=4, policy="priority"), num_blocks=6)
    low = make_request("low", range(1, 11), 8, priority=3, arrival_time=1.0)
    high = make_request("high", range(1, 11), 8, priority=1, arrival_time=2.0)
    s.add_request(low)
    s.add_request(high)
    for _ in range(10):
        so = s.schedule()
        if s.num_preemptions:
            break
        s.update_from_output(so, _answer(so))
    assert s.num_preemptions == 1
    assert low.status == RequestStatus.PREEMPTED and high.status == RequestStatus.RUNNING


def test_preempted_request_resumes_with_all_tokens():
    s = Scheduler(_config(budget=64, block_size=4), num_blocks=5)
    a, b = _req("a", 8, max_tokens=12), _req("b", 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    resumed = None
    for _ in range(40):
        so = s.schedule()
        for nr in so.scheduled_new_reqs:
            if nr.req_id == "b" and b.num_preemptions:
                resumed = nr
        if so.total_num_scheduled_tokens == 0:
            break
        s.update_from_output(so, _answer(so))
    assert b.num_preemptions >= 1
    assert resumed is not None
    assert resumed.prefill_token_ids[: b.num_prompt_tokens] == b.prompt_token_ids
    assert len(resumed.prefill_token_ids) > b.num_prompt_tokens  # outputs so far recomputed
    assert a.is_finished() and b.is_finished()
    assert s.kv_cache_manager.pool.num_free_blocks == 5


def test_spec_tokens_scheduled_and_rolled_back():
    s = Scheduler(_config(budget=64, k=2), num_blocks=64)
    r = _req("a", 5, max_tokens=10)
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[9]], None, {}, [2]))
    assert r.num_drafts == 2
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 3}
    assert so.num_draft_tokens == {"a": 2}
    before = r.num_computed_tokens  # advanced by 3 at schedule time
    # One draft accepted, one rejected: sampled = [accepted draft, bonus].
    res = s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[1, 5]], None, {}, [2]))
    assert r.num_computed_tokens == before - 1
    assert r.num_computed_tokens == r.num_tokens - 1
    assert res.outputs["a"].num_accepted_tokens == 1
    assert res.stats.spec_decoding_stats.num_accepted_tokens_per_pos == [1, 0]


def test_kv_manager_allocates_and_frees_state_slots():
    m = KVCacheManager(num_blocks=4, block_size=4, num_state_slots=1)
    a, b = _req("a", 5), _req("b", 3)
    assert m.allocate_slots(a, 5) == [0, 1]
    assert m.allocate_slots(b, 3) is None  # no state slot left
    m.free(a)
    assert m.allocate_slots(b, 3) is not None
    assert m.req_to_state_slot == {"b": 0}


def test_a_request_that_can_never_fit_finishes_with_an_error():
    """A pool smaller than one request's growth (the start-up check normally prevents it):
    instead of preempting itself and waiting forever, the request finishes with finish_reason
    "error" naming the numbers, its blocks are freed, and the other request runs on."""
    # 10 blocks of 4 tokens = 40 tokens; "big" grows to 8 + 40 = 48 tokens.
    s = Scheduler(_config(budget=64, block_size=4, max_model_len=256), num_blocks=10)
    big, small = _req("big", 8, max_tokens=40), _req("small", 3, max_tokens=4)
    s.add_request(big)
    s.add_request(small)
    failed = None
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        res = s.update_from_output(so, _answer(so))
        if "big" in res.outputs and res.outputs["big"].finish_reason == "error":
            failed = res.outputs["big"]
    else:
        raise AssertionError("the scheduler never finished the requests (a hang)")
    assert failed is not None and failed.error is not None
    assert "needs 11 KV blocks" in failed.error and "holds only 10 blocks" in failed.error
    assert big.status == RequestStatus.FINISHED_ERROR
    assert small.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.kv_cache_manager.pool.num_free_blocks == 10


def test_a_prompt_longer_than_the_pool_is_refused_when_waiting():
    """A waiting request whose prompt alone exceeds the pool fails at once, not after others
    have drained."""
    s = Scheduler(_config(budget=64, block_size=4), num_blocks=3)
    s.add_request(_req("long", 20))
    so = s.schedule()
    assert so.num_scheduled_tokens == {} and "long" in so.finished_req_ids
    res = s.update_from_output(so, _answer(so))
    assert res.outputs["long"].finish_reason == "error"
    assert not s.has_unfinished_requests()


def _run_until_done(s: Scheduler, steps: int = 20) -> dict:
    outputs: dict = {}
    for _ in range(steps):
        if not s.has_unfinished_requests():
            return outputs
        so = s.schedule()
        outputs.update(s.update_from_output(so, _answer(so)).outputs)
    raise AssertionError("the scheduler never finished the requests (a hang)")


def test_watchdog_finishes_a_request_that_waits_with_nothing_running():
    """The watchdog: blocks held by something that is not a running request (here taken from
    the pool behind the scheduler's back, as a leak would) leave a request that fits the pool
    unschedulable while nothing runs. No later step can free them, so instead of waiting
    forever it finishes with an error naming the free and needed blocks."""
    s = Scheduler(_config(budget=64, block_size=4), num_blocks=10)
    leaked = s.kv_cache_manager.pool.take(8)
    s.add_request(_req("r", 8, max_tokens=4))
    out = _run_until_done(s)
    assert out["r"].finish_reason == "error"
    assert "nothing else is running" in out["r"].error and "2 of 10 free" in out["r"].error
    # Once the blocks are back, the same request runs.
    s.kv_cache_manager.pool.give_back(leaked)
    s.add_request(_req("again", 8, max_tokens=4))
    assert _run_until_done(s)["again"].finish_reason == "length"


def test_watchdog_waits_while_a_running_request_can_still_free_blocks():
    """Not a stall: the second request waits for blocks the first one frees when it ends."""
    s = Scheduler(_config(budget=64, block_size=4), num_blocks=6)
    s.add_request(_req("first", 12, max_tokens=8))
    s.add_request(_req("second", 12, max_tokens=8))
    out = _run_until_done(s, steps=60)
    assert out["first"].finish_reason == "length" and out["second"].finish_reason == "length"
