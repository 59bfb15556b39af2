# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""SuffixSpeculator: suffix decoding (Arctic Inference's method, vLLM's `method: "suffix"`),
drafts from what the request itself and earlier requests wrote; no draft model, no KV.

Two sources are searched each step: the request's own tokens (prompt and output so far) and
a global corpus of the outputs of requests that left the batch (FIFO, at most
`suffix_decoding_max_cached_requests` of them, 0: none). For a source, a match is a suffix of
the request's tokens, at most `suffix_decoding_max_tree_depth` (D) long, that occurred earlier
followed by at least one token. From the occurrences of a match of length j, the drafts follow
the most frequent next token (ties: the lowest id), then the most frequent after that among the
occurrences that agreed, and so on, while the product of the chosen tokens' frequencies (their
estimated probability) stays >= `suffix_decoding_min_token_prob`, for at most min(K,
floor(`suffix_decoding_max_spec_factor` x j), D - j) tokens - a suffix tree of depth D walked
greedily, as the method's paper describes. The depth bounds match + draft, so the longest match
is not always the best: of the match lengths, the one whose draft has the largest sum of
estimated probabilities (the expected number of accepted tokens) is used (ties: the longer
match). Of the two sources' drafts, the larger expected acceptance wins; ties go to the longer
draft, then to the request's own.

