# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""An EAGLE / EAGLE3 chain or dynamic tree shaped by the draft's own confidence
(adaptive_draft_confidence).

The draft's probability of the token it proposes predicts acceptance far better than a
position's average does: SmolLM2-135M-Instruct with its bundled EAGLE3 head, held-out prompts,
greedy - of the first drafts the head gave < 0.2 the target accepted 16%, of those >= 0.9
96%, while the position's average is 57%. A per-position estimate (spec_k.SpecKPolicy) can only
verify all of a position's drafts or none: where a verified row costs 0.2-0.5 of what a token
is worth (batch 8 and 16 on a 2-core CPU), the whole position barely pays, its confident half
well. With the confidence:

- the worker reports per draft the running product c_j of the draft's probabilities of its
  drafts 0..j (ModelRunnerOutput.draft_confidences), and drafts a request no further once its
  next draft is not expected to pay (SchedulerOutput.draft_confidence_floor, below; c never
  rises along the chain); a dynamic tree's node reports its path probability (the nodes come
  most probable first, so any prefix is the most probable subtree; no early stop there);
- Calibration maps c_j to P(drafts 0..j all accepted) (a node: P(on the accepted path)),
  learned from every verified draft (decaying counts in bins of c; greedy and sampled requests
  apart, a sampled request's acceptance being the rejection sampler's), c itself as the prior,
  fitted non-decreasing in c (pooled adjacent violators); a bin with few verified drafts yet
  is priced optimistically, so it gets explored;
- allocate: each step the scheduler verifies, across the batch, drafts in order of calibrated
  gain while the batch's expected tokens per second rises, rows priced by the verify time
  measured at start-up (StepCostModel), exactly as the per-position policy adds drafts;
