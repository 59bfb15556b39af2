# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Offline behaviours vLLM's own tests rely on: logprobs only for the requests that ask,
detokenize=False leaving every text empty, the engine arguments vLLM accepts (logprobs_mode,
structured_outputs_config, load_format, async_scheduling) and its dotted config flags, and
per-request logits processors refused with a ValueError."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import JSONArgError, expand_dotted_config_flags
from vllm.testing.engine_utils import make_prompts

COMMON = dict(dtype="float32", max_model_len=128)


@pytest.fixture(scope="module")
def llm(llama_dir):
    llm = LLM(
        model=llama_dir,
        logprobs_mode="raw_logprobs",
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": False},
        load_format="auto",
        async_scheduling=True,
        **COMMON,
    )
    yield llm
    llm.shutdown()


def test_logprobs_only_for_the_requests_that_ask(llm):
    """A request without logprobs batched with ones that ask gets logprobs None and
    cumulative_logprob None (vLLM), not [] and 0.0."""
    prompts = [{"prompt_token_ids": p} for p in make_prompts(512, [5, 9, 7], seed=3)]
    sps = [
        SamplingParams(temperature=0, max_tokens=4, logprobs=2),
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=0, max_tokens=4, logprobs=0),
    ]
    asked, plain, zero = (o.outputs[0] for o in llm.generate(prompts, sps, use_tqdm=False))
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert len(asked.logprobs) == 4 and asked.cumulative_logprob is not None
    assert all(len(d) == 1 for d in zero.logprobs)  # the sampled token only


def test_detokenize_false_leaves_every_text_empty(llm):
    prompt = {"prompt_token_ids": make_prompts(512, [6], seed=4)[0]}
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=2, detokenize=False)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 4
    assert all(lp.decoded_token is None for d in out.logprobs for lp in d.values())
    with_text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    lps = with_text[0].outputs[0].logprobs
    assert all(isinstance(lp.decoded_token, str) for d in lps for lp in d.values())


def test_engine_arguments_are_checked(llama_dir):
    for kwargs, field in [
        ({"logprobs_mode": "softmax"}, "logprobs_mode"),
        ({"load_format": "pt"}, "load_format"),
        ({"structured_outputs_config": {"backend": "outlines"}}, "backend"),
        ({"structured_outputs_config": {"whitespace": 1}}, "whitespace"),
    ]:
        with pytest.raises(ValueError, match=field):
            LLM(model=llama_dir, **kwargs, **COMMON)


def test_per_request_logits_processors_are_a_value_error():
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    SamplingParams(logits_processors=None)  # vLLM's default


def test_dotted_config_flags():
    argv = [
        "serve",
        "m",
        "--speculative-config",
        '{"method": "mtp"}',
        "--speculative-config.num_speculative_tokens=2",
        "--structured-outputs-config.backend",
        "xgrammar",
        "--structured-outputs-config.disable-any-whitespace",
        "true",
        "--port",
        "8000",
    ]
    out = expand_dotted_config_flags(argv)
    assert out[:4] == ["serve", "m", "--port", "8000"]
    i = out.index("--speculative-config")
    assert out[i + 1] == '{"method": "mtp", "num_speculative_tokens": 2}'
    j = out.index("--structured-outputs-config")
    assert out[j + 1] == '{"backend": "xgrammar", "disable_any_whitespace": true}'
    with pytest.raises(JSONArgError, match="needs a value"):
        expand_dotted_config_flags(["--speculative-config.method"])
    # Flags that are not JSON objects keep their dots (e.g. a served model name).
    assert expand_dotted_config_flags(["--served-model-name", "a.b"]) == [
        "--served-model-name",
        "a.b",
    ]


def test_float16_on_cpu_runs_as_bfloat16(llama_dir, caplog):
    """As vLLM's CPU platform: dtype float16 has no fast path on a CPU, so the model runs in
    bfloat16 with a warning (vLLM's harness starts SmolLM2 with --dtype half)."""
    import torch

    from vllm.config import model as model_config

    model_config._warn_fp16_on_cpu.cache_clear()
    with caplog.at_level("WARNING"):
        llm = LLM(model=llama_dir, dtype="half", max_model_len=64)
    try:
        runner = llm.llm_engine.executor.worker.model_runner
        assert runner.dtype == torch.bfloat16
        params = {p.dtype for p in runner.model.parameters() if p.is_floating_point()}
        assert torch.float16 not in params
        out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    assert any("running the model in bfloat16" in r.message for r in caplog.records)


def test_watchdog_generate_returns_when_blocks_leak(llama_dir):
    """No generate call can hang on blocks that will never come back: with most of the pool
    held outside any request (a leak), a request that fits the pool but not what is left
    finishes with finish_reason "error" while nothing runs, the other requests of the call
    finish normally, and the engine serves again once the blocks are back."""
    llm = LLM(model=llama_dir, block_size=4, num_gpu_blocks_override=64, **COMMON)
    try:
        pool = llm.llm_engine.scheduler.kv_cache_manager.pool
        leaked = pool.take(pool.num_free_blocks - 3)  # 3 blocks = 12 tokens left
        sp = SamplingParams(temperature=0, max_tokens=4)
        big, small = make_prompts(512, [20, 4], seed=5)
        outs = llm.generate([{"prompt_token_ids": big}, {"prompt_token_ids": small}], sp)
        assert outs[0].outputs[0].finish_reason == "error"
        assert outs[1].outputs[0].finish_reason == "length"
        pool.give_back(leaked)
        again = llm.generate([{"prompt_token_ids": big}], sp)
        assert again[0].outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()
