# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""LoRA with speculative decoding, pipeline and tensor parallelism: a batch mixing two
adapters and the base model gives, with MTP (DeepSeek-V3) and EAGLE3 (Llama) drafting at
P = 1, P = 2 and TP = 2, exactly the greedy tokens of P = 1 without speculation (the adapter
applies to the target only; the drafts still get accepted)."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.testing import checkpoints
from vllm.testing.engine_utils import make_prompts, spec_decode_counts
from vllm.testing.lora_adapters import make_peft_adapter
from vllm.testing.spec_checkpoints import (
    make_eagle3_bigram_head,
    make_llama_bigram_target,
    make_mtp_self_draft,
)

pytestmark = pytest.mark.usefixtures("pp_forkserver")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4, disable_log_stats=False)
PROMPTS = make_prompts(512, [21, 6, 34], seed=11)
DS_TARGETS = (
    r".*self_attn\.(q_proj|kv_a_proj_with_mqa|o_proj)|.*layers\.0\.mlp\.(gate|up|down)_proj"
)


@pytest.fixture(scope="module")
def models(llama_dir, tmp_path_factory) -> dict:
    """model -> (target, speculative_config, two adapters)."""
    mk = tmp_path_factory.mktemp
    ds = checkpoints.make_deepseek_v3(
        mk("lora_dsv3"), num_hidden_layers=4, num_nextn_predict_layers=1
    )
    ds = make_mtp_self_draft(mk("lora_dsv3_near"), ds, target_scale=0.2)
    llama = make_llama_bigram_target(mk("lora_llama_bigram"), llama_dir, target_scale=0.3)
    e3 = make_eagle3_bigram_head(mk("lora_e3"), llama, aux_layers=(1, 2, 3))

    def adapters(base: str, key: str, targets=None) -> list[str]:
        return [
            make_peft_adapter(base, mk(f"{key}_{i}"), r=8, target_modules=targets, seed=i + 7)
            for i in range(2)
        ]

    return {
        "mtp": (
            ds,
            {
                "method": "mtp",
                "num_speculative_tokens": 2,
                "adaptive_num_speculative_tokens": False,
            },
            adapters(ds, "ds", DS_TARGETS),
        ),
        "eagle3": (
            llama,
            {
                "method": "eagle3",
                "model": e3,
                "num_speculative_tokens": 3,
                "adaptive_num_speculative_tokens": False,
            },
            adapters(llama, "ll"),
        ),
    }


def _run(target: str, loras: list, spec: dict | None = None, **kw):
    llm = LLM(
        model=target,
        enable_lora=True,
        max_loras=2,
        speculative_config=spec,
        **{**COMMON, **kw},
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=loras, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs], spec_decode_counts(llm)
    finally:
        llm.shutdown()


_REF: dict = {}


@pytest.mark.parametrize(
    "model,layout",
    [
        ("mtp", {}),
        ("mtp", {"pipeline_parallel_size": 2}),
        ("mtp", {"tensor_parallel_size": 2}),
        ("eagle3", {}),
        ("eagle3", {"pipeline_parallel_size": 2}),
        ("eagle3", {"tensor_parallel_size": 2}),
    ],
    ids=["mtp-p1", "mtp-pp2", "mtp-tp2", "eagle3-p1", "eagle3-pp2", "eagle3-tp2"],
)
def test_spec_decode_with_adapters_is_lossless(models, model, layout):
    target, spec, adapter_dirs = models[model]
    a1, a2 = (LoRARequest(f"{model}-{i}", i + 1, p) for i, p in enumerate(adapter_dirs))
    loras = [a1, None, a2]
    if model not in _REF:
        ref, _ = _run(target, loras)
        base, _ = _run(target, [None] * 3)
        assert ref[0] != base[0] and ref[2] != base[2], "the adapters change nothing"
        assert ref[1] == base[1]
        _REF[model] = ref
    if model == "eagle3" and layout.get("tensor_parallel_size"):
        spec = {**spec, "draft_tensor_parallel_size": 1}  # the head has one attention head
    got, counts = _run(target, loras, spec, **layout)
    assert got == _REF[model]
    assert counts[2] > 0, "no draft was accepted: speculation did not run"
