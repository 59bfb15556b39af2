# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Speculative decoding under pipeline parallelism, end to end on CPU (gloo): with P = 2 and
P = 4 stages, MTP (DeepSeek-V3, 1 and 2 MTP layers) and EAGLE3 (Llama, Qwen2) give the same
greedy tokens as P = 1 without speculation and exactly the same speculation metrics (drafts,
draft tokens, accepted, per position) as P = 1 with speculation; EAGLE3 taps on stage
boundaries, all on the first / last stage, and relayed through two middle stages; the DeepSeek
MTP self-draft keeps 100% acceptance at P = 2 (its own embedding is loaded on the last stage);
one case on Ray; `vllm serve -pp 2 --speculative-config ...` answers like P = 1.

The EAGLE3 heads of the P = 1 / 2 / 4 comparison accept: they are constructed
(make_eagle3_bigram_head) to draft what a near-bigram target predicts after their input token,
so their metrics are known without running them (the simulation over the target's greedy
output) and the acceptance is partial; the Qwen2 one over a reduced draft vocabulary.

The default run covers P = 2 fully and a representative P = 4 subset; the rest of the P = 4
matrix is marked slow."""

from __future__ import annotations

import json

import pytest

from vllm import LLM, SamplingParams
from vllm.testing import checkpoints
from vllm.testing.engine_utils import chain, make_prompts, simulate_spec_decode, spec_decode_counts
from vllm.testing.spec_checkpoints import (
    eagle3_head_drafts,
    make_eagle3_bigram_head,
    make_eagle3_draft,
    make_eagle_draft,
    make_llama_bigram_target,
    make_mtp_self_draft,
)

LENGTHS = [21, 6, 34]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4, disable_log_stats=False)


pytestmark = pytest.mark.usefixtures("pp_forkserver")


def _near_mtp(tmp_path_factory, n_mtp: int) -> str:
    """4 target layers (one per stage at P = 4) + n_mtp MTP layers whose heads nearly
    reproduce the (mostly bigram) target: partial acceptance, so the per-position counts
    compared below are not all zero."""
    src = checkpoints.make_deepseek_v3(
        tmp_path_factory.mktemp(f"dsv3_4l_mtp{n_mtp}"),
        num_hidden_layers=4,
        num_nextn_predict_layers=n_mtp,
    )
    return make_mtp_self_draft(
        tmp_path_factory.mktemp(f"dsv3_4l_mtp{n_mtp}_near"), src, target_scale=0.2
    )


@pytest.fixture(scope="module")
def deepseek_v3_mtp1_4l_dir(tmp_path_factory) -> str:
    return _near_mtp(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def deepseek_v3_mtp2_4l_dir(tmp_path_factory) -> str:
    return _near_mtp(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def llama_near_bigram_dir(llama_dir, tmp_path_factory) -> str:
    return make_llama_bigram_target(
        tmp_path_factory.mktemp("llama_near_bigram"), llama_dir, target_scale=0.3
    )


@pytest.fixture(scope="module")
def qwen2_near_bigram_dir(qwen2_dir, tmp_path_factory) -> str:
    return make_llama_bigram_target(
        tmp_path_factory.mktemp("qwen2_near_bigram"), qwen2_dir, target_scale=0.3
    )


@pytest.fixture(scope="module")
def eagle3_llama_dir(llama_near_bigram_dir, tmp_path_factory) -> str:
    # 4 layers: P = 2 splits [0,2) [2,4) (tap 2 on the boundary); P = 4 one layer per stage
    # (taps 1, 2, 3 all on boundaries, 1 relayed through both middle stages).
    return make_eagle3_bigram_head(
        tmp_path_factory.mktemp("e3_llama"), llama_near_bigram_dir, aux_layers=(1, 2, 3)
    )


@pytest.fixture(scope="module")
def eagle3_qwen2_dir(qwen2_near_bigram_dir, tmp_path_factory) -> str:
    return make_eagle3_bigram_head(
        tmp_path_factory.mktemp("e3_qwen2"),
        qwen2_near_bigram_dir,
        aux_layers=(0, 2, 4),
        draft_vocab_size=300,
        seed=2,
    )


@pytest.fixture(scope="module")
def eagle_self_dir(llama_dir, tmp_path_factory) -> str:
    """EAGLE-1 head predicting the bigram part of the target: partial acceptance on the
    near-bigram target (so the per-position counts compared below are not all zero)."""
    return make_eagle_draft(tmp_path_factory.mktemp("eagle_self"), llama_dir, self_draft=True)


# model key -> (target fixture, draft fixture or None, method)
MODELS = {
    "mtp1": ("deepseek_v3_mtp1_4l_dir", None, "mtp"),
    "mtp2": ("deepseek_v3_mtp2_4l_dir", None, "mtp"),
    "eagle3_llama": ("llama_near_bigram_dir", "eagle3_llama_dir", "eagle3"),
    "eagle3_qwen2": ("qwen2_near_bigram_dir", "eagle3_qwen2_dir", "eagle3"),
    "eagle_llama": ("llama_near_bigram_dir", "eagle_self_dir", "eagle"),
}
P4_DEFAULT = {("eagle3_llama", 3), ("mtp1", 1)}


def _cases():
    out = []
    for pp in (2, 4):
        for model in MODELS:
            if model == "eagle_llama" and pp == 4:
                continue  # the EAGLE-1 draft relays nothing across stages: P = 2 says it all
            for k in (1, 3):
                marks = () if pp == 2 or (model, k) in P4_DEFAULT else (pytest.mark.slow,)
                out.append(pytest.param(model, pp, k, marks=marks, id=f"{model}-pp{pp}-k{k}"))
    return out


_TEXTS: dict = {}  # (model, P, spec) -> generated texts (for the server test)


def _run(model_dir: str, prompts, spec: dict | None = None, pp: int = 1, params=GREEDY, **kw):
    llm = LLM(
        model=model_dir, pipeline_parallel_size=pp, speculative_config=spec, **{**COMMON, **kw}
    )
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        _TEXTS[(model_dir, pp, json.dumps(spec))] = [o.outputs[0].text for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs], spec_decode_counts(llm)
    finally:
        llm.shutdown()


class _Runs:
    """Results per (model, P, K) (K = 0: no speculation), each computed once."""

    def __init__(self, request) -> None:
        self.request = request
        self.cache: dict = {}
        self.prompts = make_prompts(512, LENGTHS, seed=11)

    def dirs(self, model: str) -> tuple[str, str | None, str]:
        target, draft, method = MODELS[model]
        fix = self.request.getfixturevalue
        return fix(target), (fix(draft) if draft else None), method

    def spec(self, model: str, k: int) -> dict | None:
        if k == 0:
            return None
        _, draft, method = self.dirs(model)
        spec = {
            "method": method,
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        }
        if draft:
            spec["model"] = draft
        return spec

    def get(self, model: str, pp: int, k: int, **kw):
        key = (model, pp, k, tuple(sorted(kw.items())))
        if key not in self.cache:
            target = self.dirs(model)[0]
            self.cache[key] = _run(target, self.prompts, self.spec(model, k), pp, **kw)
        return self.cache[key]


@pytest.fixture(scope="module")
def runs(request) -> _Runs:
    return _Runs(request)


@pytest.mark.parametrize("model,pp,k", _cases())
def test_spec_decode_pp_equals_p1(runs, model, pp, k):
    ref_tokens, _ = runs.get(model, 1, 0)
    _, ref_counts = runs.get(model, 1, k)
    tokens, counts = runs.get(model, pp, k)
    assert tokens == ref_tokens
    assert counts[0] > 0, "the drafter never fired"
    assert counts == ref_counts
    if model.startswith("eagle3"):
        assert counts[2] > 0, "the constructed EAGLE3 head accepts"
    print(f"{model} P={pp} K={k}: drafts, draft tokens, accepted, per position = {counts}")


@pytest.mark.parametrize("model", ["eagle3_llama", "eagle3_qwen2"])
def test_eagle3_heads_accept_what_the_simulation_predicts(runs, model):
    """P = 1 (and so, by the test above, P = 2 and 4): the metrics of the constructed heads are
    those of the simulation over the target's greedy output, with partial acceptance."""
    k = 3
    target, draft, _ = runs.dirs(model)
    long = SamplingParams(temperature=0, max_tokens=MAX_TOKENS + k + 1, ignore_eos=True)
    ref, _ = _run(target, runs.prompts, params=long)
    d = eagle3_head_drafts(draft)
    want = simulate_spec_decode(ref, chain(lambda t: int(d[t]), k), k, MAX_TOKENS)
    _, counts = runs.get(model, 1, k)
    assert counts == want
    assert 0 < want[2] < want[1] and want[3][0] > 0


