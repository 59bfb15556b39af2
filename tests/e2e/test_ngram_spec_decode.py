# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Prompt-lookup (n-gram) speculation end to end: lossless against no speculation and against
HF transformers at P = 1 / 2 / 4 (greedy and seeded sampling, prefix caching on, chunked
prefill), the same speculation counts at every P, and on a bigram target (whose greedy output
cycles, so its own history predicts it) exactly the acceptance a brute-force prompt-lookup
simulation over the greedy output predicts."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import hf_greedy, make_prompts, spec_decode_counts
from vllm.testing.spec_checkpoints import make_llama_bigram_target

pytestmark = pytest.mark.usefixtures("pp_forkserver")

K = 3
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Low enough that the bigram target's sampled text still mostly follows its map, so lookups
# are accepted whatever the random stream (seeds 11-13: 3-16 accepted tokens at 0.3; at 0.8
# none for any of them - acceptance there was one stream's luck).
SEEDED = SamplingParams(
    temperature=0.3, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True
)
# Chunked prefill (a budget smaller than the longest prompt) and prefix caching (on by default;
# the repeated prompt hits the cache).
COMMON = dict(
    dtype="float32",
    max_model_len=192,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    disable_log_stats=False,
)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive_num_speculative_tokens": False,
}


def _prompts() -> list[list[int]]:
    ps = make_prompts(512, [40, 9, 57], seed=31)
    rep = [7, 8, 9, 10, 11] * 6  # a repetitive prompt: lookup has matches from the start
    return ps + [rep, ps[0]]


def _run(model: str, prompts, sp, spec=None, pp: int = 1, **kw):
    llm = LLM(model=model, speculative_config=spec, pipeline_parallel_size=pp, **{**COMMON, **kw})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], spec_decode_counts(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def bigram(llama_dir, tmp_path_factory) -> str:
    return make_llama_bigram_target(tmp_path_factory.mktemp("ngram_bigram"), llama_dir)


@pytest.fixture(scope="module")
def runs(llama_dir, bigram):
    cache: dict = {}

    def get(model: str, sp_name: str, spec: bool, pp: int):
        key = (model, sp_name, spec, pp)
        if key not in cache:
            m = {"llama": llama_dir, "bigram": bigram}[model]
            sp = {"greedy": GREEDY, "seeded": SEEDED}[sp_name]
            cache[key] = _run(m, _prompts(), sp, NGRAM if spec else None, pp)
        return cache[key]

    return get


@pytest.mark.parametrize("model", ["llama", "bigram"])
@pytest.mark.parametrize("sp", ["greedy", "seeded"])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_lossless_and_counts_equal_across_p(runs, model, sp, pp):
    base, _ = runs(model, sp, False, 1)
    spec_out, counts = runs(model, sp, True, pp)
    assert spec_out == base
    assert counts == runs(model, sp, True, 1)[1]
    if model == "bigram":
        assert counts[2] > 0  # the lookup's drafts were accepted


def test_greedy_equals_hf(runs, llama_dir, bigram):
    for name, path in (("llama", llama_dir), ("bigram", bigram)):
        out, _ = runs(name, "greedy", True, 1)
        for p, o in zip(_prompts()[:2], out[:2]):
            assert o == hf_greedy(path, p, MAX_TOKENS)


def _lookup(tokens: list[int], lo: int, hi: int, k: int) -> list[int] | None:
    """Brute force: the longest suffix n-gram (hi..lo) with an earlier occurrence; the K
    tokens after its latest one, continued periodically past the end."""
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - 1, n - 1, -1):
            if tokens[start - n : start] == suffix:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[start + i])
                return ext[L:]
    return None


def _simulate(prompts, outs, k: int, lo: int, hi: int, max_tokens: int) -> tuple:
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * k
    for p, out in zip(prompts, outs):
        n = 1
        while n < max_tokens:
            prop = _lookup(p + out[:n], lo, hi, k)
            if prop is None:
                n += 1
                continue
            acc = 0
            while acc < k and prop[acc] == out[n + acc]:
                acc += 1
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + k, accepted + acc
            for i in range(acc):
                per_pos[i] += 1
            n += acc + 1
    return drafts, draft_tokens, accepted, per_pos


