# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""LoRA adapters offline: greedy parity with HF transformers + PEFT for every family, a batch
mixing adapters and the base model equal to each request alone, LRU slot eviction with more
adapters in flight than slots, prefix caching keeping adapters apart, and bad adapters refused
with errors naming the problem (the engine keeps serving)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.testing import checkpoints
from vllm.testing import qwen3_5_checkpoints as q35
from vllm.testing.engine_utils import hf_greedy, make_prompts
from vllm.testing.lora_adapters import make_peft_adapter, peft_greedy

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=256, max_num_seqs=8)
PROMPTS = make_prompts(512, [9, 23, 5, 14], seed=11)


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


# family -> (base checkpoint builder, PEFT target_modules)
DS_TARGETS = (
    r".*self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)"
    r"|.*layers\.0\.mlp\.(gate_proj|up_proj|down_proj)"
)
FAMILIES = {
    "qwen2": (lambda d: checkpoints.make_qwen2(d), None),
    "qwen3_5": (lambda d: q35.make_qwen3_5(d), None),
    "deepseek_v3": (lambda d: checkpoints.make_deepseek_v3(d), DS_TARGETS),
    "deepseek_v3_qlora": (lambda d: checkpoints.make_deepseek_v3(d, q_lora_rank=24), DS_TARGETS),
}


@pytest.mark.parametrize("family", ["llama", *FAMILIES])
def test_greedy_matches_peft(family, llama_dir, llama_adapters, tmp_path_factory):
    if family == "llama":
        base, adapter = llama_dir, llama_adapters[0]
    else:
        make, targets = FAMILIES[family]
        base = make(tmp_path_factory.mktemp(family))
        adapter = make_peft_adapter(
            base, tmp_path_factory.mktemp(f"{family}_lora"), r=8, target_modules=targets, seed=5
        )
    prompts = PROMPTS[:2]
    ref = [peft_greedy(base, adapter, p, MAX_TOKENS) for p in prompts]
    assert ref != [hf_greedy(base, p, MAX_TOKENS) for p in prompts], "adapter changes nothing"
    llm = LLM(model=base, enable_lora=True, **COMMON)
    try:
        lr = LoRARequest(f"{family}-lora", 1, adapter)
        assert _ids(llm.generate(_inputs(prompts), GREEDY, lora_request=lr)) == ref
    finally:
        llm.shutdown()


def test_mixed_batch_equals_each_alone(llama_dir, llama_adapters):
    """4 requests over 3 adapters + the base model in one batch (chat and beam search take
    the adapter too)."""
    loras = [LoRARequest(f"a{i + 1}", i + 1, p) for i, p in enumerate(llama_adapters)]
    per_row = [loras[0], loras[1], None, loras[2]]
    ref = [
        hf_greedy(llama_dir, p, MAX_TOKENS)
        if lr is None
        else peft_greedy(llama_dir, lr.lora_path, p, MAX_TOKENS)
        for p, lr in zip(PROMPTS, per_row)
    ]
    assert len({tuple(r) for r in ref}) == 4
    llm = LLM(model=llama_dir, enable_lora=True, max_loras=3, **COMMON)
    try:
        assert _ids(llm.generate(_inputs(PROMPTS), GREEDY, lora_request=per_row)) == ref
        # one adapter for all prompts
        one = _ids(llm.generate(_inputs(PROMPTS[:2]), GREEDY, lora_request=loras[1]))
        assert one == [
            peft_greedy(llama_dir, loras[1].lora_path, p, MAX_TOKENS) for p in PROMPTS[:2]
        ]
        beams = llm.beam_search(
            _inputs(PROMPTS[:1]),
            __import__("vllm").sampling_params.BeamSearchParams(beam_width=1, max_tokens=4),
            lora_request=loras[0],
        )
        assert beams[0].sequences[0].tokens[len(PROMPTS[0]) :] == ref[0][:4]
    finally:
        llm.shutdown()


def test_lru_eviction_one_slot(llama_dir, llama_adapters):
    """max_loras=1 with 3 adapters (and the base) in flight: the scheduler runs one adapter
    at a time, the worker swaps the slot; every output equals its reference."""
    loras = [LoRARequest(f"a{i + 1}", i + 1, p) for i, p in enumerate(llama_adapters)]
    per_row = [loras[0], loras[1], loras[2], None, loras[0], loras[2]]
    prompts = PROMPTS + PROMPTS[:2]
    ref = [
        hf_greedy(llama_dir, p, MAX_TOKENS)
        if lr is None
        else peft_greedy(llama_dir, lr.lora_path, p, MAX_TOKENS)
        for p, lr in zip(prompts, per_row)
    ]
    llm = LLM(model=llama_dir, enable_lora=True, max_loras=1, max_cpu_loras=2, **COMMON)
    try:
        assert _ids(llm.generate(_inputs(prompts), GREEDY, lora_request=per_row)) == ref
    finally:
        llm.shutdown()


