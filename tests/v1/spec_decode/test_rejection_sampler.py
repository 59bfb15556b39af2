# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Rejection sampling: greedy prefix matching; the output distribution of sampled verification
equals the target's (chi-square over many seeded draws on a small vocabulary) with argmax and
with sampled drafts; acceptance rates equal their closed forms; and the emitted tokens never
depend on the drafts (each is the target's keyed sample)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.worker.gpu.sample.sampler import SamplingArrays
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import rejection_sample_tokens

V = 5
N = 12000
# Chi-square critical value, 4 degrees of freedom, alpha = 1e-3.
CHI2_CRIT_DF4 = 18.467
P0 = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08])
P1 = torch.tensor([0.05, 0.10, 0.50, 0.05, 0.30])
Q0 = torch.tensor([0.10, 0.50, 0.05, 0.30, 0.05])
Q1 = torch.tensor([0.30, 0.30, 0.10, 0.20, 0.10])


def _verify(target_tokens, cu_num_logits, drafts) -> list[list[int]]:
    """rejection_sample_tokens' output as one token list per request."""
    sampled, num_sampled = rejection_sample_tokens(target_tokens, cu_num_logits, drafts)
    return [row[:n].tolist() for row, n in zip(sampled, num_sampled)]


def _chi2(samples: np.ndarray, p: torch.Tensor) -> float:
    counts = np.bincount(samples, minlength=V).astype(np.float64)
    expected = p.double().numpy() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def _sampling(n: int, seeds: np.ndarray) -> SamplingArrays:
    return SamplingArrays(
        np.ones(n, np.float32),
        np.zeros(n, np.int64),
        np.ones(n, np.float32),
        np.zeros(n, np.float32),
        seeds,
    )


def _run(num_drafts: int, drafts_kind: str, seed0: int = 0, n: int = N):
    """n requests with num_drafts drafts each; target rows P0, P1 (, bonus row P0).

    drafts_kind: "argmax" (greedy drafts of Q0, Q1), "sampled" (drawn from Q0, Q1 the way the
    engine's probabilistic drafter draws: the target sampler's keyed noise), or "independent"
    (drawn from Q0, Q1 with unrelated randomness)."""
    rows_p = [P0, P1, P0][: num_drafts + 1]
    rows_q = [Q0, Q1][:num_drafts]
    per = num_drafts + 1
    target = torch.stack(rows_p * n)  # [n * per, V]
    seeds = np.arange(n, dtype=np.int64) + 1000 * seed0
    positions = np.tile(np.arange(per, dtype=np.int64) + 11, n)
    sampling = _sampling(n * per, np.repeat(seeds, per))
    target_tokens = sampling.sample(target.log(), positions).numpy()
    drafts = np.full(n * per, -1, dtype=np.int64)
    rng = np.random.default_rng(seed0)
    for j, q in enumerate(rows_q):
        if drafts_kind == "argmax":
            drafts[j::per] = int(q.argmax())
        elif drafts_kind == "sampled":
            s = _sampling(n, seeds)
            drafts[j::per] = s.sample(q.log().expand(n, V), positions[j::per]).numpy()
        else:
            qd = q.double().numpy()
            drafts[j::per] = rng.choice(V, size=n, p=qd / qd.sum())
    out = _verify(target_tokens, np.arange(n + 1, dtype=np.int64) * per, drafts)
    return out, drafts, target_tokens


KINDS = ["argmax", "sampled", "independent"]


@pytest.mark.parametrize("kind", KINDS)
def test_first_token_follows_target_distribution(kind):
    out, drafts, _ = _run(1, kind)
    first = np.array([t[0] for t in out])
    assert _chi2(first, P0) < CHI2_CRIT_DF4
    if kind != "argmax":
        # Power check: the drafts are far from P0, so the statistic would notice a sampler
        # that just kept them.
        assert _chi2(drafts[0::2], P0) > 10 * CHI2_CRIT_DF4
    # Both acceptance and rejection happen, and accepted outputs are longer.
    lengths = np.array([len(t) for t in out])
    assert set(lengths.tolist()) == {1, 2}


