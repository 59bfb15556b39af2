# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Suffix decoding: the proposals equal a brute-force suffix match over the same tokens; the
global cache learns from finished requests and forgets past max_cached_requests; lossless
against no speculation (greedy and seeded) at P = 1 / 2 and TP = 2; bad keys refused."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vllm import LLM, SamplingParams
from vllm.config import SpeculativeConfig
from vllm.testing.engine_utils import make_prompts, spec_decode_counts
from vllm.testing.spec_checkpoints import make_llama_bigram_target
from vllm.v1.worker.gpu.spec_decode.suffix.speculator import GlobalSuffixCache, TokenCorpus


def brute_force(
    sequences: list[list[int]],
    own: list[int] | None,
    context: list[int],
    depth: int,
    k: int,
    factor: float,
    min_prob: float,
) -> tuple[int, list[int], float]:
    """The definition, by scanning every position: for every suffix of the context (<= depth)
    that occurred followed by a token, the greedy walk by frequency from its occurrences; the
    walk with the largest expected acceptance wins (ties: the longer suffix)."""
    seqs = [list(s) for s in sequences]
    if own is not None:
        seqs.append(list(own))

    def occurrences(w: list[int]) -> list[tuple[int, int]]:
        out = []
        for si, s in enumerate(seqs):
            for end in range(len(w), len(s)):  # a next token must exist: end < len(s)
                if s[end - len(w) : end] == w:
                    out.append((si, end))
        return out

    m = 0
    for n in range(min(depth, len(context)), 0, -1):
        if occurrences(context[-n:]):
            m = n
            break
    best: tuple[float, int, list[int]] = (0.0, 0, [])
    for j in range(min(m, depth - 1), 0, -1):  # every match length; the best draft wins
        w = context[-j:]
        drafts: list[int] = []
        prob, score = 1.0, 0.0
        for _ in range(min(k, int(factor * j), depth - j)):
            nexts = [seqs[si][end] for si, end in occurrences(w + drafts)]
            if not nexts:
                break
            counts = {t: nexts.count(t) for t in set(nexts)}
            tok = min(counts, key=lambda t: (-counts[t], t))
            p = prob * counts[tok] / len(nexts)
            if p < min_prob:
                break
            prob, score = p, score + p
            drafts.append(tok)
        if score > best[0]:
            best = (score, j, drafts)
    return best[1], best[2], best[0]


def _text(rng: random.Random, n: int) -> list[int]:
    """Tokens with repeats: phrases drawn from a small set, some noise."""
    phrases = [[rng.randrange(12) for _ in range(rng.randint(2, 6))] for _ in range(6)]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(12)]
    return out[:n]


@pytest.mark.parametrize("seed", range(6))
def test_proposals_equal_brute_force(seed):
    rng = random.Random(seed)
    depth, factor, min_prob = rng.choice([(6, 1.0, 0.1), (8, 0.5, 0.0), (24, 2.0, 0.3)])
    finished = [_text(rng, rng.randint(5, 40)) for _ in range(5)]
    cache = GlobalSuffixCache(max_requests=3)
    for s in finished:
        cache.add(np.array(s))
    kept = finished[-3:]  # FIFO: the 3 newest
    own = TokenCorpus()
    tokens: list[int] = []
    for step in range(30):
        new = _text(rng, rng.randint(1, 4))
        tokens += new
        own.append(new, new_sequence=False)
        ctx = np.array(tokens[-depth:])
        k = rng.randint(1, 10)
        got_own = own.match_and_draft(ctx, depth, k, factor, min_prob)
        want_own = brute_force([], tokens, tokens[-depth:], depth, k, factor, min_prob)
        assert got_own[:2] == want_own[:2], (step, got_own, want_own)
        assert got_own[2] == pytest.approx(want_own[2])
        got_g = cache.corpus.match_and_draft(ctx, depth, k, factor, min_prob)
        want_g = brute_force(kept, None, tokens[-depth:], depth, k, factor, min_prob)
        assert got_g[:2] == want_g[:2], (step, got_g, want_g)


