# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Speculative decoding end to end: greedy output with speculation equals greedy output without
it (MTP on DeepSeek-V3 with 1 and 2 MTP layers, EAGLE3 on Llama and Qwen2 with and without the
draft's own embedding, EAGLE-1 on Llama, K = 1, 2, 3, chunked prefill and preemption), a
self-draft accepts everything, the metrics add up, and seeded sampling stays reproducible."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts
from vllm.testing.spec_checkpoints import (
    make_eagle3_draft,
    make_eagle_draft,
    make_llama_bigram_target,
    make_mtp_self_draft,
)

LENGTHS = [40, 23, 57, 9, 3, 30]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=256, max_num_seqs=8, disable_log_stats=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(512, LENGTHS, seed=5)


def _gen(llm: LLM, prompts, sp=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _run(model: str, prompts, sp=GREEDY, **kw):
    llm = LLM(model=model, **{**COMMON, **kw})
    try:
        outs = _gen(llm, prompts, sp)
        return outs, {m.name: m for m in llm.get_metrics()}
    finally:
        llm.shutdown()


def _spec_counts(metrics) -> tuple[int, int, int, list[int]]:
    return (
        metrics["vllm:spec_decode_num_drafts"].value,
        metrics["vllm:spec_decode_num_draft_tokens"].value,
        metrics["vllm:spec_decode_num_accepted_tokens"].value,
        list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
    )


def _check_metrics(metrics, k: int) -> tuple[int, int, int, list[int]]:
    drafts, draft_tokens, accepted, per_pos = _spec_counts(metrics)
    assert drafts > 0
    assert draft_tokens <= k * drafts
    assert sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert len(per_pos) <= k
    return drafts, draft_tokens, accepted, per_pos


class _Baselines:
    """No-speculation greedy output per checkpoint, computed once."""

    def __init__(self, prompts) -> None:
        self.prompts = prompts
        self.cache: dict[str, list[list[int]]] = {}

    def __call__(self, model: str) -> list[list[int]]:
        if model not in self.cache:
            self.cache[model] = _ids(_run(model, self.prompts)[0])
        return self.cache[model]


@pytest.fixture(scope="module")
def baseline(prompts):
    return _Baselines(prompts)


@pytest.fixture(scope="module")
def eagle3_llama_dir(llama_dir, tmp_path_factory):
    return make_eagle3_draft(
        tmp_path_factory.mktemp("eagle3_llama"), llama_dir, aux_layers=(1, 2, 3)
    )


@pytest.fixture(scope="module")
def eagle3_llama_noembed_dir(llama_dir, tmp_path_factory):
    return make_eagle3_draft(
        tmp_path_factory.mktemp("eagle3_llama_ne"),
        llama_dir,
        aux_layers=(0, 2, 4),
        own_embed=False,
        norm_before_residual=True,
        seed=1,
    )


@pytest.fixture(scope="module")
def eagle3_qwen2_dir(qwen2_dir, tmp_path_factory):
    # No embedding, reduced draft vocabulary (d2t), taps given unsorted.
    return make_eagle3_draft(
        tmp_path_factory.mktemp("eagle3_qwen2"),
        qwen2_dir,
        aux_layers=(3, 1, 2),
        own_embed=False,
        draft_vocab_size=300,
        seed=2,
    )


@pytest.fixture(scope="module")
def self_draft_dir(deepseek_v3_mtp1_dir, tmp_path_factory):
    return make_mtp_self_draft(tmp_path_factory.mktemp("mtp_self"), deepseek_v3_mtp1_dir)


@pytest.fixture(scope="module")
def self_draft2_dir(deepseek_v3_mtp2_dir, tmp_path_factory):
    return make_mtp_self_draft(tmp_path_factory.mktemp("mtp_self2"), deepseek_v3_mtp2_dir)


@pytest.fixture(scope="module")
def near_self_dir(deepseek_v3_mtp1_dir, tmp_path_factory):
    """Target with its attention/MLP outputs scaled by 0.2: the MTP head agrees often, not
    always, so steps accept 0..K drafts."""
    return make_mtp_self_draft(
        tmp_path_factory.mktemp("mtp_near_self"), deepseek_v3_mtp1_dir, target_scale=0.2
    )


@pytest.fixture(scope="module")
def eagle_random_dir(llama_dir, tmp_path_factory):
    """EAGLE-1 head, 2 layers, fc with bias, shares the target's embedding and LM head."""
    return make_eagle_draft(
        tmp_path_factory.mktemp("eagle_random"), llama_dir, num_layers=2, fc_bias=True, seed=3
    )


@pytest.fixture(scope="module")
def eagle_self_dir(llama_dir, tmp_path_factory):
    return make_eagle_draft(tmp_path_factory.mktemp("eagle_self"), llama_dir, self_draft=True)


@pytest.fixture(scope="module")
def llama_bigram_dir(llama_dir, tmp_path_factory):
    """A Llama whose last hidden state at a token is that token's embedding: the self EAGLE-1
    head predicts it exactly."""
    return make_llama_bigram_target(tmp_path_factory.mktemp("llama_bigram"), llama_dir)


@pytest.fixture(scope="module")
def llama_near_bigram_dir(llama_dir, tmp_path_factory):
    return make_llama_bigram_target(
        tmp_path_factory.mktemp("llama_near_bigram"), llama_dir, target_scale=0.3
    )


# ---- lossless greedy --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ckpt, k",
    [("deepseek_v3_mtp1_dir", 1), ("deepseek_v3_mtp1_dir", 3), ("deepseek_v3_mtp2_dir", 2)],
)
def test_mtp_greedy_lossless(request, prompts, baseline, ckpt, k):
    model = request.getfixturevalue(ckpt)
    outs, metrics = _run(
        model,
        prompts,
        speculative_config={
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        },
    )
    assert _ids(outs) == baseline(model)
    _check_metrics(metrics, k)


@pytest.mark.parametrize(
    "target, draft, k",
    [
        ("llama_dir", "eagle3_llama_dir", 2),
        ("llama_dir", "eagle3_llama_noembed_dir", 1),
        ("qwen2_dir", "eagle3_qwen2_dir", 3),
    ],
)
def test_eagle3_greedy_lossless(request, prompts, baseline, target, draft, k):
    model = request.getfixturevalue(target)
    spec = {
        "method": "eagle3",
        "model": request.getfixturevalue(draft),
        "adaptive_num_speculative_tokens": False,
        "num_speculative_tokens": k,
    }
    outs, metrics = _run(model, prompts, speculative_config=spec)
    assert _ids(outs) == baseline(model)
    _check_metrics(metrics, k)


@pytest.mark.parametrize("target, draft, k", [("llama_dir", "eagle_random_dir", 2)])
def test_eagle_greedy_lossless(request, prompts, baseline, target, draft, k):
    model = request.getfixturevalue(target)
    spec = {
        "method": "eagle",
        "model": request.getfixturevalue(draft),
        "adaptive_num_speculative_tokens": False,
        "num_speculative_tokens": k,
    }
    outs, metrics = _run(model, prompts, speculative_config=spec)
    assert _ids(outs) == baseline(model)
    _check_metrics(metrics, k)


@pytest.mark.parametrize("method", ["mtp", "eagle3", "eagle"])
def test_lossless_with_chunked_prefill_and_preemption(
    request, prompts, baseline, method, near_self_dir, qwen2_dir
):
    """Small token budget (prompts arrive in chunks while others verify drafts) and a KV cache
    too small for all requests (the newest running request is preempted and recomputed)."""
    if method == "mtp":
        model, k = near_self_dir, 3
        spec = {
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        }
    elif method == "eagle3":
        model, k = qwen2_dir, 2
        spec = {
            "method": "eagle3",
            "model": request.getfixturevalue("eagle3_qwen2_dir"),
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        }
    else:
        model, k = request.getfixturevalue("llama_near_bigram_dir"), 3
        spec = {
            "method": "eagle",
            "model": request.getfixturevalue("eagle_self_dir"),
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        }
    probe = LLM(model=model, **COMMON, speculative_config=spec)
    per_block = probe.llm_engine.executor.worker.model_runner.kv_cache_bytes_per_block()
    probe.shutdown()
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs, metrics = _run(
        model,
        prompts,
        sp,
        speculative_config=spec,
        max_num_batched_tokens=32,
        kv_cache_memory_bytes=10 * per_block,
        max_model_len=10 * probe.llm_engine.vllm_config.cache_config.block_size - k,
    )
    assert _ids(outs) == baseline(model)
    assert metrics["vllm:num_preemptions"].value > 0
    drafts, _, accepted, per_pos = _check_metrics(metrics, k)
    if method in ("mtp", "eagle"):
        # Mixed acceptance: some drafts accepted, not all.
        assert 0 < accepted < k * drafts
        assert per_pos[0] > 0
    # Logprobs of verified tokens come from the right logits rows.
    ref, _ = _run(model, prompts, sp)
    for o, r in zip(outs, ref):
        for lp, rlp, tok in zip(
            o.outputs[0].logprobs, r.outputs[0].logprobs, o.outputs[0].token_ids
        ):
            assert lp[tok].logprob == pytest.approx(rlp[tok].logprob, abs=1e-4)
            assert set(lp) == set(rlp)


# ---- acceptance ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ckpt, k", [("self_draft_dir", 1), ("self_draft_dir", 3), ("self_draft2_dir", 2)]
)
def test_self_draft_accepts_everything(request, prompts, baseline, ckpt, k):
    model = request.getfixturevalue(ckpt)
    # Prompts of >= 2 tokens: at position 0 the MTP layer sees no embedding by design.
    outs, metrics = _run(
        model,
        prompts,
        speculative_config={
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        },
    )
    assert _ids(outs) == baseline(model)
    drafts, draft_tokens, accepted, per_pos = _check_metrics(metrics, k)
    assert draft_tokens == k * drafts
    assert accepted == k * drafts
    assert per_pos == [drafts] * k


