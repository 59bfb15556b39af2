# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Our engine against HF transformers (fp32): full-vocab logprobs of the prompt and of decode
steps, and greedy generation token for token, for each supported family."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import assert_logprobs_match_hf, hf_greedy, make_prompts

FAMILIES = [
    "llama_dir",
    "llama_tied_dir",
    "llama3_rope_dir",
    "qwen2_dir",
    "deepseek_v3_dir",
    "deepseek_v3_qlora_dir",
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    path = request.getfixturevalue(request.param)
    # max_logprobs=-1: every token's logprob is compared (vLLM caps them at 20 by default).
    llm = LLM(model=path, dtype="float32", max_model_len=256, block_size=8, max_logprobs=-1)
    yield path, llm
    llm.shutdown()


def test_logprobs_match_hf(family):
    path, llm = family
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = make_prompts(vocab, [21], seed=1)[0]
    sp = SamplingParams(
        temperature=0, max_tokens=4, logprobs=-1, prompt_logprobs=-1, ignore_eos=True
    )
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert_logprobs_match_hf(path, out, prompt)


def test_greedy_matches_hf_generate(family):
    path, llm = family
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = make_prompts(vocab, [5, 17, 33], seed=2)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, p, 12)
