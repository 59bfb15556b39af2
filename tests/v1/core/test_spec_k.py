# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The K policy on its own (pure Python): the batch-size schedule's ceiling; the adaptive K
keeps K with a head that is always accepted, drops to 0 with one that never is, probes again
after 8, 16, 32 ... steps at 0 and comes back when the probe is accepted; a request starts from
the engine-wide acceptance; the cost model interpolates what start-up measured."""

from __future__ import annotations

from vllm.config import SpeculativeConfig
from vllm.v1.core.sched.spec_k import PROBE_FIRST, SpecKPolicy, StepCostModel

K = 3
# A CPU-like curve: verifying a few more tokens costs little, a draft step 5% of a step.
COSTS = StepCostModel(
    tokens=[1, 4, 16, 64],
    verify_s=[1.0, 1.1, 1.5, 3.0],
    batch_sizes=[1, 16],
    draft_step_s=[0.05, 0.1],
)


def _policy(costs=COSTS, **kw) -> SpecKPolicy:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, **kw)
    return SpecKPolicy(spec, costs)


def _run(policy: SpecKPolicy, rid: str, steps: int, accept) -> list[int]:
    """K chosen each step for one request whose step s accepts accept(s, k) of its k drafts."""
    ks = []
    for s in range(steps):
        k = policy.decide([rid], 1)[rid]
        ks.append(k)
        if k:
            policy.observe(rid, k, accept(s, k))
    return ks


def test_always_accepted_keeps_k():
    ks = _run(_policy(), "a", 40, lambda s, k: k)
    assert ks[5:] == [K] * 35


def test_never_accepted_drops_to_zero_and_probes_with_backoff():
    ks = _run(_policy(), "a", 200, lambda s, k: 0)
    first0 = ks.index(0)
    assert first0 <= 3
    probes = [i for i in range(first0, len(ks)) if ks[i] > 0]
    gaps = [b - a for a, b in zip([first0 - 1] + probes, probes)]
    assert gaps[:4] == [PROBE_FIRST, 2 * PROBE_FIRST, 4 * PROBE_FIRST, 8 * PROBE_FIRST]
    assert all(ks[p] == K for p in probes)
    assert sum(k > 0 for k in ks[first0:]) <= 5


def test_comes_back_when_the_text_turns_predictable():
    ks = _run(_policy(), "a", 120, lambda s, k: 0 if s < 30 else k)
    assert ks[25] == 0
    assert ks[-20:] == [K] * 20


def test_new_request_starts_from_the_engine_wide_acceptance():
    p = _policy()
    _run(p, "a", 60, lambda s, k: 0)
    assert p.decide(["b"], 1)["b"] == 0
    q = _policy()
    _run(q, "a", 60, lambda s, k: k)
    assert q.decide(["b"], 1)["b"] == K


def test_expensive_verify_drafts_less():
    """The first draft always accepted, the second never: one draft is worth it when verifying
    is nearly free, none when each verified token costs as much as a step."""
    half = lambda s, k: 1
    cheap = _run(_policy(), "a", 40, half)
    dear = StepCostModel(tokens=[1, 64], verify_s=[1.0, 64.0], batch_sizes=[1], draft_step_s=[0.0])
    costly = _run(_policy(costs=dear), "a", 40, half)
    assert cheap[10:] == [1] * 30
    # 0 but for the occasional probe of the full K.
    assert set(costly[10:]) <= {0, K} and costly[10:].count(0) >= 27


def test_switched_off_and_the_batch_size_schedule():
    p = _policy(adaptive_num_speculative_tokens=False)
    assert _run(p, "a", 10, lambda s, k: 0) == [K] * 10
    p = _policy(
        num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 8, 1], [9, 64, 0]],
        adaptive_num_speculative_tokens=False,
    )
    assert p.decide(["a"], 1)["a"] == K
    assert set(p.decide([f"r{i}" for i in range(4)], 4).values()) == {1}
    assert set(p.decide([f"r{i}" for i in range(9)], 9).values()) == {0}
    # Without measured costs the adaptive K is off: the schedule alone decides.
    p = _policy(costs=None)
    assert _run(p, "a", 10, lambda s, k: 0) == [K] * 10


def test_cost_model_interpolates_and_extrapolates():
    assert COSTS.verify(1) == 1.0
    assert abs(COSTS.verify(10) - 1.3) < 1e-9
    assert abs(COSTS.verify(128) - 5.0) < 1e-9  # the last segment's slope
    assert abs(COSTS.draft_step(8) - (0.05 + 0.05 * 7 / 15)) < 1e-9


def test_measured_verify_times_are_fitted_by_a_line():
    from vllm.v1.engine.warmup import _fit_line

    xs = [1, 2, 4, 5, 10, 20]
    line = [2.0 + 0.5 * x for x in xs]
    assert all(abs(a - b) < 1e-9 for a, b in zip(_fit_line(xs, line), line))
    # One timing taken while the machine was busy does not make 4 tokens dearer than 5.
    noisy = list(line)
    noisy[2] *= 2
    fit = _fit_line(xs, noisy)
    assert fit == sorted(fit) and fit[2] < noisy[2]
    # Never a negative slope, whatever the noise.
    down = _fit_line(xs, [5.0, 4.0, 3.0, 2.0, 1.5, 1.0])
    assert down == sorted(down)


def test_unseen_positions_are_explored_when_all_drafts_are_accepted():
    """A draft step costing half a plain step: with every draft accepted K = 3 pays, which the
    policy only finds by trying position k + 1 while all k drafts are accepted (an unseen
    position is taken to be accepted like the one before it)."""
    dear_drafts = StepCostModel(
        tokens=[1, 2, 4, 8, 16],
        verify_s=[4.23, 4.37, 4.65, 5.21, 6.33],
        batch_sizes=[1, 4],
        draft_step_s=[1.94, 1.94],
    )
    ks = _run(_policy(costs=dear_drafts), "a", 30, lambda s, k: k)
    assert ks[6:] == [K] * 24


def test_measured_verify_times_are_made_monotone():
    from vllm.v1.engine.warmup import _monotone

    # A real jump (one row: matrix-vector; two rows: a GEMM) is kept.
    jump = [107.0, 238.0, 239.0, 240.0, 334.0]
    assert _monotone(jump) == jump
    # A timing inflated by a busy machine is averaged with the ones after it.
    fit = _monotone([229.0, 377.0, 521.0, 366.0, 436.0, 752.0])
    assert fit == sorted(fit) and fit[2] < 521.0 and fit[:2] == [229.0, 377.0]
    assert abs(sum(fit) - (229 + 377 + 521 + 366 + 436 + 752)) < 1e-6


def test_the_engine_wide_prior_outlives_one_requests_tail():
    """The last request of a batch is often the one accepting least (it took the most steps):
    its tail alone must not become every new request's prior. 300 steps of requests accepting
    nearly everything, then 15 of one accepting nothing: a new request still drafts."""
    p = _policy()
    for s in range(300):
        p.decide([f"r{s % 6}"], 1)
        p.observe(f"r{s % 6}", K, K if s % 10 else 0)
    for _ in range(15):
        if p.decide(["slow"], 1)["slow"]:
            p.observe("slow", K, 0)
    assert p.alphas("new")[0] > 0.6
    assert p.decide(["new"], 1)["new"] > 0


def test_requests_idle_together_probe_one_per_step():
    """Eight requests that went idle in the same step are due to probe in the same step: they
    take turns (a step verifying everyone's whole K costs several plain steps)."""
    p = _policy()
    rids = [f"r{i}" for i in range(8)]
    steps = []
    for _ in range(60):
        ks = p.decide(rids, len(rids))
        steps.append(sum(k > 0 for k in ks.values()))
        for r in rids:
            if ks[r]:
                p.observe(r, ks[r], 0)
    probe_steps = [n for n in steps[10:] if n]
    assert len(probe_steps) >= 8
    assert max(probe_steps) == 1


def test_no_probe_that_only_pays_at_perfect_acceptance():
    """Each verified row costs 0.83 of a token's worth (a large batch on a CPU): every draft
    accepted would still pay, 80% of them would not - a probe there only ever loses, so none
    is made; where a row costs half a token's worth the probes come back."""
    dear_rows = StepCostModel(
        tokens=[1, 64], verify_s=[1.0, 1.0 + 63 * 0.8333], batch_sizes=[1], draft_step_s=[0.0]
    )
    never = lambda s, k: 0
    assert _run(_policy(costs=dear_rows), "a", 100, never) == [0] * 100
    cheaper = StepCostModel(
        tokens=[1, 64], verify_s=[1.0, 1.0 + 63 * 0.5], batch_sizes=[1], draft_step_s=[0.0]
    )
    ks = _run(_policy(costs=cheaper), "a", 100, never)
    assert [k for k in ks[ks.index(0) :] if k] == [K] * 3, ks
