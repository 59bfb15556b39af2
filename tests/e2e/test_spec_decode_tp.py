# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Speculative decoding under tensor parallelism (and TP x PP), on real worker processes: the
drafts run tensor-parallel with their target (the DeepSeek MTP layers: MLA heads and experts
split) or whole on every rank (draft_tensor_parallel_size=1: the one-head EAGLE3 / EAGLE-1 /
DFlash / DSpark test heads, sharing the target's vocab-parallel embedding and LM head), TP
rank 0 decides the sampled, accepted and drafted tokens and every rank follows it, and the
greedy tokens and the spec-decode counters (drafts, draft tokens, accepted, per position)
equal one worker's. A draft the target's TP cannot split is refused naming the field."""

from __future__ import annotations

import pytest

from tests.e2e.test_dflash_pp import targets  # noqa: F401 - fixture
from tests.e2e.test_spec_decode_pp import (  # noqa: F401 - fixtures
    deepseek_v3_mtp2_4l_dir,
    eagle3_llama_dir,
    eagle_self_dir,
    llama_near_bigram_dir,
)
from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts, record_draft_confidences, spec_decode_counts

LENGTHS = [21, 6, 34]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4, disable_log_stats=False)

pytestmark = pytest.mark.usefixtures("pp_forkserver")


@pytest.fixture(scope="module")
def v32_mtp_share_dir(tmp_path_factory) -> str:
    """V3.2 with two MTP layers and top-k sharing across draft steps: the draft's indexers
    (replicated) write the target's top-k buffer on each rank."""
    from vllm.testing.dsa_checkpoints import make_deepseek_v32

    return make_deepseek_v32(
        tmp_path_factory.mktemp("v32_tp"),
        num_nextn_predict_layers=2,
        index_share_for_mtp_iteration=True,
    )


@pytest.fixture(scope="module")
def qwen3_5_near_mtp_dir(tmp_path_factory) -> str:
    """Qwen3.5 hybrid whose MTP head nearly reproduces the target (partial acceptance)."""
    from vllm.testing import qwen3_5_checkpoints as q35

    src = q35.make_qwen3_5(tmp_path_factory.mktemp("q35_tp"), mtp_num_hidden_layers=1)
    return q35.make_qwen3_5_mtp_self_draft(
        tmp_path_factory.mktemp("q35_tp_near"), src, target_scale=0.3
    )


# model key -> (target fixture, draft fixture or None, method, K)
MODELS = {
    "mtp_v3": ("deepseek_v3_mtp2_4l_dir", None, "mtp", 2),
    "mtp_v32": ("v32_mtp_share_dir", None, "mtp", 2),
    "mtp_qwen3_5": ("qwen3_5_near_mtp_dir", None, "mtp", 2),
    "eagle3_llama": ("llama_near_bigram_dir", "eagle3_llama_dir", "eagle3", 3),
    "eagle_llama": ("llama_near_bigram_dir", "eagle_self_dir", "eagle", 2),
    "dflash_llama": ("targets", "dflash", "dflash", 3),
    "dspark_llama": ("targets", "dspark", "dspark", 3),
}

# (model, TP, PP): the 4-worker TP2 x PP2 cases are the ones that split both ways.
CASES = [
    ("mtp_v3", 2, 2),
    ("mtp_v3", 2, 1),
    ("mtp_v32", 2, 2),
    ("mtp_qwen3_5", 2, 1),
    ("eagle3_llama", 2, 2),
    ("eagle3_llama", 2, 1),
    ("eagle_llama", 2, 1),
    ("dflash_llama", 2, 1),
    ("dspark_llama", 2, 1),
]


class _Runs:
    def __init__(self, request, tmp_path_factory) -> None:
        self.request = request
        self.tmp = tmp_path_factory
        self.prompts = make_prompts(512, LENGTHS, seed=11)
        self.cache: dict = {}
        self.heads: dict = {}

    def dirs(self, model: str) -> tuple[str, str | None]:
        target, draft, method, k = MODELS[model]
        fix = self.request.getfixturevalue
        if target == "targets":  # DFlash / DSpark: a head built for the near-bigram Llama
            from vllm.testing.speculators_dflash_heads import make_bigram_head

            llama = fix("targets")["llama"]
            if model not in self.heads:
                out = self.tmp.mktemp(f"{model}_head")
                self.heads[model] = make_bigram_head(out, llama, method == "dspark", k)
            return llama, self.heads[model]
        return fix(target), (fix(draft) if draft else None)

    def get(self, model: str, tp: int, pp: int, spec: bool = True):
        key = (model, tp, pp, spec)
        if key not in self.cache:
            target, draft = self.dirs(model)
            _, _, method, k = MODELS[model]
            cfg: dict | None = None
            if spec:
                cfg = {
                    "method": method,
                    "num_speculative_tokens": k,
                    "adaptive_num_speculative_tokens": False,
                }
                if draft:
                    cfg["model"] = draft
                if tp > 1 and method != "mtp":
                    cfg["draft_tensor_parallel_size"] = 1
            llm = LLM(
                model=target,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                speculative_config=cfg,
                **COMMON,
            )
            try:
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in self.prompts], GREEDY, use_tqdm=False
                )
                self.cache[key] = (
                    [list(o.outputs[0].token_ids) for o in outs],
                    spec_decode_counts(llm),
                )
            finally:
                llm.shutdown()
        return self.cache[key]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> _Runs:
    return _Runs(request, tmp_path_factory)


