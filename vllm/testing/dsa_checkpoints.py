# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tiny DeepSeek-V3.2 / GLM-MoE-DSA checkpoints built with HF transformers (peaky random init).

Besides the DeepSeek-V3 tensors (see vllm/testing/checkpoints.py), every attention layer with an
indexer holds, under ``model.layers.{k}.self_attn.indexer.``::

    wq_b.weight          [index_n_heads * index_head_dim, q_lora_rank]
    wk.weight            [index_head_dim, H]
    k_norm.weight/bias   [index_head_dim]          (LayerNorm, eps 1e-6)
    weights_proj.weight  [index_n_heads, H]        (HF keeps it in float32)

GLM-MoE-DSA layers whose ``indexer_types`` entry is ``"shared"`` have no indexer. Optional MTP
layers ``model.layers.{N+i}.*`` (second shard) carry a full V3.2 block, indexer included, plus
the usual ``enorm``/``hnorm``/``eh_proj``/``shared_head``/``embed_tokens``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from vllm.testing.checkpoints import (
    V3_DEFAULTS,
    _config_kwargs,
    _mtp_state,
    _peaky_reinit_,
    _read_safetensors,
    _write_shards,
    build_mla_model,
    update_config_json,
)

__all__ = ["close_topk_boundary", "make_deepseek_v32", "make_glm_moe_dsa"]

_K_NORM_BIAS_STD = 0.2


@torch.no_grad()
def _reinit(module: torch.nn.Module, seed: int, output_head: torch.Tensor | None = None) -> None:
    """vllm/testing/checkpoints.py's peaky init, with small centred LayerNorm biases on the indexer
    keys (the generic rule would give them U[0.5, 1.5], shifting every key alike)."""
    _peaky_reinit_(module, seed, output_head=output_head)
    gen = torch.Generator().manual_seed(seed + 7)
    for name, p in module.named_parameters():
        if name.endswith("indexer.k_norm.bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * _K_NORM_BIAS_STD)


def _block_fn(glm: bool):
    """HF decoder-block factory for MTP layers (index >= num_hidden_layers): MoE, own indexer."""
    Layer: type[torch.nn.Module]
    if glm:
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
            GlmMoeDsaDecoderLayer as Layer,
        )
    else:
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
            DeepseekV32DecoderLayer as Layer,
        )

    def make(config: Any, layer_idx: int) -> torch.nn.Module:
        cfg = copy.deepcopy(config)
        extra = layer_idx + 1 - len(cfg.mlp_layer_types)
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"] * extra
        if glm:
            cfg.indexer_types = list(cfg.indexer_types) + ["full"] * extra
        return Layer(cfg, layer_idx=layer_idx)  # _mtp_state re-initialises it

    return make


def _make_dsa(
    glm: bool,
    out_dir: str | os.PathLike,
    *,
    num_nextn_predict_layers: int = 0,
    index_share_for_mtp_iteration: bool | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    mtp_own_embed: bool = True,
    **config: Any,
) -> str:
    """Shared body of :func:`make_deepseek_v32` / :func:`make_glm_moe_dsa`."""
    import transformers

    config_kwargs = _config_kwargs(GLM_DEFAULTS if glm else V32_DEFAULTS, config)

    out = Path(out_dir)
    # Either family: the same constructor arguments, types HF keeps apart.
    model, config = build_mla_model(
        transformers.GlmMoeDsaConfig if glm else transformers.DeepseekV32Config,
        transformers.GlmMoeDsaForCausalLM if glm else transformers.DeepseekV32ForCausalLM,
        out,
        config_kwargs,
        seed,
        dtype,
        _reinit,
    )
    if num_nextn_predict_layers > 0:
        shards = [_read_safetensors(out / "model.safetensors")]
        mtp = _mtp_state(
            model,
            config,
            num_nextn_predict_layers,
            seed,
            own_embed=mtp_own_embed,
            copy_main_head=True,
            dtype=dtype,
            block_fn=_block_fn(glm),
        )
        gen = torch.Generator().manual_seed(seed + 99)
        for name, t in mtp.items():
            if name.endswith("indexer.k_norm.bias"):
                mtp[name] = (torch.randn(t.shape, generator=gen) * _K_NORM_BIAS_STD).to(t.dtype)
        shards.append(mtp)
        _write_shards(out, shards)
    updates: dict[str, Any] = {"num_nextn_predict_layers": num_nextn_predict_layers}
    if index_share_for_mtp_iteration is not None:
        updates["index_share_for_mtp_iteration"] = index_share_for_mtp_iteration
    update_config_json(out, updates)
    return str(out)