def test_eagle_self_head_accepts_everything(prompts, llama_bigram_dir, eagle_self_dir):
    """A constructed EAGLE-1 head that predicts its target's next feature exactly (the target
    a bigram model, the head passing the next token's embedding through): 100% acceptance,
    which needs the feature to be the target's normed last hidden state and the draft to embed
    with the target's table and score with its LM head."""
    k = 3
    spec = {
        "method": "eagle",
        "model": eagle_self_dir,
        "adaptive_num_speculative_tokens": False,
        "num_speculative_tokens": k,
    }
    outs, metrics = _run(llama_bigram_dir, prompts, speculative_config=spec)
    assert _ids(outs) == _ids(_run(llama_bigram_dir, prompts)[0])
    drafts, draft_tokens, accepted, per_pos = _check_metrics(metrics, k)
    assert accepted == draft_tokens == k * drafts
    assert per_pos == [drafts] * k


def test_near_self_draft_accepts_more_than_random(prompts, near_self_dir, deepseek_v3_mtp1_dir):
    spec = {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": 2}
    _, m_near = _run(near_self_dir, prompts, speculative_config=spec)
    _, m_rand = _run(deepseek_v3_mtp1_dir, prompts, speculative_config=spec)
    d1, _, a1, _ = _spec_counts(m_near)
    d2, _, a2, _ = _spec_counts(m_rand)
    assert a1 / d1 > 0.5 > a2 / d2


# ---- sampling --------------------------------------------------------------------------------


def test_seeded_sampling_reproducible_under_spec_decode(prompts, near_self_dir):
    spec = {
        "method": "mtp",
        "adaptive_num_speculative_tokens": False,
        "num_speculative_tokens": 2,
        "draft_sample_method": "probabilistic",
    }
    sps = [
        SamplingParams(
            temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    llm = LLM(model=near_self_dir, **COMMON, speculative_config=spec)
    try:
        batched = _ids(
            llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        )
        alone = [
            _ids(llm.generate([{"prompt_token_ids": prompts[i]}], sps[i], use_tqdm=False))[0]
            for i in (0, 3)
        ]
        _, _, accepted, _ = _spec_counts({m.name: m for m in llm.get_metrics()})
    finally:
        llm.shutdown()
    assert [batched[0], batched[3]] == alone
    assert accepted > 0
    assert len({tuple(t) for t in batched}) == len(prompts)
