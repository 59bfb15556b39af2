# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeded, with logprobs.

Random sampling is Gumbel-max with noise drawn from a generator keyed by (request seed, position
of the token being sampled). A request's tokens therefore depend only on its own seed and logits,
not on what else is in the batch, how its prompt was chunked, or which stage samples it. A
probabilistic draft token is drawn with the same keyed noise (see the rejection sampler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.v1.outputs import LogprobsLists

_MASK = 0x7FFF_FFFF_FFFF_FFFF


def noise_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, token position)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(position) * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 31
    return (x * 0x94D049BB133111EB) & _MASK


def exponential_noise(
    seeds: np.ndarray, positions: np.ndarray, vocab: int, device: torch.device
) -> torch.Tensor:
    """[N, vocab] Exp(1) noise, row i from a generator keyed by (seeds[i], positions[i]).

    By inversion, -log(1 - u) of uniforms u in [2^-25, 1): five times faster on CPU than
    torch's exponential_ (0.2 against 1.1 ms per 49k-token row; a row per sampled token, so a
    batch of 16 at temperature > 0 spent ~20% of its step here). The lower bound keeps the
    noise above zero (a uniform of exactly 0 would make its token win whatever its
    probability); [2^-25, 2^-24) is the first of float32 uniform_'s 2^24 steps, shifted by
    half a step, so every step draws the noise of its midpoint."""
    out = torch.empty(len(seeds), vocab, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device)
    for i, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        gen.manual_seed(noise_seed(s, p))
        out[i].uniform_(2.0**-25, 1.0, generator=gen)
    return out.neg_().log1p_().neg_()


def apply_temperature_and_filters(
    logits: torch.Tensor,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
) -> torch.Tensor:
    """Scaled logits with -inf outside top-k / top-p / min-p (rows with temperature > 0)."""
    device = logits.device
    t = torch.from_numpy(np.maximum(temperature, 1e-6).astype(np.float32)).to(device)
    logits = logits / t[:, None]
    V = logits.shape[-1]
    if (top_k > 0).any():
        k = torch.from_numpy(np.where(top_k > 0, np.minimum(top_k, V), V)).to(device)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if (top_p < 1).any():
        p = torch.from_numpy(top_p.astype(np.float32)).to(device)
        sorted_l, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_l.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = probs.cumsum(-1) - probs >= p[:, None]
        sorted_l = sorted_l.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_l)
    if (min_p > 0).any():
        mp = torch.from_numpy(min_p.astype(np.float32)).to(device)
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * mp[:, None]
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    seeds: np.ndarray,
    positions: np.ndarray,
) -> torch.Tensor:
    """One token per row of logits [N, V] (float32). positions = position of the new token."""
    greedy = temperature < 1e-5
    out = logits.argmax(-1)
    if greedy.all():
        return out
    rows = np.nonzero(~greedy)[0]
    r = torch.from_numpy(rows).to(logits.device)
    scaled = apply_temperature_and_filters(
        logits[r], temperature[rows], top_k[rows], top_p[rows], min_p[rows]
    )
    noise = exponential_noise(seeds[rows], positions[rows], logits.shape[-1], logits.device)
    # Gumbel-max in its exponential form: argmax p_i / E_i samples from p.
    probs = scaled.softmax(-1)
    out[r] = (probs / noise).argmax(-1)
    return out


@dataclass
class SamplingArrays:
    """Per-row sampling parameters of a set of requests (rows of a logits tensor)."""

    temperature: np.ndarray  # [N] float32; < 1e-5 means greedy
    top_k: np.ndarray  # [N] int64; <= 0 means off
    top_p: np.ndarray  # [N] float32
    min_p: np.ndarray  # [N] float32
    seeds: np.ndarray  # [N] int64

    @classmethod
    def of(cls, states: Any, slots: np.ndarray) -> SamplingArrays:
        """The parameters of the requests in request-state slots `slots`, one row each."""
        return cls(
            states.temperature[slots],
            states.top_k[slots],
            states.top_p[slots],
            states.min_p[slots],
            states.seed[slots],
        )

    @classmethod
    def greedy(cls, n: int) -> SamplingArrays:
        return cls(
            np.zeros(n, np.float32),
            np.zeros(n, np.int64),
            np.ones(n, np.float32),
            np.zeros(n, np.float32),
            np.zeros(n, np.int64),
        )

    def take(self, rows: np.ndarray) -> SamplingArrays:
        """The parameters of these rows only (in that order)."""
        return SamplingArrays(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.min_p[rows],
            self.seeds[rows],
        )

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the sampler draws from: rows with temperature > 0 scaled and filtered
        (top-k / top-p / min-p: -inf outside); greedy rows as they are."""
        rows = np.nonzero(self.temperature >= 1e-5)[0]
        if not len(rows):
            return logits
        out = logits.clone()
        r = torch.from_numpy(rows).to(logits.device)
        out[r] = apply_temperature_and_filters(
            logits[r], self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows]
        )
        return out

    def sample(self, logits: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
        """sample_tokens with these parameters; positions [N] of the tokens being sampled."""
        return sample_tokens(
            logits, self.temperature, self.top_k, self.top_p, self.min_p, self.seeds, positions
        )


def compute_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_logprobs: np.ndarray,
    as_logits: bool = False,
) -> list[LogprobsLists | None]:
    """Logprob and rank of token_ids[i] under logits[i], plus the top num_logprobs[i] entries
    (-1 = whole vocabulary, < -1 = none requested); as_logits: the logit values themselves
    (logprobs_mode raw_logits / processed_logits), ranked the same way."""
    want = num_logprobs >= -1
    out: list[LogprobsLists | None] = [None] * len(num_logprobs)
    if not want.any():
        return out
    rows = np.nonzero(want)[0]
    r = torch.from_numpy(rows).to(logits.device)
    lp = logits[r].float() if as_logits else logits[r].float().log_softmax(-1)
    tok = token_ids[r]
    tok_lp = lp.gather(1, tok[:, None]).squeeze(1)
    ranks = (lp > tok_lp[:, None]).sum(-1) + 1
    V = lp.shape[-1]
    kmax = int(max(V if k == -1 else k for k in num_logprobs[rows]))
    top_lp, top_ids = lp.topk(min(kmax, V), dim=-1) if kmax > 0 else (None, None)
    tok_l, tok_lp_l, ranks_l = tok.tolist(), tok_lp.tolist(), ranks.tolist()
    for j, i in enumerate(rows.tolist()):
        k = V if num_logprobs[i] == -1 else int(num_logprobs[i])
        ids, lps = [tok_l[j]], [tok_lp_l[j]]
        if k > 0:
            assert top_ids is not None and top_lp is not None  # kmax >= k > 0
            ids += top_ids[j, :k].tolist()
            lps += top_lp[j, :k].tolist()
        out[i] = LogprobsLists(ids, lps, ranks_l[j])
    return out
