# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Block FP8: dequantization against a per-element brute force and transformers' helper (edge
blocks partial), the quantization_config / --quantization checks, and strict loading of bad FP8
checkpoints (a weight without its scale, a misshaped scale, a scale for an unquantized weight,
FP8 where no quantized layer is, expert scales) with errors naming both tensors."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm.config import ModelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.quantization.fp8 import dequantize_fp8_block
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.utils import WeightLoadError
from vllm.testing import checkpoints
from vllm.testing.fp8_checkpoints import quantize_block, quantize_checkpoint

ATTN = "model.layers.0.self_attn"
EXPERT = "model.layers.1.mlp.experts.3"


def test_dequantize_partial_blocks_matches_brute_force_and_transformers() -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 40, 52, generator=g)  # [experts, N, K]: 40 = 2*16 + 8, 52 = 2*24 + 4
    block = (16, 24)
    pairs = [quantize_block(w[e], block) for e in range(2)]
    q = torch.stack([p[0] for p in pairs])
    s = torch.stack([p[1] for p in pairs])
    assert s.shape == (2, 3, 3)
    brute = torch.empty(2, 40, 52)
    for e in range(2):
        for i in range(40):
            for j in range(52):
                brute[e, i, j] = q[e, i, j].float() * s[e, i // 16, j // 24]
    ours = dequantize_fp8_block(q, s, block, torch.float32)
    assert torch.equal(ours, brute)
    assert torch.equal(ours, _dequantize_fp8_weight(q, s, list(block), torch.float32))
    # bf16: the float32 product rounded once.
    assert torch.equal(dequantize_fp8_block(q, s, block, torch.bfloat16), brute.bfloat16())
    # The recipe round-trips to within e4m3's precision (3 mantissa bits).
    assert (ours - w).abs().max() <= w.abs().max() * 2**-3


@pytest.fixture(scope="module")
def fp8_v3(tmp_path_factory) -> Path:
    """Tiny DeepSeek-V3 (MLA + MoE, no MTP) in [16, 24] blocks."""
    root = tmp_path_factory.mktemp("fp8_unit")
    src = checkpoints.make_deepseek_v3(root / "src")
    return Path(quantize_checkpoint(src, root / "fp8", block=(16, 24)))


def _variant(src: Path, dst: Path, edit=None, quantization_config=None) -> str:
    """A copy of src with edit(tensors) applied to its weights and/or its quantization_config
    replaced."""
    shutil.copytree(src, dst)
    if edit is not None:
        path = dst / "model.safetensors"
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path, {"format": "pt"})
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        if quantization_config == "drop":
            del cfg["quantization_config"]
        else:
            cfg["quantization_config"] = {**cfg["quantization_config"], **quantization_config}
        (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _load(path: str):
    return get_model(VllmConfig(model_config=ModelConfig(model=path)), device="cpu")


def test_loads_with_fp8_weights_and_scales(fp8_v3: Path) -> None:
    model = _load(str(fp8_v3))
    # CPU default: dequantized once after loading; the absorbed MLA kv_b_proj always is.
    attn = model.model.layers[0].self_attn
    assert attn.kv_a_proj_with_mqa.weight.dtype == torch.float32
    assert not hasattr(attn.kv_a_proj_with_mqa, "weight_scale_inv")
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.float32


def test_load_log_reports_bytes_as_stored_and_in_memory(fp8_v3: Path) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.model_executor.model_loader")
    logger.addHandler(handler)
    try:
        model = _load(str(fp8_v3))
    finally:
        logger.removeHandler(handler)
    stored = sum(
        t.numel() * t.element_size() for t in load_file(fp8_v3 / "model.safetensors").values()
    )
    in_memory = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stored < in_memory  # FP8 + float32 scales vs float32 after dequantizing at load
    expected = (
        f"weights {stored / 2**20:.2f} MiB as stored -> {in_memory / 2**20:.2f} MiB in memory"
    )
    assert any(expected in r.getMessage() for r in records), [r.getMessage() for r in records]


def test_forward_mode_keeps_fp8_resident(fp8_v3: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_FP8_DEQUANT", "forward")
    model = _load(str(fp8_v3))
    attn = model.model.layers[0].self_attn
    assert attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_a_proj_with_mqa.weight_scale_inv.shape == (3, 3)  # 40 x 64 in 16 x 24
    assert attn.kv_b_proj.weight.dtype == torch.float32  # absorbed: dequantized first
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert experts.w13_weight_scale_inv.shape == (8, 4, 3)  # gate grid 2x3 over up grid 2x3
    monkeypatch.setenv("VLLM_FP8_DEQUANT", "sometimes")
    with pytest.raises(ValueError, match="VLLM_FP8_DEQUANT must be one of"):
        _load(str(fp8_v3))


def test_fused_fp8_experts_load_like_per_expert(fp8_v3: Path, tmp_path: Path) -> None:
    """HF's in-memory layout: mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I] with
    `_scale_inv` twins (I a block multiple here, so gate and up grids stack)."""

    def fuse(t):
        for layer in (1, 2):
            p = f"model.layers.{layer}.mlp.experts"
            names = sorted({k.split(".")[5] for k in t if k.startswith(p + ".")}, key=int)
            for suffix in ("weight", "weight_scale_inv"):
                gate_up = [
                    torch.cat(
                        [t.pop(f"{p}.{e}.gate_proj.{suffix}"), t.pop(f"{p}.{e}.up_proj.{suffix}")]
                    )
                    for e in names
                ]
                down = [t.pop(f"{p}.{e}.down_proj.{suffix}") for e in names]
                tail = "" if suffix == "weight" else "_scale_inv"
                t[f"{p}.gate_up_proj{tail}"] = torch.stack(gate_up)
                t[f"{p}.down_proj{tail}"] = torch.stack(down)

    ref = _load(str(fp8_v3)).model.layers[1].mlp.experts
    got = _load(_variant(fp8_v3, tmp_path / "fused", edit=fuse)).model.layers[1].mlp.experts
    assert torch.equal(got.w13_weight, ref.w13_weight)
    assert torch.equal(got.w2_weight, ref.w2_weight)


def _drop(name: str):
    return lambda t: t.pop(name)


def _reshape_scale(name: str):
    def edit(t):
        t[name] = torch.ones(t[name].shape[0] + 1, t[name].shape[1])

    return edit


def _dequantize(name: str):
    def edit(t):
        t[name + ".weight"] = t[name + ".weight"].float()

    return edit


def _quantize_lm_head(t):
    q, s = quantize_block(t["lm_head.weight"], (16, 24))
    t["lm_head.weight"], t["lm_head.weight_scale_inv"] = q, s


BAD = {
    "missing_scale": (
        _drop(f"{ATTN}.kv_a_proj_with_mqa.weight_scale_inv"),
        rf"{ATTN}.kv_a_proj_with_mqa.weight' is FP8 but its block scale "
        rf"'{ATTN}.kv_a_proj_with_mqa.weight_scale_inv' is missing",
    ),
    "scale_shape": (
        _reshape_scale(f"{ATTN}.kv_a_proj_with_mqa.weight_scale_inv"),
        rf"scale '{ATTN}.kv_a_proj_with_mqa.weight_scale_inv' has shape \(4, 3\) but weight "
        rf"'{ATTN}.kv_a_proj_with_mqa.weight' \(40, 64\) in weight_block_size \[16, 24\] blocks "
        r"needs \(3, 3\)",
    ),
    "scale_for_unquantized_weight": (
        _dequantize(f"{ATTN}.o_proj"),
        rf"block scale '{ATTN}.o_proj.weight_scale_inv', but weight '{ATTN}.o_proj.weight' is "
        r"stored unquantized",
    ),
    "fp8_in_unquantized_layer": (
        _quantize_lm_head,
        r"'lm_head.weight' is stored quantized \(torch.float8_e4m3fn\) but 'lm_head.weight' is "
        r"not a quantized parameter",
    ),
    "missing_expert_scale": (
        _drop(f"{EXPERT}.up_proj.weight_scale_inv"),
        rf"are FP8 but their block scales are missing: '{EXPERT}.up_proj.weight' without "
        rf"'{EXPERT}.up_proj.weight_scale_inv'",
    ),
    "expert_scale_shape": (
        _reshape_scale(f"{EXPERT}.down_proj.weight_scale_inv"),
        rf"block scale '{EXPERT}.down_proj.weight_scale_inv' has shape \(5, 2\) in the "
        r"checkpoint but the model expects \(4, 2\)",
    ),
    "unquantized_expert": (
        _dequantize(f"{EXPERT}.gate_proj"),
        rf"'{EXPERT}.gate_proj.weight' is stored as torch.float32, but the fp8 "
        r"quantization_config \(fmt e4m3\) needs torch.float8_e4m3fn",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_fp8_checkpoint_is_a_clear_error(fp8_v3: Path, tmp_path: Path, case: str) -> None:
    edit, message = BAD[case]
    path = _variant(fp8_v3, tmp_path / case, edit=edit)
    with pytest.raises(WeightLoadError, match=message):
        _load(path)


def test_unquantized_linear_in_fp8_checkpoint_loads_as_stored(fp8_v3, tmp_path) -> None:
    """modules_to_not_convert (or a publisher's choice): a linear stored unquantized, without a
    scale, is used as stored."""

    def edit(t):
        name = f"{ATTN}.o_proj"
        t[name + ".weight"] = dequantize_fp8_block(
            t[name + ".weight"], t.pop(name + ".weight_scale_inv"), (16, 24), torch.float32
        )

    ref = _load(str(fp8_v3)).model.layers[0].self_attn.o_proj.weight
    model = _load(_variant(fp8_v3, tmp_path / "o_proj_bf16", edit=edit))
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, ref)


def test_fp8_weights_without_quantization_config(fp8_v3, tmp_path) -> None:
    path = _variant(fp8_v3, tmp_path / "no_qc", quantization_config="drop")
    with pytest.raises(WeightLoadError, match="lack its quantization_config"):
        _load(path)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("fmt", "e5m2", r"quantization_config.fmt 'e5m2' is not supported; supported: \['e4m3'\]"),
        ("quant_method", "awq", r"quant_method 'awq' is not supported; supported: \['fp8'\]"),
        ("activation_scheme", "static", r"activation_scheme 'static' is not supported"),
        ("weight_block_size", [128], r"weight_block_size must be two positive integers"),
        ("weight_block_size", None, r"weight_block_size must be two positive integers"),
        ("weight_block_size", [0, 128], r"weight_block_size must be two positive integers"),
        ("modules_to_not_convert", "lm_head", r"modules_to_not_convert must be a list"),
        ("scale_fmt", "int8", r"scale_fmt 'int8' is not supported"),
    ],
)
def test_bad_quantization_config_fails_at_construction(
    fp8_v3, tmp_path, field, value, message
) -> None:
    path = _variant(fp8_v3, tmp_path / "cfg", quantization_config={field: value})
    with pytest.raises(ValueError, match=message):
        ModelConfig(model=path)


def test_quantization_argument(fp8_v3, tmp_path) -> None:
    assert ModelConfig(model=str(fp8_v3)).quantization == "fp8"  # from the checkpoint
    assert ModelConfig(model=str(fp8_v3), quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match=r"quantization 'awq' is not supported"):
        ModelConfig(model=str(fp8_v3), quantization="awq")
    plain = _variant(fp8_v3, tmp_path / "plain", quantization_config="drop")
    with pytest.raises(ValueError, match="needs a checkpoint quantized ahead of time"):
        ModelConfig(model=plain, quantization="fp8")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--quantization", "fp8"])
    assert EngineArgs.from_cli_args(args).quantization == "fp8"
