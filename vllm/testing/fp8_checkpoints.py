# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""FP8 block-quantized copies of the tiny test checkpoints, laid out as DeepSeek and Qwen publish
theirs, and HF transformers references for them.

- quantize_checkpoint: every 2-D weight of a quantizable module becomes float8_e4m3fn plus
  `<module>.weight_scale_inv` (per [bn, bk] block: scale_inv = amax / 448, fp8 = w / scale_inv;
  a ceil-divided grid, so edge blocks are partial), config.json gets the publishers'
  quantization_config. Kept unquantized, as in the published checkpoints: embeddings, lm_head
  and the MTP shared_head.head, norms, MoE routers (mlp.gate) and Qwen's shared_expert_gate,
  the MTP input projections (DeepSeek eh_proj, Qwen mtp.fc), the DSA indexer's weights_proj, and
  Gated DeltaNet's in_proj_a / in_proj_b / conv1d. Fused HF expert tensors are written per expert
  first (the published layout).
- hf_dequantized_copy: the same model with each FP8 weight dequantized by transformers' own
  FP8 helper (`_dequantize_fp8_weight`, what its FP8Linear uses for edge blocks), an unquantized
  folder HF loads as usual. transformers 5.23's FineGrainedFP8Config(dequantize=True) loader
  derives the block from the scale grid and refuses a weight with partial edge blocks ("not
  divisible by scale grid"), so it can only load checkpoints whose sides are block multiples;
  load_hf_fp8 loads those.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from vllm.model_executor.layers.fused_moe import split_fused_experts
from vllm.testing.checkpoints import _read_safetensors, _write_shards, update_config_json
from vllm.testing.spec_checkpoints import _shards

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_UNQUANTIZED = re.compile(
    r"(embed_tokens|lm_head|shared_head\.head|norm|mlp\.gate\.weight$|shared_expert_gate"
    r"|eh_proj|mtp\.fc|weights_proj|in_proj_a|in_proj_b|conv1d)"
)


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    return tensor.ndim == 2 and name.endswith(".weight") and not _UNQUANTIZED.search(name)


def quantize_block(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]) by the publishers' recipe."""
    bn, bk = block
    n, k = weight.shape
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk)
    padded[:n, :k] = weight.float()
    blocks = padded.view(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale


def quantize_checkpoint(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    block: tuple[int, int] = (128, 128),
    scale_dtype: torch.dtype = torch.float32,
    list_unconverted: bool = False,
) -> str:
    """Write an FP8 copy of the checkpoint in src_dir (same shards); returns out_dir.

    scale_dtype: how weight_scale_inv is stored (DeepSeek float32, Qwen bfloat16).
    list_unconverted: write the unquantized 2-D modules to modules_to_not_convert (as Qwen's
    FP8 releases do)."""
    src, out = Path(src_dir), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    shards, unconverted = [], []
    for path in _shards(out):
        shard: dict[str, torch.Tensor] = {}
        for name, t in split_fused_experts(_read_safetensors(path)).items():
            if not quantizable(name, t):
                shard[name] = t
                if t.ndim == 2 and name.endswith(".weight"):
                    unconverted.append(name[: -len(".weight")])
                continue
            q, scale = quantize_block(t, block)
            shard[name] = q
            shard[name[: -len("weight")] + "weight_scale_inv"] = scale.to(scale_dtype)
        shards.append(shard)
    _write_shards(out, shards)
    qc: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    if list_unconverted:
        qc["modules_to_not_convert"] = sorted(unconverted)
    update_config_json(out, {"quantization_config": qc})
    return str(out)


def hf_dequantized_copy(fp8_dir: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """The FP8 checkpoint dequantized to float32 by transformers' own FP8 helper."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    src, out = Path(fp8_dir), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    before = update_config_json(out, {"dtype": "float32"}, drop=("quantization_config",))
    block = before["quantization_config"]["weight_block_size"]
    shards = []
    for path in _shards(out):
        tensors = _read_safetensors(path)
        shard = {}
        for name, t in tensors.items():
            if name.endswith("weight_scale_inv"):
                continue
            scale = tensors.get(name + "_scale_inv")
            if scale is not None:
                t = _dequantize_fp8_weight(t, scale.float(), block, torch.float32)
            shard[name] = t
        shards.append(shard)
    _write_shards(out, shards)
    return str(out)


def load_hf_fp8(fp8_dir: str | os.PathLike):
    """transformers loading the FP8 folder itself with FineGrainedFP8Config(dequantize=True)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(
        str(fp8_dir),
        dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(dequantize=True),
    ).eval()