- floor: what the next draft pass must promise at this batch size - per request, the gain
  that pays for one more verified row (the verify curve's slope from B to 2B tokens), as raw
  confidence (the calibration's inverse); per pass, the gain that pays for the pass (about
  the same for one request or all): the worker runs a pass only for the requests expected to
  clear the first, and only if together they clear the second.

Output never depends on any of this (the verifier emits the target's own samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig
    from vllm.v1.core.sched.spec_k import StepCostModel
    from vllm.v1.request import Request

BINS = 20
PRIOR_WEIGHT = 4.0  # pseudo-observations of the prior (c itself) per bin
# A bin with fewer verified drafts than EXPLORE_SEEN is priced at least EXPLORE_GAIN: its drafts
# are verified until it has evidence of its own (with the prior alone, the low bins of an
# underconfident head - accepted more often than c says - would never be verified, so never
# learned). A few dozen verified drafts in all, once per engine.
EXPLORE_SEEN = 8.0
EXPLORE_GAIN = 0.5
DECAY = 0.999  # per observation of a bin: ~1000 observations remembered


def uses_draft_confidence(spec: SpeculativeConfig) -> bool:
    """Whether the adaptive K reads the draft's confidence: adaptive EAGLE / EAGLE3 chains and
    dynamic trees drafted by their head alone (no static tree, no hybrid)."""
    get = lambda name: getattr(spec, name, None)
    return bool(
        get("adaptive_num_speculative_tokens")
        and get("adaptive_draft_confidence")
        and get("method") in ("eagle", "eagle3")
        and get("speculative_token_tree") is None
        and get("hybrid_method") is None
    )


def _greedy(req: Request) -> bool:
    return req.sampling_params.temperature == 0.0


def _bin(c: float) -> int:
    return min(max(int(c * BINS), 0), BINS - 1)


@dataclass
class Calibration:
    """P(a chain's drafts 0..j all accepted; a tree's node on the accepted path) by the bin of
    the running confidence c_j."""

    seen: list[float] = field(default_factory=lambda: [0.0] * BINS)
    hits: list[float] = field(default_factory=lambda: [0.0] * BINS)
    _table: list[float] | None = field(default=None, repr=False)

    def observe(
        self, confidences: list[float], num_accepted: int, path: list[int] | None = None
    ) -> None:
        """One verify step of a request: its drafts' confidences, how many were accepted (a
        tree's: the accepted path's node indices)."""
        on = set(range(num_accepted)) if path is None else set(path)
        for j, c in enumerate(confidences):
            b = _bin(c)
            self.seen[b] = self.seen[b] * DECAY + 1.0
            self.hits[b] = self.hits[b] * DECAY + (1.0 if j in on else 0.0)
        self._table = None

    def table(self) -> list[float]:
        """Gain per bin: the observed rate shrunk to the prior (the bin's centre), then the
        closest non-decreasing fit (adjacent bins that violate it pooled, weighted by their
        counts)."""
        if self._table is None:
            blocks: list[list[float]] = []  # [weighted sum, weight, bins]
            for b in range(BINS):
                w = self.seen[b] + PRIOR_WEIGHT
                blocks.append([self.hits[b] + PRIOR_WEIGHT * (b + 0.5) / BINS, w, 1])
                while (
                    len(blocks) > 1
                    and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]
                ):
                    s, w, n = blocks.pop()
                    blocks[-1][0] += s
                    blocks[-1][1] += w
                    blocks[-1][2] += n
            self._table = [s / w for s, w, n in blocks for _ in range(int(n))]
        return self._table

    def gain(self, c: float) -> float:
        """What a draft of running confidence c is worth (explored while its bin is new)."""
        b = _bin(c)
        g = self.table()[b]
        return max(g, EXPLORE_GAIN) if self.seen[b] < EXPLORE_SEEN else g

    def raw(self, gain: float) -> float:
        """The lowest confidence whose calibrated gain reaches `gain` (1.0: none does)."""
        for b in range(BINS):
            if self.gain((b + 0.5) / BINS) >= gain:
                return b / BINS
        return 1.0


class DraftConfidence:
    def __init__(self) -> None:
        self.greedy, self.sampled = Calibration(), Calibration()
        self.kept: dict[str, list[float]] = {}
        """Per request: the cumulative confidences of the drafts the worker keeps for it."""

    def _cal(self, greedy: bool) -> Calibration:
        return self.greedy if greedy else self.sampled

    def on_drafts(self, req_id: str, confidences: list[float] | None) -> None:
        """The worker's report of a request's new drafts (None: none reported)."""
        if confidences:
            self.kept[req_id] = confidences
        else:
            self.kept.pop(req_id, None)

    def observe(
        self,
        req_id: str,
        num_drafts: int,
        num_accepted: int,
        greedy: bool,
        path: list[int] | None = None,
    ) -> None:
        """A verify step: the first num_drafts of the request's kept drafts were verified (a
        tree's: its first nodes, path the accepted ones)."""
        confs = self.kept.get(req_id)
        if confs is not None:
            self._cal(greedy).observe(confs[:num_drafts], num_accepted, path)

    def shape(self, running: list[Request], batch_size: int, costs: StepCostModel) -> None:
        """Cut each running request's drafts (Request.num_drafts) to what pays this step."""
        reqs = {
            r.request_id: (self.kept[r.request_id][: r.num_drafts], _greedy(r))
            for r in running
            if r.num_drafts and not r.in_flight and r.request_id in self.kept
        }
        if reqs:
            ks = self.allocate(reqs, batch_size, costs)
            for r in running:
                r.num_drafts = ks.get(r.request_id, r.num_drafts)

    def allocate(
        self, reqs: dict[str, tuple[list[float], bool]], batch_size: int, costs: StepCostModel
    ) -> dict[str, int]:
        """How many of its drafts each request verifies: reqs[rid] = (the cumulative
        confidences of its drafts, greedy?); batch_size: the step's requests (each brings one
        token besides its drafts); rows priced by costs."""
        cands: list[tuple[float, int, str]] = []
        for rid, (confs, greedy) in reqs.items():
            cal, g = self._cal(greedy), 1.0
            for j, c in enumerate(confs):
                g = min(g, cal.gain(c))  # never rises along a chain (or a tree's node order)
                cands.append((g, j, rid))
        cands.sort(key=lambda x: (-x[0], x[1]))
        ks = dict.fromkeys(reqs, 0)
        tokens, rows = float(batch_size), batch_size
        cost = costs.verify(rows)
        for g, j, rid in cands:
            if ks[rid] != j:
                continue
            new_cost = costs.verify(rows + 1)
            if (tokens + g) * cost > tokens * new_cost:
                ks[rid], tokens, rows, cost = j + 1, tokens + g, rows + 1, new_cost
        return ks

    def floor(self, batch_size: int, costs: StepCostModel) -> tuple[float, float]:
        """What the worker's next draft pass must promise at this batch size: (the raw
        confidence a request's next draft needs to pay for its verified row, the sum of its
        requests' next drafts' raw confidences the pass needs to pay for itself) - a pass
        costs about the same for one request or all, so it runs only where enough of them
        go on. In gain units (tokens), through the batch's time per token."""
        b = max(batch_size, 1)
        per_token = (costs.verify(b) + costs.draft_step(b)) / b
        row = max(costs.verify(2 * b) - costs.verify(b), 0.0) / b
        need = row / max(per_token, 1e-9)
        raw = min(self.greedy.raw(need), self.sampled.raw(need))
        return raw, costs.draft_step(b) / max(per_token, 1e-9)