Both sources are a token buffer plus an index from each token to the positions it occurs at
(positions with a next token only), so adding tokens costs O(new tokens) and a lookup is D
vectorised comparisons over the positions of the last token. Memory: 4 bytes per buffered
token plus 8 per index entry, per request for its own tokens, and for the corpus at most
`max_cached_requests` outputs (and never more than twice the live tokens: evicted outputs are
blanked and the buffer compacted once half of it is dead).
"""

from __future__ import annotations

import collections
from array import array

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.v1.worker.gpu.spec_decode.speculator import DraftFreeSpeculator, ProposeInputs
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

_SEP = -1  # between two sequences of a corpus (and over evicted ones)


class TokenCorpus:
    """Token sequences in one buffer (separated by _SEP) with a token -> positions index; the
    positions listed are those followed by another token of the same sequence."""

    def __init__(self) -> None:
        self.buf = np.full(1024, _SEP, dtype=np.int32)
        self.size = 0
        self.index: dict[int, array] = {}

    def _reserve(self, n: int) -> None:
        if self.size + n > len(self.buf):
            new = np.full(max(2 * len(self.buf), self.size + n), _SEP, dtype=np.int32)
            new[: self.size] = self.buf[: self.size]
            self.buf = new

    def append(self, tokens: list[int] | np.ndarray, new_sequence: bool) -> None:
        """Add tokens to the last sequence (or start a new one)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if new_sequence and self.size and self.buf[self.size - 1] != _SEP:
            self._reserve(1)
            self.buf[self.size] = _SEP
            self.size += 1
        if not len(tokens):
            return
        self._reserve(len(tokens))
        start = self.size
        # The token before these now has a successor: it joins the index.
        if start and self.buf[start - 1] != _SEP:
            self.index.setdefault(int(self.buf[start - 1]), array("q")).append(start - 1)
        self.buf[start : start + len(tokens)] = tokens
        self.size += len(tokens)
        index = self.index
        for p, t in enumerate(tokens[:-1].tolist(), start):
            pos = index.get(t)
            if pos is None:
                pos = index[t] = array("q")
            pos.append(p)

    def positions(self, token: int) -> np.ndarray:
        got = self.index.get(token)
        if got is None:
            return np.zeros(0, dtype=np.int64)
        pos = np.frombuffer(got, dtype=np.int64)
        return pos[self.buf[pos] == token]  # evicted (blanked) positions drop out

    def match_and_draft(
        self, context: np.ndarray, max_depth: int, k: int, factor: float, min_prob: float
    ) -> tuple[int, list[int], float]:
        """(match length, drafts, expected accepted tokens) for the context (module doc)."""
        if not len(context):
            return 0, [], 0.0
        pos = self.positions(int(context[-1]))
        if not len(pos):
            return 0, [], 0.0
        buf = self.buf
        alive = np.ones(len(pos), dtype=bool)
        length = np.ones(len(pos), dtype=np.int64)
        for j in range(1, min(max_depth, len(context))):
            back = pos - j
            ok = back >= 0
            ok[ok] = buf[back[ok]] == context[-1 - j]
            alive &= ok
            if not alive.any():
                break
            length += alive
        m = int(length.max())
        best: tuple[float, int, list[int]] = (0.0, 0, [])
        # The depth bounds match + draft, so the longest match may leave no room: shorter
        # matches (more occurrences, more room) are tried while they could still do better.
        for j in range(min(m, max_depth - 1), 0, -1):
            limit = min(k, int(factor * j), max_depth - j)
            if limit <= best[0]:
                if int(factor * j) <= best[0] or k <= best[0]:
                    break  # shorter matches only allow shorter drafts from here on
                continue
            drafts, score = self._walk(pos[length >= j], limit, min_prob)
            if score > best[0]:
                best = (score, j, drafts)
        return best[1], best[2], best[0]

    def _walk(self, cand: np.ndarray, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation of the occurrences ending at `cand`, token by token
        while the product of the frequencies stays >= min_prob, at most `limit` tokens."""
        buf = self.buf
        drafts: list[int] = []
        prob, score = 1.0, 0.0
        for d in range(1, limit + 1):
            nxt = cand + d
            nxt = nxt[nxt < self.size]
            toks = buf[nxt]
            keep = toks != _SEP
            if not keep.any():
                break
            nxt, toks = nxt[keep], toks[keep]
            values, counts = np.unique(toks, return_counts=True)
            best = int(np.argmax(counts))  # np.unique sorts: ties go to the lowest id
            p = prob * counts[best] / len(toks)
            if p < min_prob:
                break
            prob = p
            score += prob
            drafts.append(int(values[best]))
            cand = nxt[toks == values[best]] - d
        return drafts, score

    def blank(self, start: int, end: int) -> None:
        self.buf[start:end] = _SEP

    def compact(self, keep: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Rebuild from the sequences [start, end) in keep; returns their new ranges."""
        old = self.buf
        self.__init__()  # type: ignore[misc]
        ranges = []
        for s, e in keep:
            begin = self.size + (1 if self.size else 0)
            self.append(old[s:e], new_sequence=True)
            ranges.append((begin, self.size))
        return ranges


class GlobalSuffixCache:
    """The outputs of earlier requests, FIFO up to max_requests of them."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.corpus = TokenCorpus()
        self.ranges: collections.deque[tuple[int, int]] = collections.deque()
        self.live_tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        if self.max_requests <= 0 or not len(tokens):
            return
        c = self.corpus
        start = c.size + (1 if c.size else 0)
        c.append(tokens, new_sequence=True)
        self.ranges.append((start, c.size))
        self.live_tokens += len(tokens)
        while len(self.ranges) > self.max_requests:
            s, e = self.ranges.popleft()
            c.blank(s, e)
            self.live_tokens -= e - s
        if c.size > 2 * (self.live_tokens + len(self.ranges)) + 1024:
            self.ranges = collections.deque(c.compact(list(self.ranges)))


class SuffixSpeculator(DraftFreeSpeculator):
    """Suffix decoding (module docstring). Built on the last pipeline stage like every
    speculator; its drafts go through the same StepResult broadcast."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        super().__init__(vllm_config, device)
        spec = self.speculative_config
        self.depth = spec.suffix_decoding_max_tree_depth
        self.factor = spec.suffix_decoding_max_spec_factor
        self.min_prob = spec.suffix_decoding_min_token_prob
        self.own: list[TokenCorpus | None] = [None] * self.max_num_reqs
        self.global_cache = GlobalSuffixCache(spec.suffix_decoding_max_cached_requests)
        # Drafts proposed, by the source they came from (tests, benchmarks).
        self.num_proposed = {"request": 0, "global": 0}

    def end_warm_up(self) -> None:
        self.global_cache = GlobalSuffixCache(self.global_cache.max_requests)
        self.own = [None] * self.max_num_reqs
        self.num_proposed = {"request": 0, "global": 0}

    def on_request_removed(self, slot: int, output_token_ids: np.ndarray) -> None:
        """A request left its slot: its output joins the global cache."""
        self.own[slot] = None
        self.global_cache.add(output_token_ids)

    def propose(self, inputs: ProposeInputs) -> np.ndarray:
        R, K = inputs.input_batch.num_reqs, self.num_speculative_steps
        drafts = np.full((R, K), PAD_TOKEN_ID, dtype=np.int64)
        k_max = inputs.max_drafts(K)
        self.last_match_lengths = np.zeros(R, dtype=np.int64)
        for i, own in inputs.follow_histories(
            self.own,
            TokenCorpus,
            lambda c: c.size,
            lambda c, tokens: c.append(tokens, new_sequence=False),
            k_max,
        ):
            context = own.buf[max(0, own.size - self.depth) : own.size]
            best: tuple[float, int, int, list[int], str, int] = (0.0, 0, 0, [], "", 0)
            for name, corpus in (("request", own), ("global", self.global_cache.corpus)):
                m, got, score = corpus.match_and_draft(
                    context, self.depth, k_max, self.factor, self.min_prob
                )
                # Larger expected acceptance, then longer; the request's own wins ties.
                key = (score, len(got), 1 if name == "request" else 0, got, name, m)
                if key[:3] > best[:3]:
                    best = key
            got, name = best[3], best[4]
            self.last_match_lengths[i] = best[5] if got else 0
            if got:
                drafts[i, : len(got)] = got
                self.num_proposed[name] += len(got)
        return drafts
