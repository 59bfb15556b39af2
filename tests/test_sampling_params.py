# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""SamplingParams refuses, with a ValueError naming the field, every value that would not fit
the workers' 64-bit / float32 per-request slots; the engine re-checks fields set later, so
nothing a caller sets can raise inside a stage."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm import LLM, SamplingParams

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

BAD = [
    (dict(seed=INT64_MAX + 1), "seed"),
    (dict(seed=INT64_MIN - 1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(top_k=INT64_MAX + 1), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(min_tokens=INT64_MAX + 1, max_tokens=None), "min_tokens"),
    (dict(max_tokens=2**64), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=INT64_MAX + 1), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids="7"), "stop_token_ids"),
    (dict(stop=5), "stop"),
    (dict(n=True), "n"),
    (dict(n=0), "n"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=1e39), "temperature"),  # inf once stored as float32
    (dict(top_p=math.nan), "top_p"),
    (dict(min_p=-math.inf), "min_p"),
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(logit_bias={"a": 1.0}), "logit_bias"),
    (dict(logit_bias={3: math.nan}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids"),
    (dict(bad_words=[3]), "bad_words"),
]


@pytest.mark.parametrize(
    "kwargs, field", BAD, ids=[f"{f}={list(k.values())[0]!r}"[:40] for k, f in BAD]
)
def test_bad_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_edges_and_numpy_scalars_are_accepted():
    SamplingParams(seed=INT64_MAX, n=2)
    SamplingParams(seed=INT64_MIN, top_k=INT64_MAX, min_tokens=INT64_MAX, max_tokens=None)
    SamplingParams(seed=np.int64(3), temperature=np.float32(0.5), top_k=-1)


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = LLM(model=str(llama_dir), dtype="float32", max_model_len=64)
    yield engine
    engine.shutdown()


def test_engine_rechecks_fields_set_after_construction(llm):
    sp = SamplingParams(max_tokens=2)
    sp.seed = 2**70
    with pytest.raises(ValueError, match=r"SamplingParams\.seed"):
        llm.generate(["a"], sp, use_tqdm=False)
    out = llm.generate(["a"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_seed_int64_max_with_n2_wraps(llm):
    """Completion i of an n > 1 request uses seed + i wrapped into int64: completion 1 of
    seed 2**63 - 1 is what seed -2**63 alone samples."""
    kw = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    two = llm.generate(["x = "], SamplingParams(n=2, seed=INT64_MAX, **kw), use_tqdm=False)[0]
    one = llm.generate(["x = "], SamplingParams(seed=INT64_MIN, **kw), use_tqdm=False)[0]
    assert len(two.outputs) == 2
    assert two.outputs[1].token_ids == one.outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(logit_bias={10**6: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[1, 10**6]), "allowed_token_ids"),
    ],
)
def test_engine_refuses_token_ids_outside_the_vocabulary(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["a"], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)


def test_logit_bias_string_keys_and_bad_words_tokenized(llm):
    sp = SamplingParams(logit_bias={"5": 1.0}, bad_words=" hello")
    assert sp.logit_bias == {5: 1.0} and sp.bad_words == [" hello"]
    tok = llm.get_tokenizer()
    llm.llm_engine.check_request(sp)
    plain = tok.encode("hello", add_special_tokens=False)
    spaced = tok.encode(" hello", add_special_tokens=False)
    want = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
    assert sp.bad_words_token_ids == want
