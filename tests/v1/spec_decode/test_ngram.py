# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Prompt lookup's matcher and its config: the longest n-gram wins, its latest occurrence is
used, a continuation past the end repeats periodically, the incremental index gives what a
brute-force search gives whatever the chunks the tokens arrive in; vLLM's defaults and checks
for prompt_lookup_min / prompt_lookup_max and the batch-size schedule."""

from __future__ import annotations

import random

import pytest

from vllm.config import SpeculativeConfig
from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramIndex


def _index(tokens: list[int], lo: int, hi: int) -> NgramIndex:
    idx = NgramIndex(lo, hi)
    idx.extend(tokens)
    return idx


def test_longest_ngram_wins_over_a_later_shorter_one():
    # Suffix [1, 2, 3]: the 3-gram occurs at 0 (then 4), the 2-gram [2, 3] also at 7 (then 9).
    toks = [1, 2, 3, 4, 5, 6, 2, 3, 9, 1, 2, 3]
    assert _index(toks, 2, 3).propose(2) == [4, 5]
    assert _index(toks, 2, 2).propose(2) == [9, 1]


def test_latest_occurrence_and_periodic_continuation():
    toks = [5, 1, 2, 7, 1, 2, 8, 1, 2]
    assert _index(toks, 2, 2).propose(3) == [8, 1, 2]
    # a b a b -> the continuation of the match at the end runs into the drafts themselves.
    assert _index([3, 4, 3, 4], 2, 2).propose(5) == [3, 4, 3, 4, 3]
    assert _index([6, 6], 1, 1).propose(4) == [6, 6, 6, 6]


def test_no_match_and_min_bound():
    assert _index([1, 2, 3, 4], 1, 3).propose(2) is None
    # only a 1-gram repeats: found with min 1, not with min 2.
    assert _index([9, 1, 2, 9], 1, 3).propose(2) == [1, 2]
    assert _index([9, 1, 2, 9], 2, 3).propose(2) is None
    assert _index([], 1, 3).propose(2) is None
    assert _index([4], 1, 3).propose(2) is None


def _brute(tokens: list[int], lo: int, hi: int, k: int) -> list[int] | None:
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        for start in range(L - 1, n - 1, -1):
            if tokens[start - n : start] == tokens[L - n :]:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[start + i])
                return ext[L:]
    return None


@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 4), (2, 4), (3, 3)])
def test_incremental_index_equals_brute_force(lo, hi):
    rng = random.Random(lo * 10 + hi)
    for _ in range(20):
        idx = NgramIndex(lo, hi)
        seen: list[int] = []
        while len(seen) < 80:
            chunk = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            idx.extend(chunk)
            seen += chunk
            assert idx.tokens == seen
            assert idx.propose(4) == _brute(seen, lo, hi, 4)


def _spec(**kw) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, **kw})


def test_vllm_defaults():
    s = _spec()
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (5, 5)
    s = _spec(prompt_lookup_max=4)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (4, 4)
    s = _spec(prompt_lookup_min=2)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (2, 2)
    s = _spec(prompt_lookup_min=2, prompt_lookup_max=4)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (2, 4)
    assert not s.method_info.has_draft_model and s.num_lookahead_tokens == 0
    # vLLM's older spellings.
    old = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2})
    assert old.method == "ngram" and old.model is None
    assert SpeculativeConfig.from_dict({"method": "[ngram]"}).method == "ngram"


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"prompt_lookup_min": -2, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4"),
        ({"prompt_lookup_min": 1.5}, "prompt_lookup_min"),
        ({"prompt_lookup_max": "3"}, "prompt_lookup_max"),
        ({"model": "/some/draft"}, "speculative_config.model"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens_per_batch_size": []}, "per_batch_size"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4]]}, "per_batch_size"),
        ({"num_speculative_tokens_per_batch_size": [[0, 4, 2]]}, "start_bs"),
        ({"num_speculative_tokens_per_batch_size": [[5, 4, 2]]}, "start_bs"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, 5]]}, "K=5"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, "K=-1"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, 2], [4, 8, 1]]}, "overlap"),
        ({"num_speculative_tokens_per_batch_size": "1-4:2"}, "per_batch_size"),
        ({"adaptive_num_speculative_tokens": "yes"}, "adaptive_num_speculative_tokens"),
    ],
)
def test_bad_configs_raise_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        _spec(**kw)


def test_model_ngram_with_another_method_raises():
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig.from_dict({"method": "mtp", "model": "[ngram]"})


def test_batch_size_schedule():
    s = _spec(num_speculative_tokens_per_batch_size=[[9, 16, 0], [1, 1, 4], [2, 8, 2]])
    assert s.num_speculative_tokens_per_batch_size == [[1, 1, 4], [2, 8, 2], [9, 16, 0]]
    got = [s.k_for_batch_size(b) for b in (1, 2, 8, 9, 16, 17, 64)]
    assert got == [4, 2, 2, 0, 0, 4, 4]