@pytest.mark.parametrize("model,tp,pp", CASES, ids=[f"{m}-tp{t}-pp{p}" for m, t, p in CASES])
def test_spec_decode_tp_equals_one_worker(runs, model, tp, pp):
    ref_tokens, _ = runs.get(model, 1, 1, spec=False)
    _, ref_counts = runs.get(model, 1, 1)
    tokens, counts = runs.get(model, tp, pp)
    assert tokens == ref_tokens
    assert counts[0] > 0, "the drafter never fired"
    if model != "mtp_v32":  # its MTP layers are random
        assert counts[2] > 0, "the constructed draft accepts some tokens"
    assert counts == ref_counts
    print(f"{model} TP={tp} PP={pp}: drafts, draft tokens, accepted, per position = {counts}")


def test_unsplittable_drafts_are_refused(
    deepseek_v3_mtp2_4l_dir,  # noqa: F811
    llama_near_bigram_dir,  # noqa: F811
    eagle3_llama_dir,  # noqa: F811
):
    """In the engine, before any worker starts."""
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=3.*tensor_parallel_size=2"):
        LLM(
            model=deepseek_v3_mtp2_4l_dir,
            tensor_parallel_size=2,
            speculative_config={
                "method": "mtp",
                "num_speculative_tokens": 1,
                "adaptive_num_speculative_tokens": False,
                "draft_tensor_parallel_size": 3,
            },
            **COMMON,
        )
    with pytest.raises(ValueError, match="num_attention_heads.*draft_tensor_parallel_size=1"):
        LLM(
            model=llama_near_bigram_dir,
            tensor_parallel_size=2,
            speculative_config={
                "method": "eagle3",
                "num_speculative_tokens": 2,
                "adaptive_num_speculative_tokens": False,
                "model": eagle3_llama_dir,
            },
            **COMMON,
        )


def test_draft_confidence_stops_alike_on_every_rank(
    runs,
    llama_near_bigram_dir,  # noqa: F811
    eagle3_llama_dir,  # noqa: F811
):
    """adaptive_draft_confidence at TP = 2 (an adaptive EAGLE3 chain, the head whole on both
    ranks), its floor forced high so the workers stop drafting requests whose next draft is not
    confident enough: rank 0's decision (agree) on both ranks - no rank runs a pass the other
    skips (a hang) or keeps drafts the other cut (different verified tokens) - so the tokens
    equal one worker's without speculation, and every reported chain went on only past
    confident drafts."""
    from vllm.v1.worker.gpu.spec_decode.autoregressive.confidence import CONTINUE_RATE

    floor = 0.5
    ref_tokens, _ = runs.get("eagle3_llama", 1, 1, spec=False)
    cfg = {
        "method": "eagle3",
        "model": eagle3_llama_dir,
        "num_speculative_tokens": 3,
        "draft_tensor_parallel_size": 1,
    }
    llm = LLM(model=llama_near_bigram_dir, tensor_parallel_size=2, speculative_config=cfg, **COMMON)
    try:
        reports = record_draft_confidences(llm, floor)
        outs = llm.generate([{"prompt_token_ids": p} for p in runs.prompts], GREEDY, use_tqdm=False)
        counts = spec_decode_counts(llm)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == ref_tokens
    assert counts[0] > 0 and reports
    for chain in reports:
        assert all(c * CONTINUE_RATE >= floor for c in chain[:-1]), chain
    assert any(len(c) < 3 for c in reports), "no request was stopped: the floor did nothing"