@pytest.mark.parametrize("kind", KINDS)
def test_second_token_follows_target_given_first_accepted(kind):
    out, _, _ = _run(2, kind, seed0=1)
    second = np.array([t[1] for t in out if len(t) >= 2])
    assert len(second) > N // 10
    assert _chi2(second, P1) < CHI2_CRIT_DF4
    first = np.array([t[0] for t in out])
    assert _chi2(first, P0) < CHI2_CRIT_DF4


def _gumbel_coupling_match(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax p/E == argmax q/E) for shared Exp(1) noise E."""
    p, q = p.double(), q.double()
    return float(sum(1.0 / torch.maximum(p / p[i], q / q[i]).sum() for i in range(len(p))))


@pytest.mark.parametrize("kind", KINDS)
def test_acceptance_rate_matches_theory(kind):
    out, drafts, _ = _run(1, kind, seed0=2)
    rate = float(np.mean([len(t) == 2 for t in out]))
    independent = float((P0 * Q0).sum())
    if kind == "argmax":
        expected = float(P0[int(drafts[0])])  # as the classic min(1, p/q) test
    elif kind == "sampled":
        expected = _gumbel_coupling_match(P0, Q0)
        # The coupling is what the engine's drafter buys: far above unrelated draws.
        assert expected - independent > 0.1
    else:
        expected = independent
    sigma = np.sqrt(expected * (1 - expected) / N)
    assert abs(rate - expected) < 4 * sigma, (rate, expected)


def test_sampled_drafts_from_the_target_distribution_are_always_accepted():
    """q == p: the drafter's keyed draw is the target's own, so every draft matches."""
    n = 500
    seeds = np.arange(n, dtype=np.int64)
    positions = np.tile(np.array([11, 12]), n)
    s = _sampling(2 * n, np.repeat(seeds, 2))
    target_tokens = s.sample(torch.stack([P0, P1] * n).log(), positions).numpy()
    drafts = np.full(2 * n, -1, dtype=np.int64)
    drafts[0::2] = _sampling(n, seeds).sample(P0.log().expand(n, V), positions[0::2]).numpy()
    out = _verify(target_tokens, np.arange(n + 1) * 2, drafts)
    assert all(len(t) == 2 for t in out)


def test_emitted_tokens_do_not_depend_on_the_drafts():
    """Whatever was drafted, request r emits a prefix of its rows' keyed target samples."""
    runs = [_run(2, kind, seed0=5, n=2000) for kind in KINDS]
    target_tokens = runs[0][2]
    assert all(np.array_equal(r[2], target_tokens) for r in runs)
    for out, _, _ in runs:
        for r, toks in enumerate(out):
            assert toks == target_tokens[3 * r : 3 * r + len(toks)].tolist()


def test_seeded_draws_are_reproducible():
    a, _, _ = _run(2, "sampled", seed0=3, n=1000)
    b, _, _ = _run(2, "sampled", seed0=3, n=1000)
    assert a == b


def test_greedy_prefix_match_and_bonus():
    # Three requests: all drafts accepted (bonus), first draft rejected, no drafts.
    target_tokens = np.array([5, 6, 7, 1, 9, 4])
    cu = np.array([0, 3, 5, 6])
    drafts = np.array([5, 6, -1, 2, -1, -1])
    assert _verify(target_tokens, cu, drafts) == [[5, 6, 7], [1], [4]]
    # Mismatch in the middle: the target's token replaces the first wrong draft.
    out = _verify(np.array([3, 8, 2, 0]), np.array([0, 4]), np.array([3, 4, 2, -1]))
    assert out == [[3, 8]]
    # A request without logits rows (a non-final prefill chunk) emits nothing.
    assert _verify(np.array([3]), np.array([0, 0, 1]), np.array([-1])) == [
        [],
        [3],
    ]
    # The arrays themselves: fixed width, PAD_TOKEN_ID after each request's tokens.
    sampled, num_sampled = rejection_sample_tokens(target_tokens, cu, drafts, width=4)
    assert num_sampled.tolist() == [3, 1, 1]
    assert sampled.tolist() == [[5, 6, 7, -1], [1, -1, -1, -1], [4, -1, -1, -1]]