# V3's tiny config (vllm/testing/checkpoints.py) with a q LoRA and the indexer. 8 indexer heads
# make an exactly-zero index score (every head clipped by the ReLU) rare, so the top-k selection
# has no ties for HF and us to break differently.
V32_DEFAULTS: dict[str, Any] = {
    **V3_DEFAULTS,
    "q_lora_rank": 24,
    "index_topk": 8,
    "index_n_heads": 8,
    "index_head_dim": 16,
}
# GLM-5 layout: no expert groups, and layer 2 "shared" (reuses layer 1's top-k).
GLM_DEFAULTS: dict[str, Any] = {
    **V32_DEFAULTS,
    "num_hidden_layers": 4,
    "n_group": 1,
    "indexer_types": ["full", "full", "shared", "full"],
}


def make_deepseek_v32(out_dir: str | os.PathLike, **kwargs: Any) -> str:
    """Write a tiny random ``DeepseekV32ForCausalLM`` checkpoint (+ tokenizer) to ``out_dir``.

    Keyword arguments: ``num_nextn_predict_layers``, ``index_share_for_mtp_iteration``,
    ``mtp_own_embed``, ``seed``, ``dtype``; any other overrides V32_DEFAULTS. With
    ``num_nextn_predict_layers = n > 0`` the second shard holds MTP layers
    ``model.layers.{N+i}.*`` (each with its own indexer, and its own ``embed_tokens`` unless
    ``mtp_own_embed=False``: then only the top-level table exists);
    ``index_share_for_mtp_iteration`` is written to config.json when given.
    """
    return _make_dsa(False, out_dir, **kwargs)


def make_glm_moe_dsa(out_dir: str | os.PathLike, **kwargs: Any) -> str:
    """Write a tiny random ``GlmMoeDsaForCausalLM`` (interleaved indexer RoPE, a ``"shared"``
    layer); config fields override GLM_DEFAULTS; the rest as :func:`make_deepseek_v32`."""
    return _make_dsa(True, out_dir, **kwargs)


# Layer-0 indexer key scale of close_topk_boundary: keys then differ between positions by about
# 1e-6 of their size, so neighbouring index scores at the top-k boundary differ in their last
# few bits (below float32's 6e-8 per addition times a handful of heads).
CLOSE_KEY_SCALE = 1e-6


@torch.no_grad()
def close_topk_boundary(
    out_dir: str | os.PathLike, src_dir: str | os.PathLike, key_scale: float = CLOSE_KEY_SCALE
) -> str:
    """Copy a DSA checkpoint so that layer 0's index scores are nearly tied at the top-k
    boundary: its indexer's k_norm scale is multiplied by ``key_scale`` and its bias is zeroed
    on the rotary dims, so every position's key is almost the same vector (the bias) and the
    scores of a query over its context differ only in their last bits. Which candidates win
    then depends on the order the per-head terms are summed in: a selection that changes with
    the TP size (partial sums over ranks) changes the text. Only layer 0 is made close: its
    inputs (embeddings) are bit-identical at every TP size, so an exact selection is possible
    there; later layers read hidden states that TP sums in another order and keep the
    fixture's ordinary margins."""
    src, out = Path(src_dir), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    rope = int(json.loads((out / "config.json").read_text())["qk_rope_head_dim"])
    prefix = "model.layers.0.self_attn.indexer.k_norm."
    files = sorted(out.glob("model*.safetensors"))
    shards = [_read_safetensors(f) for f in files]
    found = False
    for shard in shards:
        if prefix + "weight" in shard:
            shard[prefix + "weight"] = shard[prefix + "weight"] * key_scale
            bias = shard[prefix + "bias"].clone()
            bias[:rope] = 0
            shard[prefix + "bias"] = bias
            found = True
    if not found:
        raise ValueError(f"{src} has no {prefix}weight (not a DSA checkpoint)")
    _write_shards(out, shards)
    return str(out)
