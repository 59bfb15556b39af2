# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""How many drafts each request verifies next step (pure Python, no torch).

The ceiling is speculative_config.num_speculative_tokens_per_batch_size at the batch's size
(else num_speculative_tokens). Under it, with adaptive_num_speculative_tokens (the default),
each request's K is chosen every step so the batch's expected tokens per second is highest:

- acceptance: per request and draft position i, a running (decaying) estimate of the
  probability that draft i is accepted given drafts 0..i-1 were, with the engine-wide estimate
  for that position (a longer memory: ~200 observations) as its prior (a new request starts
  from what the head does elsewhere, not from the last request of the previous batch), and
  a position not observed anywhere yet taken to be accepted like the one before it;
  draft j adds prod_{i<j} alpha_i expected tokens;
- a draft tree (static or dynamic, config/spec_tree.py): a request verifies a prefix of its
  nodes, so the estimate is per node index j instead - the probability that node j is on the
  accepted path given it was verified (the same decaying counts and priors; every verified
  node is reached, the path's nodes are accepted; the nodes past the prefix age by the same
  decay, so what one early miss taught fades back to the prior). A static tree's node never
  observed is taken to be on the path as often as its parent times the root's child of its
  rank (not like the node before it, often a weaker sibling). Node j adds a_j expected
  tokens. Those gains need not fall with j (a static tree's second root child may be worse
  than the first one's child), so runs of them are pooled into blocks with their mean gain
  (adjacent violators) until the means fall, and a block is taken whole;
- cost: the step time measured at start-up (StepCostModel): verify time by the step's total
  tokens, and the time of one more draft step (a chain's draft, a tree's depth pass) by the
  batch size. Where the speculator runs each pass only over the requests that reach it
  (draft_rows_per_request: EAGLE / EAGLE3 chains, every tree), pass s costs one draft step at
  the number of requests whose prefix needs s passes or more; else every pass the batch's
  longest prefix needs (draft_passes) costs one at the whole batch;
- drafts (blocks) are added in order of expected gain while gain / added cost beats the batch's
  current tokens per second; a request left at K = 0 is probed again after a number of steps
  that doubles after each probe that does not pay (8 up to 128), one request a step (the
  longest overdue first: requests idle since the same step take turns), with the longest
  prefix that would pay were every draft accepted (a chain's k drafts give k tokens, a tree
  prefix its depth passes): the full K where verifying is cheap, less or nothing in a batch
  where even perfect drafts cost more than they bring.

The output never depends on any of this: the verifier emits the target's own (keyed) sample at
every position whatever was drafted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.config import SpeculativeConfig
from vllm.config.spec_tree import parse_token_tree, tree_parents
from vllm.v1.core.sched.draft_confidence import DraftConfidence, uses_draft_confidence

if TYPE_CHECKING:
    from vllm.v1.request import Request

PRIOR_WEIGHT = 2.0  # pseudo-observations of the engine-wide estimate in a request's
DECAY = 0.95  # weight of older observations per new one (acceptance drifts with the text)
GLOBAL_DECAY = 0.995  # the engine-wide prior's: ~200 observations, so the last requests of a
# batch (the slowest to finish are those that accept least) do not become every new one's prior
PROBE_FIRST, PROBE_MAX = 8, 128
# A probe is priced as if this share of its drafts' tokens were accepted: one that would only
# break even were every draft accepted loses at any real acceptance (at batch 16 on a CPU,
# where a verified row costs about what a token is worth, such probes cost ~15% of every step
# and found nothing).
PROBE_ACCEPTANCE = 0.8


@dataclass
class StepCostModel:
    """Step time measured at start-up (seconds): verify_s[i] for a step of tokens[i] scheduled
    tokens (drafting nothing), draft_step_s[i] for one more draft step at batch_sizes[i]."""

    tokens: list[int]
    verify_s: list[float]
    batch_sizes: list[int]
    draft_step_s: list[float]
    # verify() by token count, filled as asked (the policy asks the same counts every step).
    _verify_memo: dict[int, float] = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def _interp(xs: list[int], ys: list[float], x: float) -> float:
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-9), 0.0)

    def verify(self, num_tokens: int) -> float:
        v = self._verify_memo.get(num_tokens)
        if v is None:
            v = self._verify_memo[num_tokens] = self._interp(self.tokens, self.verify_s, num_tokens)
        return v

    def draft_step(self, batch_size: int) -> float:
        return self._interp(self.batch_sizes, self.draft_step_s, batch_size)


