# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Seeded sampling does not depend on the batch, with and without speculative decoding.

One seeded request (temperature 0.8, top-p 0.95) on a DeepSeek-V3 whose MTP head agrees with
the target part of the time (drafts get accepted and rejected): its text is the same alone, in
a batch of 12 identical copies, batched with other sampled requests, with chunked prefill and
preemption (tiny token budget and KV cache) and at P = 2, without speculation and with MTP
K = 2 (greedy and probabilistic drafts). Every draw is keyed by (seed, position) and the
verifier emits the target's own keyed sample at each position, so the text is also the one
speculation-free sampling gives; the reference is that run alone.
"""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts
from vllm.testing.spec_checkpoints import make_mtp_self_draft

pytestmark = pytest.mark.usefixtures("pp_forkserver")

SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=123, max_tokens=24, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=16, disable_log_stats=False)
SPECS = {
    "nospec": None,
    "mtp_greedy_drafts": {
        "method": "mtp",
        "adaptive_num_speculative_tokens": False,
        "num_speculative_tokens": 2,
    },
    "mtp_sampled_drafts": {
        "method": "mtp",
        "adaptive_num_speculative_tokens": False,
        "num_speculative_tokens": 2,
        "draft_sample_method": "probabilistic",
    },
}


@pytest.fixture(scope="module")
def model(deepseek_v3_mtp1_dir, tmp_path_factory) -> str:
    return make_mtp_self_draft(
        tmp_path_factory.mktemp("seeded_near"), deepseek_v3_mtp1_dir, target_scale=0.2
    )


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return make_prompts(512, [19], seed=21)[0]


@pytest.fixture(scope="module")
def others() -> tuple[list[list[int]], list[SamplingParams]]:
    ps = make_prompts(512, [33, 4, 27, 11, 40], seed=22)
    sps = [
        SamplingParams(temperature=1.0, seed=7 + i, max_tokens=20, ignore_eos=True)
        for i in range(len(ps))
    ]
    return ps, sps


def _gen(llm: LLM, prompts, sps) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _accepted(llm: LLM) -> tuple[int, int]:
    m = {x.name: x for x in llm.get_metrics()}
    if "vllm:spec_decode_num_draft_tokens" not in m:
        return 0, 0
    return (
        int(m["vllm:spec_decode_num_draft_tokens"].value),
        int(m["vllm:spec_decode_num_accepted_tokens"].value),
    )


@pytest.fixture(scope="module")
def reference(model, prompt) -> list[int]:
    llm = LLM(model=model, **COMMON)
    try:
        return _gen(llm, [prompt], SEEDED)[0]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("spec", list(SPECS))
def test_alone_batched_and_identical_copies(model, prompt, others, reference, spec) -> None:
    llm = LLM(model=model, speculative_config=SPECS[spec], **COMMON)
    try:
        alone = _gen(llm, [prompt], SEEDED)[0]
        copies = _gen(llm, [prompt] * 12, SEEDED)
        ps, sps = others
        mixed = _gen(llm, ps[:2] + [prompt] + ps[2:], sps[:2] + [SEEDED] + sps[2:])
        drafted, accepted = _accepted(llm)
    finally:
        llm.shutdown()
    assert alone == reference
    assert all(c == reference for c in copies), len({tuple(c) for c in copies})
    assert mixed[2] == reference
    if SPECS[spec] is not None:
        assert 0 < accepted < drafted, (accepted, drafted)  # both branches of the verifier ran


@pytest.mark.parametrize("spec", list(SPECS))
def test_chunked_prefill_and_preemption(model, prompt, others, reference, spec) -> None:
    probe = LLM(model=model, block_size=4, **COMMON)
    per_block = probe.llm_engine.executor.worker.model_runner.kv_cache_bytes_per_block()
    probe.shutdown()
    llm = LLM(
        model=model,
        speculative_config=SPECS[spec],
        block_size=4,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=24 * per_block,
        # Within the pool (18 blocks with the draft's KV) and above the longest request (60).
        **{**COMMON, "max_model_len": 64},
    )
    try:
        ps, sps = others
        out = _gen(llm, ps[:3] + [prompt] + ps[3:], sps[:3] + [SEEDED] + sps[3:])
        preemptions = {m.name: m for m in llm.get_metrics()}["vllm:num_preemptions"].value
    finally:
        llm.shutdown()
    assert preemptions > 0
    assert out[3] == reference


@pytest.mark.parametrize("spec", ["nospec", "mtp_sampled_drafts"])
def test_pp2(model, prompt, others, reference, spec) -> None:
    llm = LLM(model=model, speculative_config=SPECS[spec], pipeline_parallel_size=2, **COMMON)
    try:
        ps, sps = others
        out = _gen(llm, [prompt] * 3 + ps, [SEEDED] * 3 + sps)
    finally:
        llm.shutdown()
    assert out[:3] == [reference] * 3


def test_probabilistic_drafts_of_an_exact_head_are_all_accepted(
    deepseek_v3_mtp1_dir, tmp_path_factory
) -> None:
    """The self-draft's MTP head computes the target's own next-token distribution, so a
    probabilistic draft drawn with the verifier's noise (same seed, same position) is the
    target's sample: every draft is accepted. Drawing it at any other position key, or with
    unrelated noise, would accept only where two independent draws happen to agree."""
    exact = make_mtp_self_draft(tmp_path_factory.mktemp("seeded_exact"), deepseek_v3_mtp1_dir)
    spec = {
        "method": "mtp",
        "adaptive_num_speculative_tokens": False,
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
    }
    prompts = make_prompts(512, [9, 17, 5], seed=23)
    sps = [
        SamplingParams(temperature=1.0, seed=40 + i, max_tokens=16, ignore_eos=True)
        for i in range(len(prompts))
    ]
    llm = LLM(model=exact, speculative_config=spec, **COMMON)
    try:
        _gen(llm, prompts, sps)
        drafted, accepted = _accepted(llm)
    finally:
        llm.shutdown()
    assert drafted > 0 and accepted == drafted, (accepted, drafted)
