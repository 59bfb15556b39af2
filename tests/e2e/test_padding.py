# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Padding the flattened batch to fixed sizes (compilation_config.cudagraph_capture_sizes): the
forward runs on num_tokens_after_padding > num_tokens rows in most steps, and greedy output is
identical to the unpadded run, with and without MTP, at P = 1 and P = 2, on DeepSeek-V3 (MLA,
MoE), DeepSeek-V3.2 (sparse MLA, indexer) and the Qwen3.5 hybrid (linear-attention states);
the speculator's hooks see the real number of requests."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.config import CompilationConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.testing import qwen3_5_checkpoints as q35
from vllm.testing.checkpoints import make_deepseek_v3
from vllm.testing.dsa_checkpoints import make_deepseek_v32
from vllm.testing.engine_utils import make_prompts
from vllm.testing.spec_checkpoints import make_mtp_self_draft

pytestmark = pytest.mark.usefixtures("pp_forkserver")

GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
# A 32-token budget: prompts arrive in chunks and decode/verify steps mix with them.
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
PADDED = {"cudagraph_capture_sizes": [3, 7, 13, 24, 32]}
MTP = {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Targets with one MTP layer that partly agrees with them (drafts accepted and rejected)."""
    mk = tmp_path_factory.mktemp
    dsv3 = make_deepseek_v3(mk("pad_dsv3"), num_nextn_predict_layers=1)
    qwen = q35.make_qwen3_5(mk("pad_q35"), mtp_num_hidden_layers=1)
    return {
        "deepseek_v3": make_mtp_self_draft(mk("pad_dsv3_near"), dsv3, target_scale=0.2),
        "qwen3_5": q35.make_qwen3_5_mtp_self_draft(mk("pad_q35_near"), qwen, target_scale=0.3),
        "deepseek_v32": make_deepseek_v32(
            mk("pad_v32"), num_nextn_predict_layers=1, index_share_for_mtp_iteration=True
        ),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(512, [10, 21, 5, 33, 2], seed=31)


_REFERENCE: dict[str, list[list[int]]] = {}


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _reference(model: str, prompts) -> list[list[int]]:
    if model not in _REFERENCE:
        llm = LLM(model=model, **COMMON)
        try:
            _REFERENCE[model] = _generate(llm, prompts)
        finally:
            llm.shutdown()
    return _REFERENCE[model]


def _accepted(llm: LLM) -> int:
    m = {x.name: x for x in llm.get_metrics()}
    return int(m["vllm:spec_decode_num_accepted_tokens"].value)


@pytest.mark.parametrize("spec", [None, MTP], ids=["nospec", "mtp"])
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5", "deepseek_v32"])
def test_padded_equals_unpadded(models, prompts, family, spec) -> None:
    model = models[family]
    ref = _reference(model, prompts)
    llm = LLM(
        model=model,
        speculative_config=spec,
        compilation_config=PADDED,
        disable_log_stats=False,
        **COMMON,
    )
    runner = llm.llm_engine.executor.worker.model_runner
    steps: list[tuple[int, int, int]] = []  # (real tokens, rows run, requests)
    prepare = runner.prepare

    def recording_prepare(so):
        batch = prepare(so)
        steps.append((batch.num_tokens, batch.num_tokens_after_padding, batch.num_reqs))
        return batch

    runner.prepare = recording_prepare
    hooks: list[int] = []
    if spec is not None:
        begin = runner.speculator.on_prefill_begin
        runner.speculator.on_prefill_begin = lambda n: (hooks.append(n), begin(n))[1]
    try:
        out = _generate(llm, prompts)
        accepted = _accepted(llm) if spec is not None else None
    finally:
        llm.shutdown()
    assert out == ref
    padded = [s for s in steps if s[1] > s[0]]
    assert len(padded) >= len(steps) // 2, steps
    assert all(s[1] in PADDED["cudagraph_capture_sizes"] for s in padded)
    if spec is not None:
        assert accepted > 0
        # One propose per step that sampled, with the real number of requests.
        assert hooks and set(hooks) <= {s[2] for s in steps}


@pytest.mark.parametrize(
    "family, spec", [("deepseek_v3", MTP), ("qwen3_5", MTP), ("deepseek_v3", None)]
)
def test_padded_pp2_equals_unpadded_p1(models, prompts, family, spec) -> None:
    """Both stages pad identically (the same scheduler output, the same sizes), so the
    hidden states sent between them have the padded shape each side expects."""
    model = models[family]
    ref = _reference(model, prompts)
    llm = LLM(
        model=model,
        speculative_config=spec,
        compilation_config=PADDED,
        pipeline_parallel_size=2,
        **COMMON,
    )
    try:
        assert _generate(llm, prompts) == ref
    finally:
        llm.shutdown()


def test_compilation_config_sizes() -> None:
    cc = CompilationConfig(cudagraph_capture_sizes=[8, 2, 4, 4])
    assert cc.cudagraph_capture_sizes == [2, 4, 8]
    assert [cc.padded_num_tokens(n) for n in (1, 2, 3, 5, 8, 9)] == [2, 2, 4, 8, 8, 9]
    assert CompilationConfig().padded_num_tokens(5) == 5
    for bad in ([0, 4], [2.5], "8", [True]):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            CompilationConfig(cudagraph_capture_sizes=bad)
    with pytest.raises(ValueError, match=r"unsupported key\(s\) \['level'\]"):
        CompilationConfig.from_dict({"level": 3})


def test_engine_config_drops_oversized_buckets_and_enforce_eager_disables(llama_dir) -> None:
    def config(**kw):
        return EngineArgs(
            model=llama_dir, max_model_len=128, max_num_batched_tokens=64, **kw
        ).create_engine_config()

    cfg = config(compilation_config='{"cudagraph_capture_sizes": [16, 64, 128]}')
    assert cfg.compilation_config.cudagraph_capture_sizes == [16, 64]
    assert cfg.padded_num_tokens(10) == 16
    eager = config(compilation_config={"cudagraph_capture_sizes": [16]}, enforce_eager=True)
    assert eager.padded_num_tokens(10) == 10