def draft_passes(spec: SpeculativeConfig) -> list[int] | None:
    """passes[k] for k = 0..K: the draft passes drafting k nodes of the configured tree takes
    (each costing about one measured draft step); None for a chain (k steps for k drafts). A
    static tree's first k nodes (breadth first) need the depth of the k-th. A dynamic tree of k
    nodes runs the root's pass, then expands up to tree_top_k nodes a depth until k are
    expanded, at most tree_max_depth - 1 times (tree_draft.draft_dynamic): the depth its
    deepest node can have, whatever shape the step's tree takes."""
    K = spec.num_speculative_tokens
    tree = getattr(spec, "speculative_token_tree", None)  # (test doubles carry only K)
    if tree is not None:
        return [0] + [len(p) for p in parse_token_tree(tree)]
    if getattr(spec, "num_tree_nodes", None) is not None:
        top_k, max_depth = spec.tree_top_k or 1, spec.tree_max_depth or K
        return [0] + [1 + min(max_depth - 1, -(-k // top_k)) for k in range(1, K + 1)]
    return None


def draft_rows_per_request(spec: SpeculativeConfig) -> bool:
    """Whether the worker drafts each request only as deep as its own count (the
    AutoRegressiveSpeculator's row subsets and tree passes); MTP chains run every request's
    chained rows, DFlash one block pass, the draft-free proposers cost no pass."""
    tree = getattr(spec, "speculative_token_tree", None) is not None
    tree = tree or getattr(spec, "num_tree_nodes", None) is not None
    return tree or getattr(spec, "method", None) in ("eagle", "eagle3")


class _DraftCost:
    """The draft passes' cost of one step as requests' prefixes grow: pass s costs one draft
    step at the number of requests it runs (per_request) or at the whole batch."""

    def __init__(self, costs: StepCostModel, batch_size: int, per_request: bool) -> None:
        self.costs, self.batch_size, self.per_request = costs, batch_size, per_request
        self.rows: list[int] = []  # rows[s]: requests running pass s + 1 (len: the deepest)
        self.total = 0.0
        # A pass's cost by the requests it runs (0 .. batch_size), looked up, not interpolated,
        # in the candidates' loop.
        self._by_rows = [0.0] + [costs.draft_step(r) for r in range(1, batch_size + 1)]

    def _pass(self, rows: int) -> float:
        return self._by_rows[rows] if rows < len(self._by_rows) else self.costs.draft_step(rows)

    def grown(self, old_passes: int, new_passes: int) -> float:
        """The total if one request's passes grow from old_passes to new_passes."""
        if not self.per_request:
            deepest = max(len(self.rows), new_passes)
            return deepest * self.costs.draft_step(self.batch_size)
        rows = self.rows + [0] * max(0, new_passes - len(self.rows))
        return self.total + sum(
            self._pass(rows[s] + 1) - self._pass(rows[s]) for s in range(old_passes, new_passes)
        )

    def grow(self, old_passes: int, new_passes: int) -> None:
        self.total = self.grown(old_passes, new_passes)
        self.rows += [0] * max(0, new_passes - len(self.rows))
        for s in range(old_passes, new_passes):
            self.rows[s] += 1


def static_tree_structure(spec: SpeculativeConfig) -> list[tuple[int, int]] | None:
    """Per node of a static tree: (its parent, -1 for the root's children; the root's child of
    the same rank, -1 when the root has none) - both come before it in breadth-first order.
    None for a chain or a dynamic tree."""
    tree = getattr(spec, "speculative_token_tree", None)
    if tree is None:
        return None
    paths = parse_token_tree(tree)
    parents = tree_parents(paths)
    first_level = {p[0]: i for i, p in enumerate(paths) if len(p) == 1}
    return [(parents[i], first_level.get(p[-1], -1)) for i, p in enumerate(paths)]


def pooled_blocks(gains: list[float]) -> list[tuple[float, int, int, float]]:
    """(mean gain, first index, end index, total gain) of the runs a non-increasing fit pools
    gains into (adjacent violators): taking blocks best first takes prefixes of the gains."""
    blocks: list[list[float]] = []  # [total, first, end]
    for j, g in enumerate(gains):
        blocks.append([g, j, j + 1])
        while len(blocks) > 1 and (
            blocks[-2][0] / (blocks[-2][2] - blocks[-2][1])
            < blocks[-1][0] / (blocks[-1][2] - blocks[-1][1])
        ):
            t, _, e = blocks.pop()
            blocks[-1][0] += t
            blocks[-1][2] = e
    return [(t / (e - f), int(f), int(e), t) for t, f, e in blocks]


@dataclass
class _Acceptance:
    """Decaying counts per draft position: reached (verified with every draft before it
    accepted) and accepted."""

    reached: list[float]
    accepted: list[float]
    decay: float = DECAY

    @classmethod
    def zeros(cls, k: int, decay: float = DECAY) -> _Acceptance:
        return cls([0.0] * k, [0.0] * k, decay)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        d = self.decay
        for i in range(min(num_drafts, num_accepted + 1)):
            self.reached[i] = self.reached[i] * d + 1.0
            self.accepted[i] = self.accepted[i] * d + (1.0 if i < num_accepted else 0.0)

    def observe_tree(self, num_nodes: int, path: list[int]) -> None:
        """A tree step: nodes 0..num_nodes-1 verified, the path's nodes accepted."""
        on, d = set(path), self.decay
        for j in range(num_nodes):
            self.reached[j] = self.reached[j] * d + 1.0
            self.accepted[j] = self.accepted[j] * d + (1.0 if j in on else 0.0)
        # Nodes past the prefix age too: what was seen of them fades back to the prior, so
        # one early miss does not keep a good node out of every later prefix.
        for j in range(num_nodes, len(self.reached)):
            self.reached[j] *= d
            self.accepted[j] *= d


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
        self._global = _Acceptance.zeros(self.K, GLOBAL_DECAY)
        self.passes = draft_passes(self.spec)
        """Draft passes per number of tree nodes (None: a chain)."""
        self._per_request_rows = draft_rows_per_request(self.spec)
        self._structure = static_tree_structure(self.spec)
        """A static tree's (parent, same-rank root child) per node, for the prior of nodes
        not observed yet (None: a chain or a dynamic tree)."""
        self.confidence: DraftConfidence | None = None
        """adaptive_draft_confidence: the drafts' own confidence shapes each step within the K
        chosen here (the worker stops drafting a request early, the scheduler verifies what
        pays)."""
        if self.costs is not None and uses_draft_confidence(self.spec):
            self.confidence = DraftConfidence()

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
        if self.confidence is not None:
            self.confidence.kept.pop(req_id, None)

    def confidence_floor(self, batch_size: int) -> tuple[float, float] | None:
        """What the worker's next draft pass must promise (DraftConfidence.floor)."""
        if self.confidence is None or self.costs is None:
            return None
        return self.confidence.floor(batch_size, self.costs)

    def shape_drafts(self, running: list[Request], batch_size: int) -> None:
        """Cut the running requests' kept drafts to what pays this step (DraftConfidence)."""
        if self.confidence is not None and self.costs is not None:
            self.confidence.shape(running, batch_size, self.costs)

    def _req(self, req_id: str) -> _ReqK:
        r = self._reqs.get(req_id)
        if r is None:
            r = self._reqs[req_id] = _ReqK(_Acceptance.zeros(self.K))
        return r

    def observe(
        self,
        req_id: str,
        num_drafts: int,
        num_accepted: int,
        path: list[int] | None = None,
        greedy: bool = True,
    ) -> None:
        """One verify step's outcome for a request (num_drafts > 0); a tree's: the accepted
        path's node indices (None: the first num_accepted nodes, a chain in tree order)."""
        if self.confidence is not None:
            self.confidence.observe(req_id, num_drafts, num_accepted, greedy, path)
        if self.passes is None:
            self._req(req_id).stats.observe(num_drafts, num_accepted)
            self._global.observe(num_drafts, num_accepted)
            return
        nodes = list(range(num_accepted)) if path is None else path
        self._req(req_id).stats.observe_tree(num_drafts, nodes)
        self._global.observe_tree(num_drafts, nodes)

    def alphas(self, req_id: str) -> list[float]:
        """Estimated acceptance of draft i given the ones before it were accepted (a tree:
        of node i given it was verified)."""
        s, g = self._req(req_id).stats, self._global
        out: list[float] = []
        prev = 0.5
        structure = self._structure
        for i in range(self.K):
            # A position seen nowhere yet is taken to be accepted like the one before it (so a
            # request that keeps accepting all of its k drafts tries k + 1). A static tree's
            # node is not like the node before it (often a worse sibling): it is taken to be
            # on the path as often as its parent times the root's child of its rank.
            if structure is not None and i > 0:
                parent, same_rank = structure[i]
                if parent >= 0:
                    prev = out[parent] * out[same_rank if same_rank >= 0 else parent]
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
        # (mean gain, first draft, end, total gain, request): drafts first..end-1 taken whole.
        cands: list[tuple[float, int, int, float, str]] = []
        passes = self.passes
        for rid in req_ids:
            alphas = self.alphas(rid)[:cap]
            if passes is None:
                p = 1.0
                for j, a in enumerate(alphas):
                    p *= a
                    cands.append((p, j, j + 1, p, rid))
            else:
                cands += [(*b, rid) for b in pooled_blocks(alphas)]
        cands.sort(key=lambda c: (-c[0], c[2]))
        tokens, num_tokens = float(B), B
        draft = _DraftCost(costs, B, self._per_request_rows)
        cost = costs.verify(num_tokens)
        for _, first, end, gain, rid in cands:
            if ks[rid] != first:
                continue
            p_old, p_new = (first, end) if passes is None else (passes[first], passes[end])
            n = num_tokens + end - first
            new_cost = costs.verify(n) + draft.grown(p_old, p_new)
            if (tokens + gain) * cost > tokens * new_cost:
                draft.grow(p_old, p_new)
                ks[rid], cost = end, new_cost
                tokens, num_tokens = tokens + gain, n
        due: list[tuple[int, str]] = []
        for rid in req_ids:
            r = self._req(rid)
            if ks[rid] > 0:
                r.idle_steps, r.probe_interval = 0, PROBE_FIRST
                continue
            r.idle_steps += 1
            if r.idle_steps >= r.probe_interval:
                due.append((r.idle_steps - r.probe_interval, rid))
        # One probe a step, the longest overdue first: requests that went idle together (a
        # batch that started together) would otherwise all probe at once, and a step verifying
        # every request's whole tree costs several plain steps. The others wait their turn.
        for _, rid in sorted(due, key=lambda d: -d[0]):
            r = self._req(rid)
            # Probe, so the estimate can recover: the longest prefix that would pay were
            # PROBE_ACCEPTANCE of its tokens accepted (none where even that would not: the
            # request waits, and probes as soon as the batch makes it pay).
            for k in range(cap, 0, -1):
                p_new = k if passes is None else passes[k]
                n = num_tokens + k
                new_cost = costs.verify(n) + draft.grown(0, p_new)
                if (tokens + PROBE_ACCEPTANCE * p_new) * cost > tokens * new_cost:
                    draft.grow(0, p_new)
                    ks[rid], cost, num_tokens = k, new_cost, n
                    r.idle_steps = 0
                    r.probe_interval = min(2 * r.probe_interval, PROBE_MAX)
                    break
            if ks[rid]:
                break
        return ks
