# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeepSeek-V2/V3 (MLA + MoE) against HF transformers: prefill and decode logits, strict loading."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm.attention.backends.torch_paged import build_attn_metadata
from vllm.config import ModelConfig, VllmConfig
from vllm.distributed.parallel_state import PPGroup, get_pp_group, set_pp_group
from vllm.forward_context import ForwardContext
from vllm.model_executor.layers.attention import AttentionLayerBase
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.deepseek_v2 import get_spec_layer_idx_from_weight_name
from vllm.model_executor.models.utils import WeightLoadError
from vllm.sequence import IntermediateTensors
from vllm.testing.checkpoints import make_deepseek_v2, make_deepseek_v3

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
NUM_BLOCKS = 16
PROMPT_LEN = 20
DECODE_STEPS = 3
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def _build(tmp: Path, arch: str, q_lora_rank: int | None, yarn: bool = False, **kw) -> Path:
    """A tiny random checkpoint from vllm/testing/checkpoints.py (V3 with one MTP layer by default,
    whose tensors the target must skip)."""
    common = dict(q_lora_rank=q_lora_rank, qk_rope_head_dim=16, v_head_dim=24)
    common["rope_scaling"] = dict(YARN) if yarn else None
    if arch == "DeepseekV3ForCausalLM":
        kw = {"n_group": 4, "topk_group": 2, "num_nextn_predict_layers": 1, **kw}
        return Path(make_deepseek_v3(tmp / "v3", **common, **kw))
    return Path(make_deepseek_v2(tmp / "v2", **common, **kw))


def _hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _hf_logits(path_or_model, ids: torch.Tensor) -> torch.Tensor:
    """HF logits of the whole sequence (no cache) for every position."""
    model = (
        path_or_model if isinstance(path_or_model, torch.nn.Module) else _hf_model(path_or_model)
    )
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def _load(path: Path):
    model = get_model(VllmConfig(model_config=ModelConfig(model=str(path))), device="cpu")
    for m in model.modules():
        if isinstance(m, AttentionLayerBase):
            m.kv_cache = torch.zeros(m.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))
    return model


def _step(model, ids: torch.Tensor, start: int, intermediate=None):
    """Run tokens ids (positions start..) of one request whose first start tokens are cached."""
    t = len(ids)
    meta = build_attn_metadata(
        query_start_loc=np.array([0, t]),
        seq_lens=np.array([start + t]),
        block_table=np.arange(NUM_BLOCKS)[None],
        block_size=BLOCK_SIZE,
        device="cpu",
    )
    positions = torch.arange(start, start + t)
    with torch.no_grad():
        return model(ids, positions, intermediate, ctx=ForwardContext(meta))


def _prompt(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))


