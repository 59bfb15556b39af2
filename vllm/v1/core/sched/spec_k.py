# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""How many drafts each request verifies next step (pure Python, no torch).

The ceiling is speculative_config.num_speculative_tokens_per_batch_size at the batch's size
(else num_speculative_tokens). Under it, with adaptive_num_speculative_tokens (the default),
each request's K is chosen every step so the batch's expected tokens per second is highest:

- acceptance: per request and draft position i, a running (decaying) estimate of the
  probability that draft i is accepted given drafts 0..i-1 were, with the engine-wide estimate
  for that position as its prior (a new request starts from what the head does elsewhere), and
  a position not observed anywhere yet taken to be accepted like the one before it;
  draft j adds prod_{i<j} alpha_i expected tokens;
- cost: the step time measured at start-up (StepCostModel): verify time by the step's total
  tokens, and the time of one more draft step by the batch size;
- drafts are added in order of expected gain while gain / added cost beats the batch's current
  tokens per second; a request left at K = 0 is probed again with the full K after a number of
  steps that doubles after each probe that does not pay (8 up to 128).

The output never depends on any of this: the verifier emits the target's own (keyed) sample at
every position whatever was drafted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from vllm.config import SpeculativeConfig

PRIOR_WEIGHT = 2.0  # pseudo-observations of the engine-wide estimate in a request's
DECAY = 0.95  # weight of older observations per new one (acceptance drifts with the text)
PROBE_FIRST, PROBE_MAX = 8, 128


@dataclass
class StepCostModel:
    """Step time measured at start-up (seconds): verify_s[i] for a step of tokens[i] scheduled
    tokens (drafting nothing), draft_step_s[i] for one more draft step at batch_sizes[i]."""

    tokens: list[int]
    verify_s: list[float]
    batch_sizes: list[int]
    draft_step_s: list[float]

    @staticmethod
    def _interp(xs: list[int], ys: list[float], x: float) -> float:
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-9), 0.0)

    def verify(self, num_tokens: int) -> float:
        return self._interp(self.tokens, self.verify_s, num_tokens)

    def draft_step(self, batch_size: int) -> float:
        return self._interp(self.batch_sizes, self.draft_step_s, batch_size)


@dataclass
class _Acceptance:
    """Decaying counts per draft position: reached (verified with every draft before it
    accepted) and accepted."""

    reached: list[float]
    accepted: list[float]

    @classmethod
    def zeros(cls, k: int) -> _Acceptance:
        return cls([0.0] * k, [0.0] * k)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        for i in range(min(num_drafts, num_accepted + 1)):
            self.reached[i] = self.reached[i] * DECAY + 1.0
            self.accepted[i] = self.accepted[i] * DECAY + (1.0 if i < num_accepted else 0.0)


@dataclass
class _ReqK:
    stats: _Acceptance
    k_next: int = 0
    idle_steps: int = 0
    probe_interval: int = PROBE_FIRST


@dataclass
class SpecKPolicy:
    spec: SpeculativeConfig
    costs: StepCostModel | None
    force_k: int | None = None
    """Every request's K regardless of the rest (the start-up measurement sets it)."""
    _reqs: dict[str, _ReqK] = field(default_factory=dict)
    _global: _Acceptance = field(init=False)

    def __post_init__(self) -> None:
        self.K = self.spec.num_speculative_tokens
        self._global = _Acceptance.zeros(self.K)

    @property
    def adaptive(self) -> bool:
        return self.spec.adaptive_num_speculative_tokens and self.costs is not None

    def cap(self, batch_size: int) -> int:
        return self.spec.k_for_batch_size(batch_size)

    def k_next(self, req_id: str) -> int:
        r = self._reqs.get(req_id)
        return self.K if r is None else r.k_next

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def _req(self, req_id: str) -> _ReqK:
        r = self._reqs.get(req_id)
        if r is None:
            r = self._reqs[req_id] = _ReqK(_Acceptance.zeros(self.K))
        return r

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verify step's outcome for a request (num_drafts > 0)."""
        self._req(req_id).stats.observe(num_drafts, num_accepted)
        self._global.observe(num_drafts, num_accepted)

    def alphas(self, req_id: str) -> list[float]:
        """Estimated acceptance of draft i given the ones before it were accepted."""
        s, g = self._req(req_id).stats, self._global
        out = []
        prev = 0.5
        for i in range(self.K):
            # A position seen nowhere yet is taken to be accepted like the one before it (so a
            # request that keeps accepting all of its k drafts tries k + 1).
            prior = (g.accepted[i] + prev) / (g.reached[i] + 1.0)
            prev = (s.accepted[i] + PRIOR_WEIGHT * prior) / (s.reached[i] + PRIOR_WEIGHT)
            out.append(prev)
        return out

    def decide(self, req_ids: list[str], batch_size: int) -> dict[str, int]:
        """K for the drafts each of these requests (one batch) verifies next step."""
        cap = self.cap(batch_size)
        if self.force_k is not None:
            ks = dict.fromkeys(req_ids, min(self.force_k, self.K))
        elif not self.adaptive or cap == 0:
            ks = dict.fromkeys(req_ids, cap)
        else:
            ks = self._adaptive(req_ids, cap)
        for rid, k in ks.items():
            self._req(rid).k_next = k
        return ks

    def _adaptive(self, req_ids: list[str], cap: int) -> dict[str, int]:
        costs = self.costs
        assert costs is not None
        B = len(req_ids)
        ks = dict.fromkeys(req_ids, 0)
        cands: list[tuple[float, int, str]] = []
        for rid in req_ids:
            p = 1.0
            for j, a in enumerate(self.alphas(rid)[:cap]):
                p *= a
                cands.append((p, j + 1, rid))
        cands.sort(key=lambda c: (-c[0], c[1]))
        tokens, num_tokens, steps = float(B), B, 0
        cost = costs.verify(num_tokens)
        for p, j, rid in cands:
            if ks[rid] != j - 1:
                continue
            new_steps = max(steps, j)
            new_cost = costs.verify(num_tokens + 1) + new_steps * costs.draft_step(B)
            if (tokens + p) * cost > tokens * new_cost:
                ks[rid], steps, cost = j, new_steps, new_cost
                tokens, num_tokens = tokens + p, num_tokens + 1
        for rid in req_ids:
            r = self._req(rid)
            if ks[rid] > 0:
                r.idle_steps, r.probe_interval = 0, PROBE_FIRST
                continue
            r.idle_steps += 1
            if r.idle_steps >= r.probe_interval:
                # Probe: verify the full K once, so the estimate can recover.
                ks[rid] = cap
                r.idle_steps = 0
                r.probe_interval = min(2 * r.probe_interval, PROBE_MAX)
        return ks