def test_acceptance_is_exactly_the_simulated_one(runs, bigram):
    """The engine's counts equal the brute-force lookup over the no-spec greedy output (which
    runs K + 1 tokens past max_tokens, so every last step's drafts can be checked)."""
    prompts = _prompts()
    long_sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K + 1, ignore_eos=True)
    ref, _ = _run(bigram, prompts, long_sp)
    _, counts = runs("bigram", "greedy", True, 1)
    sim = _simulate(prompts, ref, K, 1, 3, MAX_TOKENS)
    assert sim[2] > 0
    assert tuple(counts[:3]) == sim[:3]
    assert list(counts[3]) == sim[3]


def _cycle_prompt(bigram) -> tuple[list[int], list[int]]:
    """The cycle the bigram target's greedy orbit of token 5 enters (the greedy map is
    deterministic), and a prompt of whole periods of it (at least 2, at least 6 tokens)."""
    first, _ = _run(bigram, [[5]], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    seq = [5] + first[0]
    seen: dict[int, int] = {}
    for i, t in enumerate(seq):
        if t in seen:
            cycle = seq[seen[t] : i]
            return cycle, cycle * max(2, -(-6 // len(cycle)))
        seen[t] = i
    pytest.skip("no cycle within 64 tokens")


def test_repetitive_prompt_accepts_every_draft(bigram):
    """A bigram target fed a cycle of its own greedy map continues the cycle: once the prompt
    holds one period, every draft is accepted (acceptance known in closed form: K per step)."""
    cycle, prompt = _cycle_prompt(bigram)
    sp = SamplingParams(temperature=0, max_tokens=4 * (K + 1) + 1, ignore_eos=True)
    out, counts = _run(bigram, [prompt], sp, NGRAM)
    assert out[0] == [cycle[i % len(cycle)] for i in range(len(out[0]))]
    drafts, draft_tokens, accepted, per_pos = counts
    # 1 token from the prefill, then 4 steps of K accepted drafts + 1 bonus token.
    assert (drafts, draft_tokens, accepted) == (4, 4 * K, 4 * K)
    assert list(per_pos) == [4] * K


def test_stop_string_inside_accepted_drafts(bigram):
    """A stop string completed by a token in the middle of a step's accepted drafts ends the
    output at that token, as without speculation: the same token ids (none of the step's later
    tokens), text, logprobs and finish reason. The repetitive prompt accepts every draft, so a
    step brings K + 1 tokens and the stops (each output token's text, in turn) fall at every
    place inside a step."""
    _, prompt = _cycle_prompt(bigram)
    llm = LLM(model=bigram, **COMMON)
    try:
        tok = llm.get_tokenizer()
        free, _ = _run(bigram, [prompt], SamplingParams(temperature=0, max_tokens=12))
        stops = list(dict.fromkeys(s for t in free[0] if (s := tok.decode([t])).strip()))
        sps = [
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s], logprobs=2)
            for s in stops
        ]

        def outputs(engine):
            res = engine.generate([{"prompt_token_ids": prompt}] * len(sps), sps, use_tqdm=False)
            return [
                (list(c.token_ids), c.text, c.finish_reason, c.stop_reason, c.logprobs)
                for c in (o.outputs[0] for o in res)
            ]

        ref = outputs(llm)
    finally:
        llm.shutdown()
    spec = LLM(model=bigram, speculative_config=NGRAM, **COMMON)
    try:
        got = outputs(spec)
        assert spec_decode_counts(spec)[2] > 0
    finally:
        spec.shutdown()
    assert got == ref
    assert all(r[2] == "stop" for r in ref)
    # 1 token from the prefill, then steps of K + 1: stops that end a step mid-way.
    assert any((len(r[0]) - 1) % (K + 1) for r in ref)