def test_prefix_cache_keeps_adapters_apart(llama_dir, llama_adapters):
    prompt = make_prompts(512, [50], seed=4)[0]
    a1, a2 = (LoRARequest(f"a{i + 1}", i + 1, p) for i, p in enumerate(llama_adapters[:2]))
    ref = {
        "a1": peft_greedy(llama_dir, a1.lora_path, prompt, MAX_TOKENS),
        "a2": peft_greedy(llama_dir, a2.lora_path, prompt, MAX_TOKENS),
        "base": hf_greedy(llama_dir, prompt, MAX_TOKENS),
    }
    llm = LLM(model=llama_dir, enable_lora=True, max_loras=2, enable_prefix_caching=True, **COMMON)
    try:
        for key, lr in (("a1", a1), ("a2", a2), ("base", None), ("a1", a1)):
            out = llm.generate(_inputs([prompt]), GREEDY, lora_request=lr)
            assert _ids(out) == [ref[key]], key
    finally:
        llm.shutdown()


def _write_adapter(folder: Path, src: str, **config_changes) -> str:
    folder.mkdir()
    cfg = json.loads((Path(src) / "adapter_config.json").read_text()) | config_changes
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    (folder / "adapter_model.safetensors").write_bytes(
        (Path(src) / "adapter_model.safetensors").read_bytes()
    )
    return str(folder)


def test_bad_adapters_are_refused(llama_dir, llama_adapters, tmp_path):
    small = checkpoints.make_llama(tmp_path / "small", hidden_size=32, intermediate_size=64)
    other = make_peft_adapter(small, tmp_path / "other", r=4)
    big = make_peft_adapter(llama_dir, tmp_path / "big", r=32)
    saved = _write_adapter(tmp_path / "saved", llama_adapters[0], modules_to_save=["lm_head"])
    llm = LLM(model=llama_dir, enable_lora=True, max_lora_rank=16, **COMMON)
    try:
        cases = [
            (LoRARequest("big", 2, big), "rank 32, above max_lora_rank=16"),
            (LoRARequest("notpeft", 3, llama_dir), "is not a PEFT LoRA adapter"),
            (LoRARequest("missing", 4, str(tmp_path / "nope")), "is not a folder"),
            (LoRARequest("other", 5, other), "features but the model's"),
            (LoRARequest("saved", 6, saved), "modules_to_save"),
            (LoRARequest("reuse", 1, big), "lora_int_id 1 is already used"),
        ]
        good = LoRARequest("a1", 1, llama_adapters[0])
        assert llm.generate(_inputs(PROMPTS[:1]), GREEDY, lora_request=good)
        for lr, msg in cases:
            with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
                llm.generate(_inputs(PROMPTS[:1]), GREEDY, lora_request=lr)
        # still serving, adapter and base
        out = llm.generate(_inputs(PROMPTS[:2]), GREEDY, lora_request=[good, None])
        assert _ids(out)[1] == hf_greedy(llama_dir, PROMPTS[1], MAX_TOKENS)
    finally:
        llm.shutdown()
    plain = LLM(model=llama_dir, **COMMON)
    try:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            plain.generate(_inputs(PROMPTS[:1]), GREEDY, lora_request=good)
    finally:
        plain.shutdown()


def test_experts_refused(tmp_path):
    """DeepSeek-V3's routed experts (layers 1-2 of the tiny checkpoint) are refused."""
    from transformers import AutoConfig

    from vllm.lora.peft import expected_dims

    base = checkpoints.make_deepseek_v3(tmp_path / "ds")
    cfg = AutoConfig.from_pretrained(base)
    with pytest.raises(ValueError, match="mixture of experts"):
        expected_dims(cfg, "model.layers.1.mlp.gate_proj", "x")
    with pytest.raises(ValueError, match="routed MoE expert"):
        from vllm.lora.peft import _parse_keys

        _parse_keys("x", {"model.layers.1.mlp.experts.0.up_proj.lora_A.weight": 0})
