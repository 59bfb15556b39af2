# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The scheduler's half of adaptive_draft_confidence on its own (pure Python): the calibration
learns what the drafts' confidence is worth, the allocation verifies the drafts that pay across
the batch (a request's drafts a prefix, confident ones first), the floor rises where rows cost
more, and the scheduler cuts the drafts it schedules by them and learns from what it verified."""

from __future__ import annotations

import pytest

from tests.v1.core.utils import make_request, sched_config
from vllm.config import SpeculativeConfig
from vllm.v1.core.sched.draft_confidence import (
    BINS,
    EXPLORE_GAIN,
    EXPLORE_SEEN,
    Calibration,
    DraftConfidence,
    uses_draft_confidence,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.spec_k import SpecKPolicy, StepCostModel
from vllm.v1.outputs import ModelRunnerOutput

# Batch 8 on a CPU: 8 rows cost what 1 does, the next 8 another 25% (a row: 0.03 of a step, a
# token 0.125), a draft pass 3% of a step.
COSTS = StepCostModel(
    tokens=[1, 8, 16, 32],
    verify_s=[1.0, 1.0, 1.25, 2.0],
    batch_sizes=[1, 8],
    draft_step_s=[0.03] * 2,
)
EAGLE3 = {"method": "eagle3", "model": "draft", "num_speculative_tokens": 3}


def test_only_adaptive_eagle_chains_and_dynamic_trees_use_it():
    assert uses_draft_confidence(SpeculativeConfig.from_dict(EAGLE3))
    head = {"method": "eagle3", "model": "draft"}
    assert uses_draft_confidence(SpeculativeConfig.from_dict({**head, "num_tree_nodes": 4}))
    for cfg in (
        {**EAGLE3, "adaptive_draft_confidence": False},
        {**EAGLE3, "adaptive_num_speculative_tokens": False},
        {**head, "speculative_token_tree": "[(0,), (1,), (0, 0)]"},
        {"method": "mtp", "num_tree_nodes": 4},
    ):
        assert not uses_draft_confidence(SpeculativeConfig.from_dict(cfg))
    assert not uses_draft_confidence(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    with pytest.raises(ValueError, match="adaptive_draft_confidence"):
        SpeculativeConfig.from_dict({**EAGLE3, "adaptive_draft_confidence": "yes"})


def _learned(cal: Calibration) -> Calibration:
    """Every bin explored, each accepted as often as its confidence says."""
    for b in range(BINS):
        cal.seen[b] = EXPLORE_SEEN
        cal.hits[b] = EXPLORE_SEEN * (b + 0.5) / BINS
    cal._table = None
    return cal


def _explored(dc: DraftConfidence) -> DraftConfidence:
    _learned(dc.greedy)
    _learned(dc.sampled)
    return dc


def test_calibration_explores_then_learns_what_the_confidence_is_worth():
    # A bin nothing was verified in yet is explored: priced at least EXPLORE_GAIN.
    fresh = Calibration()
    assert fresh.gain(0.31) == EXPLORE_GAIN and fresh.gain(0.81) == pytest.approx(0.825)
    low = Calibration()
    for _ in range(int(EXPLORE_SEEN) + 2):
        low.observe([0.31], 0)
    assert low.gain(0.31) < EXPLORE_GAIN / 2  # explored: its own evidence prices it now
    for _ in range(200):  # drafts at 0.3 never accepted: the prior gives way to the evidence
        low.observe([0.31], 0)
    assert low.gain(0.31) < 0.05
    cal = _learned(Calibration())
    assert cal.gain(0.31) == pytest.approx(0.325)  # accepted as often as c says
    # An underconfident head: drafts at 0.3 accepted 80% of the time.
    for i in range(400):
        cal.observe([0.31], 1 if i % 5 else 0)
    assert cal.gain(0.31) == pytest.approx(0.8, abs=0.08)  # (pooled with the bins above)
    # Non-decreasing in the confidence: every bin above is worth at least as much.
    table = cal.table()
    assert all(a <= b for a, b in zip(table, table[1:]))
    assert cal.gain(0.5) >= cal.gain(0.31)
    assert cal.raw(0.7) <= 0.3  # the lowest confidence worth 0.7 is in that bin or below
    assert cal.raw(2.0) == 1.0


def test_a_verified_chain_counts_each_draft_reached_through():
    cal = Calibration()
    cal.observe([0.96, 0.55, 0.12], 2)  # drafts 0 and 1 accepted, 2 rejected
    b = lambda c: int(c * BINS)
    assert (cal.seen[b(0.96)], cal.hits[b(0.96)]) == (1.0, 1.0)
    assert (cal.seen[b(0.55)], cal.hits[b(0.55)]) == (1.0, 1.0)
    assert (cal.seen[b(0.12)], cal.hits[b(0.12)]) == (1.0, 0.0)


def test_a_tree_counts_the_nodes_on_its_accepted_path():
    """A dynamic tree's nodes, most probable first: node 1 (a sibling of node 0) was on the
    accepted path, nodes 0 and 2 were not."""
    cal = Calibration()
    cal.observe([0.55, 0.3, 0.12], 1, path=[1])
    b = lambda c: int(c * BINS)
    assert [cal.hits[b(c)] for c in (0.55, 0.3, 0.12)] == [0.0, 1.0, 0.0]
    assert [cal.seen[b(c)] for c in (0.55, 0.3, 0.12)] == [1.0, 1.0, 1.0]


def test_allocation_verifies_the_confident_drafts_of_the_batch():
    dc = _explored(DraftConfidence())
    reqs = {
        "sure": ([0.97, 0.9, 0.8], True),
        "unsure": ([0.1, 0.05, 0.01], True),
        "half": ([0.6, 0.15, 0.1], True),
    }
    # 8 requests: 5 more with no drafts; rows past 8 cost 0.03 of a step, a token is worth 1/8.
    ks = dc.allocate(reqs, 8, COSTS)
    assert ks == {"sure": 3, "unsure": 0, "half": 1}
    # Where rows cost nothing, every draft that might be accepted is verified.
    flat = StepCostModel([1, 64], [1.0, 1.0], [1], [0.0])
    assert dc.allocate(reqs, 8, flat) == {"sure": 3, "unsure": 3, "half": 3}


def test_a_requests_drafts_are_verified_as_a_prefix():
    """A later draft is never worth more than an earlier one (the product only falls, and a
    miscalibrated bin above is capped), so no request verifies draft 1 without draft 0."""
    dc = _explored(DraftConfidence())
    for _ in range(300):  # drafts at 0.2 always accepted, at 0.6 never: the table is capped
        dc.greedy.observe([0.21], 1)
        dc.greedy.observe([0.61], 0)
    table = dc.greedy.table()
    assert all(a <= b for a, b in zip(table, table[1:]))  # the violators pooled
    assert dc.greedy.gain(0.61) == dc.greedy.gain(0.21) > 0.4
    ks = dc.allocate({"a": ([0.61, 0.21], True), "b": ([0.9, 0.05], True)}, 8, COSTS)
    assert ks == {"a": 2, "b": 1}


def test_greedy_and_sampled_requests_are_calibrated_apart():
    dc = _explored(DraftConfidence())
    dc.kept = {"g": [0.45], "s": [0.45]}
    for _ in range(300):
        dc.observe("g", 1, 1, greedy=True)
        dc.observe("s", 1, 0, greedy=False)
    assert dc.greedy.gain(0.45) > 0.9 and dc.sampled.gain(0.45) < 0.1
    ks = dc.allocate({"g": ([0.45], True), "s": ([0.45], False)}, 8, COSTS)
    assert ks == {"g": 1, "s": 0}


def test_the_floor_rises_where_rows_and_passes_cost_more():
    cheap = StepCostModel([1, 64], [1.0, 1.0], [1, 16], [0.01, 0.01])
    dc = _explored(DraftConfidence())
    row_cheap, pass_cheap = dc.floor(8, cheap)
    row_dear, pass_dear = dc.floor(8, COSTS)
    assert row_cheap == 0.0 and row_dear > 0.1
    assert pass_dear > pass_cheap > 0.0
    # At batch 8 a row costs 0.03 of a step and a token is worth 1.03 / 8 of one.
    assert dc.greedy.gain(row_dear) >= 0.03 / (1.03 / 8) - 1e-9


def _runner_out(so, drafts: dict[str, list[float]], token: int = 7) -> ModelRunnerOutput:
    ids = so.req_ids
    out = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[token] for _ in ids])
    out.num_draft_tokens = [len(drafts.get(r, [])) for r in ids]
    out.draft_confidences = [drafts.get(r, []) for r in ids]
    return out


def test_the_scheduler_verifies_what_the_confidence_pays_for_and_learns_from_it():
    cfg = sched_config(max_num_seqs=8, budget=64, max_model_len=256, k=3)
    cfg.speculative_config = SpeculativeConfig.from_dict(EAGLE3)
    sched = Scheduler(cfg, 256, 8, step_costs=COSTS)
    policy = sched.spec_k
    assert policy is not None and policy.confidence is not None
    _explored(policy.confidence)
    rids = [f"r{i}" for i in range(8)]
    for r in rids:  # the per-position policy lets every request draft all 3
        for _ in range(30):
            policy.observe(r, 3, 3)
    for i, r in enumerate(rids):
        sched.add_request(make_request(r, range(4 * i, 4 * i + 4), max_tokens=50))
    so = sched.schedule()
    assert so.draft_confidence_floor is not None
    k0 = policy.k_next("r0")  # what the per-position policy let r0 draft
    assert k0 >= 2
    confs = {"r0": [0.97, 0.9, 0.85], "r1": [0.08, 0.02, 0.01], "r2": [0.7, 0.2, 0.05]}
    sched.update_from_output(so, _runner_out(so, confs))
    so = sched.schedule()
    assert so.num_draft_tokens == {"r0": k0, "r2": 1}
    # r0 accepted 2 of its drafts, r2 its one: each verified draft's bin is counted.
    seen = list(policy.confidence.greedy.seen)
    out = _runner_out(so, {})
    out.sampled_token_ids[so.req_ids.index("r0")] = [7, 7, 7]
    out.sampled_token_ids[so.req_ids.index("r2")] = [7, 7]
    sched.update_from_output(so, out)
    grown = [b for b in range(BINS) if policy.confidence.greedy.seen[b] > seen[b]]
    assert grown == sorted({int(c * BINS) for c in [0.97, 0.9, 0.85][:k0] + [0.7]})


def test_position_policy_without_the_confidence_is_unchanged():
    """adaptive_draft_confidence off: no floor is sent and the drafts the worker kept are
    scheduled up to the K the per-position policy chose."""
    cfg = sched_config(max_num_seqs=8, budget=64, max_model_len=256, k=3)
    cfg.speculative_config = SpeculativeConfig.from_dict(
        {**EAGLE3, "adaptive_draft_confidence": False}
    )
    sched = Scheduler(cfg, 256, 8, step_costs=COSTS)
    assert sched.spec_k is not None and sched.spec_k.confidence is None
    sched.add_request(make_request("r0", range(4), max_tokens=50))
    so = sched.schedule()
    assert so.draft_confidence_floor is None
    sched.update_from_output(so, _runner_out(so, {"r0": [0.01, 0.01, 0.01]}))
    so = sched.schedule()
    assert so.num_draft_tokens == {"r0": 3}


def test_policy_prices_a_confident_request_like_the_position_policy():
    """The per-position policy still decides how deep each request may draft (and whether it
    drafts at all); the confidence only shapes what is drafted within that."""
    spec = SpeculativeConfig.from_dict(EAGLE3)
    p = SpecKPolicy(spec, COSTS)
    assert p.confidence is not None
    off = SpecKPolicy(
        SpeculativeConfig.from_dict({**EAGLE3, "adaptive_draft_confidence": False}), COSTS
    )
    rids = [f"r{i}" for i in range(8)]
    for pol in (p, off):
        for _ in range(30):
            for r in rids:
                pol.observe(r, 3, 3 if r == "r0" else 0)
    assert p.decide(rids, 8) == off.decide(rids, 8)
