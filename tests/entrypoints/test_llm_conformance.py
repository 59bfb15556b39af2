# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""vLLM's Python surface on the bundled model: stop strings wait for min_tokens, refused
values raise VLLMValidationError (a ValueError; wrong types are also TypeError), max_logprobs,
priority scheduling, generation_config.json defaults, and beam search."""

from __future__ import annotations

import json

import pytest

from vllm import LLM, SamplingParams
from vllm.beam_search import BeamSearch, get_beam_search_score
from vllm.exceptions import VLLMValidationError
from vllm.outputs import Logprob
from vllm.sampling_params import BeamSearchParams

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def llm():
    # One request at a time: the order requests run in is the order they finish in.
    engine = LLM(max_model_len=256, scheduling_policy="priority", max_num_seqs=1, max_logprobs=6)
    yield engine
    engine.shutdown()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_stop_strings_wait_for_min_tokens(llm):
    """Regression: a stop string ended generation before min_tokens ("5 tokens <
    min_tokens=15"); as vLLM, stop strings count once more than min_tokens tokens are out."""
    free = llm.generate([PROMPT], greedy(40, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = free.text.split()[1][:4]
    early = llm.generate([PROMPT], greedy(40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 15
    held = llm.generate([PROMPT], greedy(40, stop=[stop], min_tokens=15), use_tqdm=False)[0]
    out = held.outputs[0]
    assert len(out.token_ids) > 15 and out.token_ids[:15] == free.token_ids[:15]
    if out.finish_reason == "stop":
        assert free.text.startswith(out.text) and free.text[len(out.text) :].startswith(stop)


def test_refused_values_raise_vllm_errors(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(VLLMValidationError, match="stop_token_ids") as e:
        llm.generate([PROMPT], greedy(2, stop_token_ids=[vocab]), use_tqdm=False)
    assert e.value.parameter == "stop_token_ids"
    # A wrong type is a TypeError (as vLLM raises) and a VLLMValidationError at once.
    for bad in (dict(stop_token_ids="x"), dict(n="2"), dict(ignore_eos="no")):
        with pytest.raises(TypeError) as te:
            SamplingParams(**bad)
        assert isinstance(te.value, VLLMValidationError) and isinstance(te.value, ValueError)
    with pytest.raises(VLLMValidationError) as ve:
        SamplingParams(top_p=1.5)
    assert not isinstance(ve.value, TypeError) and ve.value.parameter == "top_p"
    with pytest.raises(TypeError):
        llm.generate([PROMPT], sampling_params="greedy", use_tqdm=False)  # type: ignore[arg-type]
    # max_logprobs=6 for this engine: 6 is fine, 7 (or -1, the whole vocabulary) is not.
    out = llm.generate([PROMPT], greedy(2, logprobs=6), use_tqdm=False)[0].outputs[0]
    assert all(len(pos) >= 6 for pos in out.logprobs)
    for kw in (dict(logprobs=7), dict(logprobs=-1), dict(prompt_logprobs=7)):
        with pytest.raises(VLLMValidationError, match="max allowed: 6"):
            llm.generate([PROMPT], greedy(2, **kw), use_tqdm=False)


def test_priority_orders_the_waiting_requests(llm):
    prompts = [f"x{i} = {i}" for i in range(4)]
    priority = [3, -1, 2, 0]
    outs = llm.generate(prompts, greedy(3, ignore_eos=True), use_tqdm=False, priority=priority)
    started = sorted(range(4), key=lambda i: outs[i].metrics.first_token_time)
    assert started == sorted(range(4), key=lambda i: priority[i])  # [1, 3, 2, 0]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(prompts, greedy(1), use_tqdm=False, priority=[0])


def test_generation_config_defaults_and_eos_ids(llm, tmp_path):
    """generation_config.json as vLLM applies it: its eos_token_id list stops generation (not
    only the tokenizer's EOS), its sampling fields are the defaults of LLM.generate."""
    ref = llm.generate([PROMPT], greedy(8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_id = ref.token_ids[3]
    folder = tmp_path / "genconf"
    folder.mkdir()
    config = {"eos_token_id": [0, stop_id], "temperature": 0.0, "max_new_tokens": 8}
    (folder / "generation_config.json").write_text(json.dumps(config))
    other = LLM(max_model_len=256, generation_config=str(folder))
    try:
        defaults = other.get_default_sampling_params()
        assert defaults.temperature == 0.0 and defaults.max_tokens == 8
        out = other.generate([PROMPT], use_tqdm=False)[0].outputs[0]
        first = ref.token_ids.index(stop_id)
        assert out.token_ids == ref.token_ids[: first + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop_id
        kept = other.generate([PROMPT], greedy(8, ignore_eos=True), use_tqdm=False)[0]
        assert kept.outputs[0].token_ids == ref.token_ids  # ignore_eos ignores them all
    finally:
        other.shutdown()
    sp = SamplingParams(stop_token_ids=[7])
    sp.update_from_tokenizer(0)
    sp.update_from_generation_config({"eos_token_id": [0, 5]}, eos_token_id=0)
    assert sp.stop_token_ids == [7, 5] and sp.all_stop_token_ids == {0, 5, 7}


def test_beam_search(llm):
    """Against a brute-force score: every returned beam's cum_logprob is the sum of the
    engine's own prompt logprobs of its tokens, the beams come best first by vLLM's
    length-penalised score, and one beam is greedy search."""
    width, steps = 3, 4
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True)
    out = llm.beam_search([{"prompt": PROMPT}], params)[0].sequences
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    assert len(out) == width and len({tuple(b.tokens) for b in out}) == width
    for b in out:
        assert (
            b.tokens[: len(prompt_ids)] == prompt_ids and len(b.tokens) == len(prompt_ids) + steps
        )
        assert b.text == llm.get_tokenizer().decode(b.tokens)
        scored = llm.generate(
            [{"prompt_token_ids": b.tokens}], greedy(1, prompt_logprobs=0), use_tqdm=False
        )[0]
        want = sum(
            scored.prompt_logprobs[i][t].logprob
            for i, t in enumerate(b.tokens)
            if i >= len(prompt_ids)
        )
        assert b.cum_logprob == pytest.approx(want, abs=2e-3)
    scores = [get_beam_search_score(b.tokens, b.cum_logprob, None, 1.0) for b in out]
    assert scores == sorted(scores, reverse=True)
    g = llm.generate([PROMPT], greedy(steps, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    # The beams' logprobs come from prefill steps over each beam, greedy's from decode steps:
    # two attention kernels, the same values up to the bundled model's bf16 rounding (as above).
    assert out[0].cum_logprob >= g.outputs[0].cumulative_logprob - 2e-3
    one = llm.beam_search(
        [PROMPT], BeamSearchParams(beam_width=1, max_tokens=steps, ignore_eos=True)
    )
    assert one[0].sequences[0].tokens[len(prompt_ids) :] == list(g.outputs[0].token_ids)
    with pytest.raises(VLLMValidationError, match="max_tokens"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=300))


def test_beam_search_concurrency_limit(llm):
    """concurrency_limit searches the prompts a few at a time: the same beams as all at once,
    in the prompts' order; a bad limit is refused naming it."""
    prompts = [PROMPT, "def f(x):", "import os\n"]
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)

    def beams(outs):
        return [[(b.tokens, round(b.cum_logprob, 4)) for b in o.sequences] for o in outs]

    together = beams(llm.beam_search(prompts, params))
    assert beams(llm.beam_search(prompts, params, concurrency_limit=2)) == together
    assert beams(llm.beam_search(prompts, params, concurrency_limit=1)) == together
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(prompts, params, concurrency_limit=0)


def _lp(values: dict[int, float]) -> dict[int, Logprob]:
    return {t: Logprob(v) for t, v in values.items()}


def test_beam_search_length_penalty_and_early_stopping():
    """The search on hand-made candidates: EOS ends a beam, length_penalty decides between a
    short finished beam and a longer live one, early_stopping ends a prompt once beam_width
    beams have finished."""
    eos = 0

    def run(length_penalty: float, early: bool) -> BeamSearch:
        p = BeamSearchParams(2, 3, length_penalty=length_penalty, early_stopping=early)
        s = BeamSearch([[5, 6]], p, eos)
        s.advance([_lp({eos: -1.0, 7: -1.2, 8: -3.0})])  # [5,6,EOS] finishes; [5,6,7], [5,6,8]
        if not s.done:
            s.advance([_lp({eos: -0.5, 9: -0.1}), _lp({eos: -0.2, 9: -4.0})])
        return s

    s = run(1.0, early=True)
    assert s.done and s.steps == 2  # three beams ended in EOS by step 2
    ends = [b.tokens for b in s.outputs()[0].sequences]
    assert all(t[-1] == eos for t in ends)
    assert not run(1.0, early=False).done  # without early stopping the live beams go on
    # Score = cum_logprob / len ** length_penalty (length without the final EOS).
    for lp in (0.0, 2.0):
        best = run(lp, early=False).outputs()[0].sequences[0]
        cands = [([5, 6, eos], -1.0), ([5, 6, 7, 9], -1.3), ([5, 6, 7, eos], -1.7)]
        cands += [([5, 6, 8, eos], -3.2)]
        want = max(cands, key=lambda c: get_beam_search_score(c[0], c[1], eos, lp))
        assert best.tokens == want[0], lp