def test_eagle3_taps_first_and_last_stage(llama_near_bigram_dir, tmp_path_factory, runs):
    """P = 2 over [0,2) / [2,4): taps all on the first stage (0, 1, 2 - 2 is the boundary, the
    stream the first stage sends) and all on the last (3, 4)."""
    ref_tokens, _ = runs.get("eagle3_llama", 1, 0)
    for name, taps in (("first", (0, 1, 2)), ("last", (3, 4))):
        draft = make_eagle3_draft(
            tmp_path_factory.mktemp(f"e3_{name}"), llama_near_bigram_dir, aux_layers=taps, seed=7
        )
        spec = {
            "method": "eagle3",
            "model": draft,
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": 2,
        }
        tokens1, counts1 = _run(llama_near_bigram_dir, runs.prompts, spec, 1)
        tokens2, counts2 = _run(llama_near_bigram_dir, runs.prompts, spec, 2)
        assert tokens1 == tokens2 == ref_tokens, name
        assert counts2 == counts1 and counts1[0] > 0, name


def test_mtp_self_draft_keeps_full_acceptance_at_pp2(deepseek_v3_mtp1_dir, tmp_path_factory):
    """The MTP head reproduces the target only with the right embedding table; on the last
    stage the target has none, so DeepSeekMTP must load its own."""
    draft = make_mtp_self_draft(tmp_path_factory.mktemp("mtp_self_pp"), deepseek_v3_mtp1_dir)
    prompts = make_prompts(512, LENGTHS, seed=12)
    spec = {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": 2}
    ref_tokens, _ = _run(draft, prompts)
    tokens, (drafts, draft_tokens, accepted, per_pos) = _run(draft, prompts, spec, 2)
    assert tokens == ref_tokens
    assert drafts > 0 and accepted == draft_tokens, (drafts, draft_tokens, accepted, per_pos)


@pytest.fixture(scope="module")
def top_level_embed_self_drafts(tmp_path_factory) -> dict[str, str]:
    """DeepSeek-V3 and V3.2 self-drafts whose MTP layer ships no embed_tokens: the draft's
    table is the checkpoint's top-level model.embed_tokens.weight."""
    from vllm.testing.dsa_checkpoints import make_deepseek_v32

    v3 = checkpoints.make_deepseek_v3(
        tmp_path_factory.mktemp("v3_top_embed"), num_nextn_predict_layers=1, mtp_own_embed=False
    )
    v32 = make_deepseek_v32(
        tmp_path_factory.mktemp("v32_top_embed"), num_nextn_predict_layers=1, mtp_own_embed=False
    )
    return {
        name: make_mtp_self_draft(tmp_path_factory.mktemp(f"{name}_top_embed_self"), src)
        for name, src in (("v3", v3), ("v32", v32))
    }


@pytest.mark.parametrize("family", ["v3", "v32"])
def test_top_level_only_mtp_embedding_at_pp2(top_level_embed_self_drafts, family):
    """On the last of two stages the target holds no embedding; the MTP layer must load the
    top-level table from the checkpoint. The self-draft then accepts every draft, at P = 1 and
    at P = 2 alike (a random or missing table would accept almost none)."""
    model = top_level_embed_self_drafts[family]
    prompts = make_prompts(512, LENGTHS, seed=13)
    spec = {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": 2}
    tokens1, counts1 = _run(model, prompts, spec, 1)
    tokens2, counts2 = _run(model, prompts, spec, 2)
    assert tokens2 == tokens1
    assert counts2 == counts1
    drafts, draft_tokens, accepted, _ = counts2
    assert drafts > 0 and accepted == draft_tokens, counts2


def test_ray_eagle3_pp2_equals_mp(runs):
    import ray

    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        tokens, counts = runs.get("eagle3_llama", 2, 3, distributed_executor_backend="ray")
    finally:
        if own_ray:
            ray.shutdown()
    assert tokens == runs.get("eagle3_llama", 1, 0)[0]
    assert counts == runs.get("eagle3_llama", 1, 3)[1]


def test_serve_pp2_mtp_equals_p1(runs, tmp_path):
    import openai

    from vllm.testing.remote_server import RemoteServer

    target = runs.dirs("mtp1")[0]
    ref_tokens, _ = runs.get("mtp1", 1, 0)
    spec = json.dumps(
        {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": 2}
    )
    with RemoteServer(
        target,
        ["-pp", "2", "--dtype", "float32", "--max-model-len", "128", "--speculative-config", spec],
        tmp_path / "serve.log",
    ) as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)
        texts = _TEXTS[(target, 1, json.dumps(None))]
        for prompt, want, want_text in zip(runs.prompts, ref_tokens, texts):
            res = client.completions.create(
                model=target,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True},
            )
            got = res.choices[0].logprobs.tokens
            assert len(got) == len(want), server.log_tail()
            assert res.choices[0].text == want_text
        assert server.stop(timeout=60) == 0, server.log_tail()