def test_global_cache_evicts_and_compacts():
    """FIFO eviction: an evicted output is never matched again; the buffer is compacted so
    it holds at most about twice the live tokens."""
    cache = GlobalSuffixCache(max_requests=2)
    a, b, c = [1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13]
    for s in (a, b, c):
        cache.add(np.array(s))
    assert cache.corpus.match_and_draft(np.array([1, 2]), 8, 4, 4.0, 0.0)[1] == []
    assert cache.corpus.match_and_draft(np.array([10, 11]), 8, 4, 4.0, 0.0)[1] == [12, 13]
    for i in range(200):
        cache.add(np.arange(100, 140) + i)
    assert len(cache.ranges) == 2
    assert cache.corpus.size <= 2 * (cache.live_tokens + 2) + 1024
    last = np.arange(100, 140) + 199
    assert cache.corpus.match_and_draft(last[:3], 8, 3, 2.0, 0.0)[1] == list(last[3:6])


def test_bad_keys_are_refused_naming_the_field():
    for key, value in [
        ("suffix_decoding_max_tree_depth", 1),
        ("suffix_decoding_max_cached_requests", -1),
        ("suffix_decoding_max_spec_factor", 0),
        ("suffix_decoding_min_token_prob", 1.5),
    ]:
        with pytest.raises(ValueError, match=key):
            SpeculativeConfig.from_dict({"method": "suffix", key: value})
    with pytest.raises(ValueError, match="model must not be set"):
        SpeculativeConfig.from_dict({"method": "suffix", "model": "x"})
    with pytest.raises(ValueError, match="grammar_aware_drafting"):
        SpeculativeConfig.from_dict({"method": "mtp", "grammar_aware_drafting": "yes"})
    with pytest.raises(ValueError, match="grammar_aware_drafting must stay true"):
        SpeculativeConfig.from_dict({"method": "jump_forward", "grammar_aware_drafting": False})
    cfg = SpeculativeConfig.from_dict({"method": "suffix"})
    assert cfg.num_speculative_tokens == 24  # K defaults to the tree depth
    assert (cfg.suffix_decoding_max_cached_requests, cfg.suffix_decoding_max_spec_factor) == (
        10000,
        1.0,
    )
    assert cfg.suffix_decoding_min_token_prob == 0.1


# ---- end to end -------------------------------------------------------------------------------

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(
    dtype="float32",
    max_model_len=192,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    disable_log_stats=False,
)
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "adaptive_num_speculative_tokens": False}


def _prompts() -> list[list[int]]:
    ps = make_prompts(512, [40, 9, 57], seed=41)
    return ps + [[7, 8, 9, 10, 11] * 6, ps[0]]


