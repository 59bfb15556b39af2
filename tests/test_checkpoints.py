# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Sanity checks for the test checkpoint builders in ``vllm/testing/checkpoints.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm.testing import checkpoints

DENSE_FIXTURES = ["llama_dir", "llama_tied_dir", "llama3_rope_dir", "qwen2_dir"]
DEEPSEEK_FIXTURES = [
    "deepseek_v3_dir",
    "deepseek_v3_qlora_dir",
    "deepseek_v3_mtp1_dir",
    "deepseek_v3_mtp2_dir",
]


def _prompts(n: int = 4, length: int = 24, vocab: int = 512) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (n, length), generator=gen)


def _load(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tensor_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def test_tokenizer_roundtrip_and_chat_template(tokenizer_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == 512
    assert tok.convert_tokens_to_ids(list(checkpoints.SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token_id == 0 and tok.bos_token is None
    for text in ["Hello world, the quick brown fox!", "  indented\n\tcode()  ", "naïve 日本語 ✓"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == 1 and ids.count(2) == 2


def test_tokenizer_is_deterministic(tmp_path) -> None:
    first = checkpoints._train_tokenizer_json(512)
    assert checkpoints._train_tokenizer_json(512) == first
    checkpoints.build_tokenizer(tmp_path / "a")
    checkpoints.build_tokenizer(tmp_path / "b")
    a = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert a == (tmp_path / "b" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("fixture", DENSE_FIXTURES + DEEPSEEK_FIXTURES)
def test_builder_loads_generates_and_is_peaky(fixture: str, request) -> None:
    path = request.getfixturevalue(fixture)
    model = _load(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    prompts = _prompts()
    gaps = checkpoints.logit_gaps(model, prompts)
    assert gaps.median() > 0.1, gaps
    assert (gaps < 1e-2).float().mean() < 0.1, gaps
    with torch.no_grad():
        out = model.generate(
            prompts[:2, :8],
            attention_mask=torch.ones(2, 8, dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    assert out.shape[1] > 8
    assert len(set(out[0, 8:].tolist())) > 1  # not stuck on one token


def test_dense_specifics(llama_dir, llama_tied_dir, llama3_rope_dir, qwen2_dir) -> None:
    untied = _load(llama_dir)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    tied = _load(llama_tied_dir)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in _tensor_shapes(llama_tied_dir)

    cfg = json.load(open(os.path.join(llama3_rope_dir, "config.json")))
    assert "rope_scaling" not in cfg and "rope_theta" not in cfg
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    assert cfg["rope_parameters"]["factor"] == 8.0
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0
    scaled = _load(llama3_rope_dir)
    assert scaled.config.rope_parameters["original_max_position_embeddings"] == 64
    assert not torch.allclose(scaled.model.rotary_emb.inv_freq, untied.model.rotary_emb.inv_freq)

    qwen = _load(qwen2_dir)
    attn = qwen.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and proj.bias.abs().min() > 0
    assert attn.o_proj.bias is None


def test_deepseek_v3_names(deepseek_v3_dir, deepseek_v3_qlora_dir) -> None:
    shapes = _tensor_shapes(deepseek_v3_dir)
    cfg = json.load(open(os.path.join(deepseek_v3_dir, "config.json")))
    assert cfg["num_nextn_predict_layers"] == 0
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 24, 64)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (32 + 8, 64)
    assert shapes["model.layers.0.self_attn.kv_a_layernorm.weight"] == (32,)
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (4 * (16 + 16), 32)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 4 * 16)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (128, 64)
    assert shapes["model.layers.1.mlp.gate.weight"] == (8, 64)
    assert shapes["model.layers.1.mlp.gate.e_score_correction_bias"] == (8,)
    assert shapes["model.layers.2.mlp.experts.7.gate_proj.weight"] == (32, 64)
    assert shapes["model.layers.2.mlp.experts.7.up_proj.weight"] == (32, 64)
    assert shapes["model.layers.2.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.2.mlp.shared_experts.down_proj.weight"] == (64, 32)
    assert not any("q_a_proj" in k for k in shapes)

    qshapes = _tensor_shapes(deepseek_v3_qlora_dir)
    assert qshapes["model.layers.1.self_attn.q_a_proj.weight"] == (24, 64)
    assert qshapes["model.layers.1.self_attn.q_a_layernorm.weight"] == (24,)
    assert qshapes["model.layers.1.self_attn.q_b_proj.weight"] == (4 * 24, 24)
    assert not any(".q_proj." in k for k in qshapes)

    model = _load(deepseek_v3_dir)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().min() > 0


@pytest.mark.parametrize("n_mtp", [1, 2])
def test_mtp_shards(n_mtp: int, request) -> None:
    path = request.getfixturevalue(f"deepseek_v3_mtp{n_mtp}_dir")
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["num_nextn_predict_layers"] == n_mtp
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    weight_map = index["weight_map"]
    assert set(weight_map.values()) == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    shapes = _tensor_shapes(path)
    assert set(shapes) == set(weight_map)
    hidden, vocab = 64, 512
    for i in range(n_mtp):
        p = f"model.layers.{3 + i}."
        expected = {
            "enorm.weight": (hidden,),
            "hnorm.weight": (hidden,),
            "eh_proj.weight": (hidden, 2 * hidden),
            "shared_head.norm.weight": (hidden,),
            "shared_head.head.weight": (vocab, hidden),
            "embed_tokens.weight": (vocab, hidden),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (4 * 24, hidden),
            "self_attn.kv_a_proj_with_mqa.weight": (40, hidden),
            "mlp.gate.weight": (8, hidden),
            "mlp.gate.e_score_correction_bias": (8,),
            "mlp.experts.0.gate_proj.weight": (32, hidden),
            "mlp.experts.7.down_proj.weight": (hidden, 32),
            "mlp.shared_experts.up_proj.weight": (32, hidden),
        }
        for name, shape in expected.items():
            assert shapes[p + name] == shape, name
            assert weight_map[p + name] == "model-00002-of-00002.safetensors"
    assert not any(k.startswith(f"model.layers.{3 + n_mtp}.") for k in shapes)
    with safe_open(os.path.join(path, "model-00002-of-00002.safetensors"), framework="pt") as f:
        head = f.get_tensor("model.layers.3.shared_head.head.weight")
    with safe_open(os.path.join(path, "model-00001-of-00002.safetensors"), framework="pt") as f:
        assert torch.equal(head, f.get_tensor("lm_head.weight"))

    # transformers' own MTP module accepts every MTP weight and can draft with it.
    model = _load(path)
    mtp = checkpoints.load_hf_mtp_model(model)
    assert len(mtp.layers) == n_mtp
    with safe_open(os.path.join(path, "model-00002-of-00002.safetensors"), framework="pt") as f:
        last = f"model.layers.{2 + n_mtp}."
        assert torch.equal(mtp.layers[-1].eh_proj.weight, f.get_tensor(last + "eh_proj.weight"))
        fused = mtp.layers[-1].mtp_block.mlp.experts.gate_up_proj
        assert torch.equal(fused[5, 32:], f.get_tensor(last + "mlp.experts.5.up_proj.weight"))
        assert torch.equal(fused[5, :32], f.get_tensor(last + "mlp.experts.5.gate_proj.weight"))


def test_fused_expert_names_load_identically(tmp_path) -> None:
    per_expert = checkpoints.make_deepseek_v3(tmp_path / "split", q_lora_rank=24)
    fused = checkpoints.make_deepseek_v3(tmp_path / "fused", q_lora_rank=24, per_expert_names=False)
    shapes = _tensor_shapes(fused)
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (8, 64, 64)
    assert shapes["model.layers.1.mlp.experts.down_proj"] == (8, 64, 32)
    a, b = _load(per_expert), _load(fused)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    prompts = _prompts(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(
            a(input_ids=prompts).logits, b(input_ids=prompts).logits, rtol=0, atol=1e-5
        )


def test_deepseek_v2_builder(tmp_path) -> None:
    path = checkpoints.make_deepseek_v2(tmp_path / "v2")
    model = _load(path)
    gaps = checkpoints.logit_gaps(model, _prompts())
    assert gaps.median() > 0.1
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in _tensor_shapes(path)


def test_builders_are_deterministic(tmp_path) -> None:
    a = checkpoints.make_llama(tmp_path / "a", num_hidden_layers=2)
    b = checkpoints.make_llama(tmp_path / "b", num_hidden_layers=2)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    c = checkpoints.make_llama(tmp_path / "c", num_hidden_layers=2, seed=1)
    with open(os.path.join(a, "model.safetensors"), "rb") as fa:
        with open(os.path.join(c, "model.safetensors"), "rb") as fc:
            assert fa.read() != fc.read()


def test_bf16_dtype(tmp_path) -> None:
    path = checkpoints.make_deepseek_v3(tmp_path / "bf16", dtype=torch.bfloat16)
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["dtype"] == "bfloat16"
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == (
            torch.float32
        )


@pytest.mark.slow
def test_smollm2_conversion(smollm2_dir: str) -> None:
    cfg = json.load(open(os.path.join(smollm2_dir, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is True
    model = _load(smollm2_dir)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_mtp_options(tmp_path) -> None:
    path = checkpoints.make_deepseek_v3(
        tmp_path / "mtp", num_nextn_predict_layers=1, mtp_own_embed=False, mtp_copy_main_head=False
    )
    shapes = _tensor_shapes(path)
    assert "model.layers.3.embed_tokens.weight" not in shapes
    assert shapes["model.layers.3.shared_head.head.weight"] == (512, 64)
    with safe_open(os.path.join(path, "model-00002-of-00002.safetensors"), framework="pt") as f:
        head = f.get_tensor("model.layers.3.shared_head.head.weight")
    with safe_open(os.path.join(path, "model-00001-of-00002.safetensors"), framework="pt") as f:
        assert not torch.equal(head, f.get_tensor("lm_head.weight"))