def _check_prefill_and_decode(path: Path) -> None:
    model, hf = _load(path), _hf_model(path)
    ids = _prompt(model.config.vocab_size)
    ref = _hf_logits(hf, ids)
    logits = model.compute_logits(_step(model, ids, 0), None)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    for _ in range(DECODE_STEPS):
        nxt = ref[-1].argmax().view(1)
        start = len(ids)
        ids = torch.cat([ids, nxt])
        ref = _hf_logits(hf, ids)
        out = model.compute_logits(_step(model, nxt, start), None)
        torch.testing.assert_close(out[0], ref[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "q_lora_rank,yarn", [(None, False), (24, False), (24, True)], ids=["q_proj", "q_lora", "yarn"]
)
def test_deepseek_v3_matches_hf(tmp_path: Path, q_lora_rank: int | None, yarn: bool) -> None:
    _check_prefill_and_decode(_build(tmp_path, "DeepseekV3ForCausalLM", q_lora_rank, yarn))


@pytest.mark.parametrize(
    "topk_method,q_lora_rank,yarn",
    [("greedy", None, False), ("group_limited_greedy", 24, True)],
    ids=["greedy", "group_limited"],
)
def test_deepseek_v2_matches_hf(
    tmp_path: Path, topk_method: str, q_lora_rank: int | None, yarn: bool
) -> None:
    path = _build(
        tmp_path,
        "DeepseekV2ForCausalLM",
        q_lora_rank,
        yarn,
        topk_method=topk_method,
        routed_scaling_factor=1.5,
        n_group=4,
        topk_group=1,  # with 2 of 4 groups and top-2, group-limited would equal greedy
    )
    _check_prefill_and_decode(path)


def _rewrite(path: Path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_fused_expert_checkpoint_names(tmp_path: Path) -> None:
    """HF's in-memory layout (mlp.experts.gate_up_proj / down_proj, stacked) loads too."""
    path = _build(tmp_path, "DeepseekV3ForCausalLM", 24, per_expert_names=False)
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    model = _load(path)
    ids = _prompt(model.config.vocab_size)
    logits = model.compute_logits(_step(model, ids, 0), None)
    torch.testing.assert_close(logits, _hf_logits(path, ids), atol=1e-4, rtol=1e-4)


def test_missing_expert_weight_is_named(tmp_path: Path) -> None:
    path = _build(tmp_path, "DeepseekV3ForCausalLM", None, num_nextn_predict_layers=0)
    _rewrite(path, lambda w: w.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(
        WeightLoadError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"
    ):
        _load(path)


@pytest.mark.parametrize(
    "name,shape",
    [
        ("model.layers.1.mlp.experts.3.gate_proj.weight", (31, 64)),
        ("model.layers.0.self_attn.kv_b_proj.weight", (160, 31)),  # 4 heads * (16 + 24)
    ],
)
def test_misshaped_weight_names_both_shapes(tmp_path: Path, name: str, shape) -> None:
    path = _build(tmp_path, "DeepseekV3ForCausalLM", None, num_nextn_predict_layers=0)
    _rewrite(path, lambda w: w.__setitem__(name, torch.zeros(shape)))
    expected = (32, 64) if "experts" in name else (160, 32)
    with pytest.raises(WeightLoadError) as err:
        _load(path)
    msg = str(err.value)
    assert name in msg and str(shape) in msg and str(expected) in msg


@pytest.mark.parametrize("shard", ["gate_proj", "up_proj"])
def test_packed_projection_shards_are_strict(tmp_path: Path, shard: str) -> None:
    """gate_proj / up_proj fill the packed gate_up_proj: a missing or misshaped one is named."""
    path = _build(tmp_path, "DeepseekV3ForCausalLM", None, num_nextn_predict_layers=0)
    name = f"model.layers.0.mlp.{shard}.weight"
    _rewrite(path, lambda w: w.pop(name))
    with pytest.raises(WeightLoadError, match=re.escape(name)):
        _load(path)
    path = _build(tmp_path / "b", "DeepseekV3ForCausalLM", None, num_nextn_predict_layers=0)
    holder = {}

    def shrink(w: dict) -> None:
        holder["shape"] = tuple(w[name].shape)
        w[name] = w[name][1:].clone()

    _rewrite(path, shrink)
    with pytest.raises(WeightLoadError) as err:
        _load(path)
    rows, cols = holder["shape"]
    msg = str(err.value)
    assert name in msg and str((rows - 1, cols)) in msg and str((rows, cols)) in msg


def test_expert_weight_loaded_twice_is_an_error(tmp_path: Path) -> None:
    path = _build(tmp_path, "DeepseekV3ForCausalLM", None, num_nextn_predict_layers=0)

    def add_fused_copy(w: dict) -> None:
        p = "model.layers.1.mlp.experts"
        w[f"{p}.down_proj"] = torch.stack([w[f"{p}.{e}.down_proj.weight"] for e in range(8)])

    _rewrite(path, add_fused_copy)
    with pytest.raises(WeightLoadError, match="twice"):
        _load(path)


def test_pipeline_stages_match_hf(tmp_path: Path) -> None:
    """Two stages run in one process (no communication needed) equal HF's logits."""
    path = _build(tmp_path, "DeepseekV3ForCausalLM", 24)
    ids = _prompt(transformers.AutoConfig.from_pretrained(path).vocab_size)
    prev = get_pp_group()
    try:
        set_pp_group(PPGroup(rank=0, world_size=2))
        first = _load(path)
        set_pp_group(PPGroup(rank=1, world_size=2))
        last = _load(path)
        set_pp_group(PPGroup(rank=0, world_size=2))
        out = _step(first, ids, 0)
        assert isinstance(out, IntermediateTensors) and set(out.keys()) == {
            "hidden_states",
            "residual",
        }
        empty = first.make_empty_intermediate_tensors(len(ids), torch.float32, "cpu")
        assert empty["hidden_states"].shape == out["hidden_states"].shape
        set_pp_group(PPGroup(rank=1, world_size=2))
        logits = last.compute_logits(_step(last, ids, 0, out), None)
    finally:
        set_pp_group(prev)
    torch.testing.assert_close(logits, _hf_logits(path, ids), atol=1e-4, rtol=1e-4)


def test_spec_layer_idx() -> None:
    cfg = transformers.DeepseekV3Config(num_hidden_layers=3, num_nextn_predict_layers=2)
    assert get_spec_layer_idx_from_weight_name(cfg, "model.layers.3.enorm.weight") == 3
    assert get_spec_layer_idx_from_weight_name(cfg, "model.layers.4.eh_proj.weight") == 4
    assert get_spec_layer_idx_from_weight_name(cfg, "model.layers.2.mlp.gate.weight") is None
    assert get_spec_layer_idx_from_weight_name(cfg, "model.layers.5.enorm.weight") is None
    assert get_spec_layer_idx_from_weight_name(cfg, "model.embed_tokens.weight") is None
