# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The K policy for draft trees (pure Python): a request verifies a prefix of its tree's nodes,
chosen from per-node acceptance estimates; a chain's decisions are exactly as recorded (so a
change to the tree code cannot move them unseen)."""

from __future__ import annotations

import random

from vllm.config import SpeculativeConfig
from vllm.v1.core.sched.spec_k import (
    PROBE_FIRST,
    SpecKPolicy,
    StepCostModel,
    _DraftCost,
    draft_passes,
    draft_rows_per_request,
    pooled_blocks,
)

COSTS = StepCostModel(
    tokens=[1, 4, 16, 64],
    verify_s=[1.0, 1.1, 1.5, 3.0],
    batch_sizes=[1, 16],
    draft_step_s=[0.05, 0.1],
)
# Nodes: 0 = (0,), 1 = (1,) the root's second child, 2 = (0, 0), 3 = (0, 0, 0).
TREE = "[(0,), (1,), (0, 0), (0, 0, 0)]"

# The ks the chain policy chose for the scripted run in _chain_run (recorded before per-node
# estimates existed; again when the engine-wide prior got its longer memory and probes began
# to take turns): steps separated by ";", one k per request of the step's batch.
CHAIN_KS = (
    "2;5,5;5,5,5;5,5,5,5;2,2,2,2,2;4,4,4,2,4,4;5;5,5;5,5,5;5,5,4,2;5,5,4,2,2;5,2,4,1,1,3;5;5,5;5"
    ",5,4;5,5,4,1;5,5,4,1,1;5,5,4,1,0,5;5;5,5;5,5,5;5,5,4,1;5,5,4,1,0;5,5,4,1,0,5;5;5,5;5,5,4;5,"
    "5,4,1;4,4,4,1,0;2,2,2,1,0,2;5;5,5;5,5,4;4,4,4,1;4,4,4,1,0;3,3,3,1,0,3;5;5,5;5,5,4;4,4,4,1;3"
    ",3,3,1,5;3,3,2,1,0,3;5;5,5;5,5,3;5,5,3,1;4,4,3,1,0;3,3,2,1,0,3;5;5,5;5,5,4;5,5,3,1;3,3,3,1,"
    "0;3,3,3,1,0,3;5;5,5;5,5,4;5,5,4,1;5,5,3,1,0;3,3,3,1,0,3;5;5,5;5,5,4;5,5,3,1;5,5,3,1,0;3,3,3"
    ",1,0,3;5;5,5;5,5,4;5,5,4,1;5,5,3,1,0;3,3,3,1,0,3;5;5,5;5,5,4;5,5,3,1;4,4,3,1,0;3,3,3,1,0,3;"
    "5;5,5;5,5,4;5,5,3,1;4,4,3,1,0;3,3,3,1,0,3;5;5,5;5,5,3;5,5,3,1;5,5,3,1,5;3,3,3,1,0,3;5;5,5;5"
    ",5,3;4,4,3,1;3,3,3,1,0;2,2,2,1,0,2;5;5,5;5,5,3;5,5,3,1;3,3,3,1,0;2,2,2,1,0,2;5;5,5;5,5,3;4,"
    "4,3,1;3,3,3,1,0;2,2,2,1,0,2;5;5,5;4,4,3;4,4,3,1;4,4,3,1,0;2,2,2,1,0,2;5;5,5;5,5,3;5,5,3,1;4"
    ",4,3,1,0;3,3,2,1,0,3;5;5,5;5,5,3;5,5,3,1;5,5,3,1,0;4,4,2,1,0,4;5;5,5;5,5,3;5,5,3,1;4,4,3,1,"
    "0;3,3,2,1,0,3;5;5,5;5,5,2;5,5,2,1;4,4,2,1,0;4,4,2,1,0,4;5;5,5;5,5,2;4,4,2,1;4,4,2,1,0;3,3,2"
    ",1,0,3;5;5,5;5,5,2;5,5,2,1;4,4,2,1,0;3,3,2,1,0,3"
)


def _chain_run() -> list[list[int]]:
    rng = random.Random(7)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    p = SpecKPolicy(spec, COSTS)
    rids = [f"r{i}" for i in range(6)]
    q = [0.9, 0.7, 0.5, 0.3, 0.1, 0.8]
    out = []
    for s in range(150):
        batch = rids[: 1 + s % 6]
        ks = p.decide(batch, len(batch))
        out.append([ks[r] for r in batch])
        for r in batch:
            k = ks[r]
            if k:
                a = 0
                while a < k and rng.random() < q[int(r[1:])]:
                    a += 1
                p.observe(r, k, a)
    return out


def test_chain_decisions_are_unchanged():
    got = ";".join(",".join(map(str, s)) for s in _chain_run())
    assert got == "".join(CHAIN_KS)


def _tree_policy(costs=COSTS, **tree) -> SpecKPolicy:
    d = {"method": "eagle", "model": "draft", **(tree or {"speculative_token_tree": TREE})}
    return SpecKPolicy(SpeculativeConfig.from_dict(d), costs)


def _run_tree(p: SpecKPolicy, rid: str, steps: int, path_of) -> list[int]:
    """k chosen each step for one request whose step s (verifying k nodes) accepts the
    path path_of(s, k)."""
    ks = []
    for s in range(steps):
        k = p.decide([rid], 1)[rid]
        ks.append(k)
        if k:
            path = path_of(s, k)
            p.observe(rid, k, len(path), path)
    return ks


def _first_branch(s: int, k: int) -> list[int]:
    """Node 0 and its child 2 always accepted; the root's second child (1) and the third
    level (3) never."""
    return [j for j in (0, 2) if j < k]


def test_draft_passes_per_prefix():
    assert draft_passes(SpeculativeConfig(method="ngram", num_speculative_tokens=3)) is None
    assert _tree_policy().passes == [0, 1, 1, 2, 3]
    dyn = _tree_policy(num_tree_nodes=6, tree_top_k=2, tree_max_depth=3)
    # The root's pass, then one expansion per tree_top_k nodes, at most max_depth - 1.
    assert dyn.passes == [0, 2, 2, 3, 3, 3, 3]


def test_gains_are_pooled_into_non_increasing_blocks():
    assert pooled_blocks([1.0, 0.0, 1.0, 0.0]) == [
        (1.0, 0, 1, 1.0),
        (0.5, 1, 3, 1.0),
        (0.0, 3, 4, 0.0),
    ]
    blocks = pooled_blocks([0.9, 0.2, 0.8, 0.7])
    assert [(f, e) for _, f, e, _ in blocks] == [(0, 1), (1, 4)]
    assert abs(blocks[1][0] - 1.7 / 3) < 1e-12
    assert pooled_blocks([0.5, 0.5, 0.25]) == [
        (0.5, 0, 1, 0.5),
        (0.5, 1, 2, 0.5),
        (0.25, 2, 3, 0.25),
    ]


def test_a_tree_step_updates_exactly_its_path_nodes():
    p = _tree_policy()
    p.observe("a", 4, 2, [0, 2])
    for stats in (p._req("a").stats, p._global):
        assert stats.reached == [1.0, 1.0, 1.0, 1.0]
        assert stats.accepted == [1.0, 0.0, 1.0, 0.0]
    p.observe("a", 2, 1, [0])
    st = p._req("a").stats
    # Nodes past the prefix are not observed; what was seen of them ages.
    assert st.reached == [1.95, 1.95, 0.95, 0.95]
    assert st.accepted == [1.95, 0.0, 0.95, 0.0]
    # Without a path (a chain verified in tree order): its first num_accepted nodes.
    p.observe("b", 3, 2, None)
    assert p._req("b").stats.accepted == [1.0, 1.0, 0.0, 0.0]


def test_a_bad_sibling_is_skipped_to_reach_the_deeper_node():
    """Node 1 (the root's second child) is never accepted, node 2 (the first child's child)
    always: with cheap rows the policy verifies 3 nodes - paying for node 1 to reach node 2 -
    and not node 3, which is never accepted."""
    ks = _run_tree(_tree_policy(), "a", 40, _first_branch)
    # Node 3 is tried again now and then (what was seen of it ages back to its prior).
    assert min(ks[10:]) == 3 and ks[10:].count(3) >= 25, ks


def test_a_probe_is_as_long_as_perfect_drafts_would_pay():
    """A tree that is never accepted drops to 0 nodes and is probed after 8, 16, 32 steps at 0
    with what would pay were every node accepted: where verifying is cheap the whole tree;
    where every verified token costs as much as a step, nothing (not even a perfect node
    pays); a chain whose second draft costs more than a step, one draft."""
    never = lambda s, k: []
    ks = _run_tree(_tree_policy(), "a", 70, never)
    first0 = ks.index(0)
    probes = [i for i in range(first0, len(ks)) if ks[i]]
    assert [ks[i] for i in probes] == [4] * len(probes)
    gaps = [b - a for a, b in zip([first0 - 1] + probes, probes)]
    assert gaps[:3] == [PROBE_FIRST, 2 * PROBE_FIRST, 4 * PROBE_FIRST], (first0, probes)

    dear = StepCostModel(tokens=[1, 64], verify_s=[1.0, 64.0], batch_sizes=[1], draft_step_s=[0.0])
    assert _run_tree(_tree_policy(costs=dear), "a", 70, _first_branch) == [0] * 70

    one = StepCostModel(
        tokens=[1, 2, 64], verify_s=[1.0, 1.6, 100.0], batch_sizes=[1], draft_step_s=[0.0]
    )
    chain = SpecKPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=3), one)
    ks = []
    for _ in range(40):
        k = chain.decide(["c"], 1)["c"]
        ks.append(k)
        if k:
            chain.observe("c", k, 0)
    assert 0 in ks and set(ks) == {0, 1}, ks


def test_dynamic_tree_prefix_follows_the_node_estimates():
    """A dynamic tree whose first 3 nodes (most probable first) are accepted often and the
    rest never: the prefix stops after them."""
    p = _tree_policy(num_tree_nodes=6, tree_top_k=2, tree_max_depth=4)
    ks = _run_tree(p, "a", 40, lambda s, k: [j for j in (0, 1, 2) if j < k and (s + j) % 4])
    assert min(ks[10:]) == 3 and ks[10:].count(3) >= 25, ks


TREE6 = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"


def test_an_early_miss_does_not_keep_a_good_branch_out():
    """tree6's first branch (nodes 0, 2, 4, 5) accepted whenever verified after one early step
    that accepted nothing, its siblings (1, 3) never: the deeper nodes get back into the prefix
    - their estimates age back to a prior taken from their parent and the root's child of their
    rank, not from the weak sibling listed before them."""
    p = _tree_policy(speculative_token_tree=TREE6)

    def path(s: int, k: int) -> list[int]:
        return [] if s == 0 else [j for j in (0, 2, 4, 5) if j < k]

    ks = _run_tree(p, "a", 60, path)
    assert ks[0] >= 3  # the first step verifies the first branch's second node
    assert min(ks[30:]) >= 5, ks


def test_a_draft_pass_is_priced_at_the_requests_it_runs():
    """Eight requests, one whose drafts are always accepted, seven never. A draft pass at the
    whole batch costs 0.24 of a step, at one request 0.01. Where the worker drafts each
    request only as deep as its own count (EAGLE3), the good request's three passes cost 0.03
    and it drafts 3; priced at the whole batch (a proposer that runs every request's rows)
    they would cost 0.72 and nobody drafts."""
    costs = StepCostModel(
        tokens=[1, 64], verify_s=[1.0, 1.3], batch_sizes=[1, 16], draft_step_s=[0.01, 0.5]
    )
    eagle3 = {"method": "eagle3", "model": "draft", "num_speculative_tokens": 3}
    # The per-position estimate (the draft's confidence, when on, shapes EAGLE3 chains instead).
    eagle3["adaptive_draft_confidence"] = False
    per_row = SpecKPolicy(SpeculativeConfig.from_dict(eagle3), costs)
    whole = SpecKPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=3), costs)
    assert draft_rows_per_request(per_row.spec) and not draft_rows_per_request(whole.spec)
    assert draft_rows_per_request(_tree_policy().spec)
    rids = [f"r{i}" for i in range(8)]
    for p in (per_row, whole):
        for _ in range(20):
            for r in rids:
                p.observe(r, 3, 3 if r == "r0" else 0)
    assert per_row.decide(rids, 8) == {"r0": 3, **dict.fromkeys(rids[1:], 0)}
    assert whole.decide(rids, 8) == dict.fromkeys(rids, 0)


def test_draft_cost_sums_each_pass_at_its_rows():
    """r0 grows to 3 passes, r1 to 1 then 2: passes 1 and 2 run two requests, pass 3 one."""
    ds = COSTS.draft_step
    per_row, whole = _DraftCost(COSTS, 8, True), _DraftCost(COSTS, 8, False)
    for old, new in [(0, 3), (0, 1), (1, 2)]:
        for d in (per_row, whole):
            expect = d.grown(old, new)
            d.grow(old, new)
            assert d.total == expect
    assert abs(per_row.total - (2 * ds(2) + ds(1))) < 1e-12
    assert abs(whole.total - 3 * ds(8)) < 1e-12