def _run(model, prompts, sp, spec=None, **kw):
    llm = LLM(model=model, speculative_config=spec, **{**COMMON, **kw})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], spec_decode_counts(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def bigram(llama_dir, tmp_path_factory) -> str:
    return make_llama_bigram_target(tmp_path_factory.mktemp("suffix_bigram"), llama_dir)


@pytest.mark.usefixtures("pp_forkserver")
@pytest.mark.parametrize(
    "sp,kw",
    [
        ("greedy", {}),
        ("seeded", {}),
        ("greedy", {"pipeline_parallel_size": 2}),
        ("seeded", {"tensor_parallel_size": 2}),
    ],
    ids=["greedy-p1", "seeded-p1", "greedy-p2", "seeded-tp2"],
)
def test_lossless(bigram, sp, kw):
    params = {"greedy": GREEDY, "seeded": SEEDED}[sp]
    ref, _ = _run(bigram, _prompts(), params)
    got, counts = _run(bigram, _prompts(), params, SUFFIX, **kw)
    assert got == ref
    assert counts[1] > 0 and counts[2] > 0  # drafts proposed and accepted


def test_global_cache_learns_across_requests_and_forgets(llama_dir):
    """The random Llama's output does not repeat its prompt, so a request's own tokens give
    little; the same request again matches the first one's output in the global cache and
    accepts more. With max_cached_requests=1, another request in between evicts it."""

    def accepted_per_run(cached: int, prompts: list[list[int]]) -> list[int]:
        llm = LLM(
            model=llama_dir,
            speculative_config={**SUFFIX, "suffix_decoding_max_cached_requests": cached},
            **COMMON,
        )
        try:
            out = []
            for p in prompts:
                before = spec_decode_counts(llm)[2]
                llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
                out.append(spec_decode_counts(llm)[2] - before)
            spec = llm.llm_engine.executor.worker.model_runner.speculator
            # The workers learn that a request finished with the next step: the last
            # request's output is not in the cache yet.
            assert len(spec.global_cache.ranges) == min(cached, len(prompts) - 1)
            return out
        finally:
            llm.shutdown()

    a, b = make_prompts(512, [30, 30], seed=43)
    first, again = accepted_per_run(10, [a, a])
    assert again >= MAX_TOKENS // 2 and again > first
    _, _, after_other = accepted_per_run(1, [a, b, a])
    assert after_other < again
    off = accepted_per_run(0, [a, a])
    assert off[1] == off[0]  # no global cache: the second run learns nothing


# ---- hybrid: a draft model and a draft-free proposer ------------------------------------------


def test_hybrid_keys_are_checked():
    base = {"method": "mtp", "num_speculative_tokens": 8}
    cfg = SpeculativeConfig.from_dict({**base, "hybrid_method": "suffix"})
    assert cfg.hybrid_model_num_speculative_tokens == 8 and cfg.hybrid_min_match_length == 4
    for extra, field in [
        ({"hybrid_method": "eagle"}, "hybrid_method"),
        ({"hybrid_method": "suffix", "hybrid_min_match_length": 0}, "hybrid_min_match_length"),
        (
            {"hybrid_method": "suffix", "hybrid_model_num_speculative_tokens": 9},
            "hybrid_model_num_speculative_tokens",
        ),
        ({"hybrid_model_num_speculative_tokens": 2}, "needs hybrid_method"),
    ]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_dict({**base, **extra})
    with pytest.raises(ValueError, match="token by token"):
        SpeculativeConfig.from_dict({"method": "ngram", "hybrid_method": "suffix"})


@pytest.mark.usefixtures("pp_forkserver")
@pytest.mark.parametrize("pp", [1, 2])
def test_hybrid_mtp_and_suffix_is_lossless_and_uses_both(pp):
    """The bundled model's MTP head beside suffix decoding: the first round of requests has
    nothing to match (the MTP head drafts its 2), the same requests again match the first
    round's outputs in the global cache (suffix drafts up to 8); every round's tokens equal the
    run without speculation (greedy and seeded)."""
    from vllm.config import default_model_path

    model = str(default_model_path())
    prompts = make_prompts(512, [23, 31, 17], seed=47)
    spec = {
        "method": "mtp",
        "num_speculative_tokens": 8,
        "hybrid_method": "suffix",
        "hybrid_model_num_speculative_tokens": 2,
        "adaptive_num_speculative_tokens": False,
    }
    batch = [{"prompt_token_ids": p} for p in prompts]
    for sp in (GREEDY, SEEDED):
        ref, _ = _run(model, prompts, sp, pipeline_parallel_size=pp)
        llm = LLM(model=model, speculative_config=spec, pipeline_parallel_size=pp, **COMMON)
        try:
            rounds = [llm.generate(batch, sp, use_tqdm=False) for _ in range(2)]
            counts = spec_decode_counts(llm)
            by = None
            if pp == 1:
                by = llm.llm_engine.executor.worker.model_runner.speculator.num_steps_by
        finally:
            llm.shutdown()
        for outs in rounds:
            assert [list(o.outputs[0].token_ids) for o in outs] == ref
        assert counts[1] > 0 and counts[2] > 0
        if by is not None:
            assert by["model"] > 0 and by["suffix"] > 0, by
