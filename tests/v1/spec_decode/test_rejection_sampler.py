# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Rejection sampling: greedy prefix matching, and the output distribution of probabilistic
verification equals the target's (chi-square over many seeded draws on a small vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.worker.gpu.sample.sampler import sample_tokens
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import rejection_sample_tokens

V = 5
N = 12000
# Chi-square critical value, 4 degrees of freedom, alpha = 1e-3.
CHI2_CRIT_DF4 = 18.467
P0 = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08])
P1 = torch.tensor([0.05, 0.10, 0.50, 0.05, 0.30])
Q0 = torch.tensor([0.10, 0.50, 0.05, 0.30, 0.05])
Q1 = torch.tensor([0.30, 0.30, 0.10, 0.20, 0.10])


def _chi2(samples: np.ndarray, p: torch.Tensor) -> float:
    counts = np.bincount(samples, minlength=V).astype(np.float64)
    expected = p.double().numpy() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def _run(num_drafts: int, probabilistic: bool, seed0: int = 0, n: int = N):
    """n requests with num_drafts drafts each; target rows P0, P1 (, bonus row P0)."""
    rows_p = [P0, P1, P0][: num_drafts + 1]
    rows_q = [Q0, Q1][:num_drafts]
    per = num_drafts + 1
    target = torch.stack(rows_p * n)  # [n * per, V]
    rng = np.random.default_rng(seed0)
    drafts = np.full(n * per, -1, dtype=np.int64)
    for j, q in enumerate(rows_q):
        if probabilistic:
            qd = q.double().numpy()
            drafts[j::per] = rng.choice(V, size=n, p=qd / qd.sum())
        else:
            drafts[j::per] = int(q.argmax())
    q_rows = torch.zeros_like(target)
    for j, q in enumerate(rows_q):
        q_rows[j::per] = q
    seeds = np.arange(n, dtype=np.int64) + 1000 * seed0
    positions = np.tile(np.arange(per, dtype=np.int64) + 11, n)
    row_seeds = np.repeat(seeds, per)
    # The target's own sample of every row (the bonus row's token), keyed like the engine's.
    target_tokens = sample_tokens(
        target.log(),
        np.ones(n * per, np.float32),
        np.zeros(n * per, np.int64),
        np.ones(n * per, np.float32),
        np.zeros(n * per, np.float32),
        row_seeds,
        positions,
    ).numpy()
    out = rejection_sample_tokens(
        target,
        target_tokens,
        np.arange(n + 1, dtype=np.int64) * per,
        drafts,
        q_rows if probabilistic else None,
        np.zeros(n, dtype=bool),
        seeds,
        positions,
    )
    return out, drafts


@pytest.mark.parametrize("probabilistic", [False, True], ids=["onehot_q", "sampled_q"])
def test_first_token_follows_target_distribution(probabilistic):
    out, drafts = _run(1, probabilistic)
    first = np.array([t[0] for t in out])
    assert _chi2(first, P0) < CHI2_CRIT_DF4
    # Power check: the draft's own tokens are far from P0, so the statistic would notice a
    # sampler that just kept the drafts.
    assert _chi2(drafts[0::2], P0) > 10 * CHI2_CRIT_DF4
    # Both acceptance and rejection happen, and accepted outputs are longer.
    lengths = np.array([len(t) for t in out])
    assert set(lengths.tolist()) == {1, 2}


@pytest.mark.parametrize("probabilistic", [False, True], ids=["onehot_q", "sampled_q"])
def test_second_token_follows_target_given_first_accepted(probabilistic):
    out, _ = _run(2, probabilistic, seed0=1)
    second = np.array([t[1] for t in out if len(t) >= 2])
    assert len(second) > N // 10
    assert _chi2(second, P1) < CHI2_CRIT_DF4
    first = np.array([t[0] for t in out])
    assert _chi2(first, P0) < CHI2_CRIT_DF4


def test_acceptance_rate_matches_theory():
    # One-hot q at x: accepted with probability p(x).
    out, drafts = _run(1, probabilistic=False, seed0=2)
    x = int(drafts[0])
    rate = np.mean([len(t) == 2 for t in out])
    assert abs(rate - float(P0[x])) < 4 * np.sqrt(float(P0[x]) * (1 - float(P0[x])) / N)


def test_seeded_draws_are_reproducible():
    a, _ = _run(2, probabilistic=True, seed0=3, n=1000)
    b, _ = _run(2, probabilistic=True, seed0=3, n=1000)
    assert a == b


def test_greedy_prefix_match_and_bonus():
    # Three requests: all drafts accepted (bonus), first draft rejected, no drafts.
    target_tokens = np.array([5, 6, 7, 1, 9, 4])
    cu = np.array([0, 3, 5, 6])
    drafts = np.array([5, 6, -1, 2, -1, -1])
    out = rejection_sample_tokens(
        None,
        target_tokens,
        cu,
        drafts,
        None,
        np.ones(3, bool),
        np.zeros(3, np.int64),
        np.arange(6),
    )
    assert out == [[5, 6, 7], [1], [4]]
    # Mismatch in the middle: the target's token replaces the first wrong draft.
    out = rejection_sample_tokens(
        None,
        np.array([3, 8, 2, 0]),
        np.array([0, 4]),
        np.array([3, 4, 2, -1]),
        None,
        np.ones(1, bool),
        np.zeros(1, np.int64),
        np.arange(4),
    )
    assert out == [[3, 8]]
