# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tiny DeepSeek-V2 / V3 checkpoints (MLA, MoE, optional MTP layers) for the test suite.

DeepSeek-V3 safetensors names (``model.layers.{k}.`` prefix, shapes for H=hidden,
nh=heads, dn=qk_nope_head_dim, dr=qk_rope_head_dim, dv=v_head_dim, r=kv_lora_rank,
rq=q_lora_rank, E=n_routed_experts, I=moe_intermediate_size, Id=intermediate_size)::

    input_layernorm.weight                        [H]
    post_attention_layernorm.weight               [H]
    self_attn.q_proj.weight                       [nh*(dn+dr), H]    (q_lora_rank is None)
    self_attn.q_a_proj.weight                     [rq, H]            (q_lora_rank set)
    self_attn.q_a_layernorm.weight                [rq]               (q_lora_rank set)
    self_attn.q_b_proj.weight                     [nh*(dn+dr), rq]   (q_lora_rank set)
    self_attn.kv_a_proj_with_mqa.weight           [r+dr, H]
    self_attn.kv_a_layernorm.weight               [r]
    self_attn.kv_b_proj.weight                    [nh*(dn+dv), r]
    self_attn.o_proj.weight                       [H, nh*dv]
    # dense layers (k < first_k_dense_replace)
    mlp.{gate,up}_proj.weight                     [Id, H]
    mlp.down_proj.weight                          [H, Id]
    # MoE layers
    mlp.gate.weight                               [E, H]   (router, sigmoid scoring)
    mlp.gate.e_score_correction_bias              [E]      (kept float32)
    mlp.experts.{e}.{gate,up}_proj.weight         [I, H]
    mlp.experts.{e}.down_proj.weight              [H, I]
    mlp.shared_experts.{gate,up}_proj.weight      [I*n_shared_experts, H]
    mlp.shared_experts.down_proj.weight           [H, I*n_shared_experts]

In memory transformers 5.23 keeps the experts fused (``mlp.experts.gate_up_proj``
``[E, 2I, H]`` = gate rows then up rows, and ``mlp.experts.down_proj`` ``[E, H, I]``), but
``save_pretrained`` reverts its weight conversion and writes the per-expert names above,
which is also the real DeepSeek-V3 layout.  ``from_pretrained`` loads both forms
(``per_expert_names=False`` writes the fused form).  HF applies the rope to the *interleaved*
rope dims (``rope_interleave: true`` is written to config.json by default).

MTP (``num_nextn_predict_layers = n > 0``): layers ``model.layers.{N+i}.`` (N =
num_hidden_layers) hold, besides a full MoE decoder block with the names above::

    enorm.weight [H]   hnorm.weight [H]   eh_proj.weight [H, 2H]
    shared_head.norm.weight [H]   shared_head.head.weight [V, H]   embed_tokens.weight [V, H]

``eh_proj`` acts on ``cat([enorm(embed(next_token)), hnorm(hidden)], -1)``.  By default
``embed_tokens``/``shared_head.head`` are exact copies of the main model's tensors, as in the
real checkpoint (HF's ``MtpModel`` ignores them and uses the main model's anyway).  These
weights live in a second shard listed by ``model.safetensors.index.json``.  The plain
``DeepseekV3ForCausalLM`` ignores (warns about) them; ``transformers.modeling_layers.MtpModel``
can load them once the model's ``_keys_to_ignore_on_load_unexpected`` lists the MTP layer
indices (see :func:`load_hf_mtp_model`).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe import fuse_experts, split_fused_experts
from vllm.testing.hf_init import (
    _LOGIT_GAIN,
    _WEIGHT_GAIN,
    _keep_router_bias_fp32_,
    _peaky_reinit_,
    _read_safetensors,
    _rope_parameters,
    _save_model,
    _token_ids,
    _write_shards,
    build_tokenizer,
    update_config_json,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["load_hf_mtp_model", "make_deepseek_v2", "make_deepseek_v3"]


@torch.no_grad()
def _mtp_state(
    model: PreTrainedModel,
    config: Any,
    n: int,
    seed: int,
    own_embed: bool,
    copy_main_head: bool,
    dtype: torch.dtype,
    block_fn: Any = None,
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 MTP tensors ``model.layers.{N+i}.*`` (per-expert / fused like HF's).

    ``block_fn(config, layer_idx)`` builds the HF decoder block (default DeepSeek-V3's)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    num_layers = config.num_hidden_layers
    hidden = config.hidden_size
    # MTP blocks are always MoE (as in DeepSeek-V3 and HF's MtpModel), whatever
    # first_k_dense_replace says.
    block_config = copy.deepcopy(config)
    block_config.first_k_dense_replace = 0
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    state: dict[str, torch.Tensor] = {}
    for i in range(n):
        idx = num_layers + i
        layer_seed = seed + 1000 * (i + 1)
        torch.manual_seed(layer_seed)
        block = (block_fn or DeepseekV3DecoderLayer)(block_config, layer_idx=idx)
        _peaky_reinit_(block, layer_seed)
        block.to(dtype)
        _keep_router_bias_fp32_(block)
        prefix = f"model.layers.{idx}."
        for k, v in split_fused_experts(block.state_dict()).items():
            state[prefix + k] = v.detach().clone()
        gen = torch.Generator().manual_seed(layer_seed + 1)

        def norm() -> torch.Tensor:
            return (torch.rand(hidden, generator=gen) + 0.5).to(dtype)  # noqa: B023

        state[prefix + "enorm.weight"] = norm()
        state[prefix + "hnorm.weight"] = norm()
        eh = torch.randn(hidden, 2 * hidden, generator=gen) * (_WEIGHT_GAIN / (2 * hidden) ** 0.5)
        state[prefix + "eh_proj.weight"] = eh.to(dtype)
        state[prefix + "shared_head.norm.weight"] = norm()
        if copy_main_head:
            state[prefix + "shared_head.head.weight"] = head.detach().clone().to(dtype)
        else:
            rand_head = torch.randn(head.shape, generator=gen) * (_LOGIT_GAIN / hidden**0.5)
            state[prefix + "shared_head.head.weight"] = rand_head.to(dtype)
        if own_embed:
            if copy_main_head:
                state[prefix + "embed_tokens.weight"] = embed.detach().clone().to(dtype)
            else:
                state[prefix + "embed_tokens.weight"] = torch.randn(embed.shape, generator=gen).to(
                    dtype
                )
    return state


def build_mla_model(
    config_cls: Any,
    model_cls: Any,
    out: Path,
    config_kwargs: dict[str, Any],
    seed: int,
    dtype: torch.dtype,
    reinit: Any,
) -> tuple[PreTrainedModel, Any]:
    """Tokenizer + a DeepSeek-family HF model (one KV head per head, as MLA has) from
    config_kwargs, re-initialised by reinit(model, seed, output_head=...) and saved to out."""
    tokenizer = build_tokenizer(out)
    config = config_cls(
        vocab_size=len(tokenizer),
        num_key_value_heads=config_kwargs["num_attention_heads"],
        rms_norm_eps=1e-6,
        **_token_ids(tokenizer),
        **config_kwargs,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    reinit(model, seed, output_head=model.get_output_embeddings().weight)
    _save_model(model, out, dtype)
    return model, config


def _make_deepseek(
    version: int,
    out_dir: str | os.PathLike,
    *,
    config_kwargs: dict[str, Any],
    num_nextn_predict_layers: int,
    mtp_own_embed: bool,
    mtp_copy_main_head: bool,
    per_expert_names: bool,
    architecture: str | None,
    seed: int,
    dtype: torch.dtype,
) -> str:
    """Shared body of :func:`make_deepseek_v3` / :func:`make_deepseek_v2`."""
    import transformers

    out = Path(out_dir)
    if version == 3:
        # DeepseekV3Config defaults num_mtp_layers (alias of num_nextn_predict_layers) to 1.
        config_kwargs = dict(config_kwargs, num_nextn_predict_layers=num_nextn_predict_layers)
    # HF writes per-expert names (reverse weight conversion).
    model, config = build_mla_model(
        getattr(transformers, f"DeepseekV{version}Config"),
        getattr(transformers, f"DeepseekV{version}ForCausalLM"),
        out,
        config_kwargs,
        seed,
        dtype,
        _peaky_reinit_,
    )

    if num_nextn_predict_layers > 0 or not per_expert_names:
        shards = [_read_safetensors(out / "model.safetensors")]
        if num_nextn_predict_layers > 0:
            shards.append(
                _mtp_state(
                    model,
                    config,
                    num_nextn_predict_layers,
                    seed,
                    mtp_own_embed,
                    mtp_copy_main_head,
                    dtype,
                )
            )
        if not per_expert_names:
            shards = [fuse_experts(s) for s in shards]
        _write_shards(out, shards)

    updates: dict[str, Any] = {}
    if architecture is not None:
        updates["architectures"] = [architecture]
    if version == 3:
        updates["num_nextn_predict_layers"] = num_nextn_predict_layers
    update_config_json(out, updates)
    return str(out)


# HF config fields of the tiny DeepSeek models (plus rope_scaling / rope_theta, folded into
# rope_parameters); each maker's ``**config`` overrides them.
V3_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 3,
    "hidden_size": 64,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_attention_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}
# DeepSeek-V2: softmax routing, greedy top-k, no expert groups.
V2_DEFAULTS: dict[str, Any] = {
    **V3_DEFAULTS,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": None,
    "topk_group": None,
}


def _config_kwargs(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` updated by ``overrides`` (unknown fields refused), rope folded."""
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise ValueError(f"unknown tiny-model config field(s) {sorted(unknown)}")
    kw = {**defaults, **overrides}
    rope = _rope_parameters(kw.pop("rope_scaling"), kw.pop("rope_theta"))
    return {**kw, "rope_parameters": rope}


def make_deepseek_v3(
    out_dir: str | os.PathLike,
    *,
    num_nextn_predict_layers: int = 0,
    mtp_own_embed: bool = True,
    mtp_copy_main_head: bool = True,
    per_expert_names: bool = True,
    architecture: str = "DeepseekV3ForCausalLM",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config: Any,
) -> str:
    """Write a tiny random DeepSeek-V3 (MLA + sigmoid/group-limited MoE) checkpoint.

    ``config`` overrides V3_DEFAULTS. With ``num_nextn_predict_layers = n > 0`` the folder is
    sharded and the second shard holds the MTP layers ``model.layers.{N+i}.*`` (see the module
    docstring). ``mtp_own_embed`` controls whether the MTP layers carry ``embed_tokens.weight``;
    ``mtp_copy_main_head=False`` makes their ``embed_tokens``/``shared_head.head`` random
    instead of copies of the main model's.  ``per_expert_names=False`` stores fused experts.
    """
    return _make_deepseek(
        3,
        out_dir,
        config_kwargs=_config_kwargs(V3_DEFAULTS, config),
        num_nextn_predict_layers=num_nextn_predict_layers,
        mtp_own_embed=mtp_own_embed,
        mtp_copy_main_head=mtp_copy_main_head,
        per_expert_names=per_expert_names,
        architecture=architecture,
        seed=seed,
        dtype=dtype,
    )


def make_deepseek_v2(
    out_dir: str | os.PathLike,
    *,
    per_expert_names: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config: Any,
) -> str:
    """Write a tiny random DeepSeek-V2 (MLA + softmax-routed MoE) checkpoint.

    ``config`` overrides V2_DEFAULTS. Same tensor names as DeepSeek-V3 minus
    ``mlp.gate.e_score_correction_bias``.
    """
    return _make_deepseek(
        2,
        out_dir,
        config_kwargs=_config_kwargs(V2_DEFAULTS, config),
        num_nextn_predict_layers=0,
        mtp_own_embed=False,
        mtp_copy_main_head=True,
        per_expert_names=per_expert_names,
        architecture=None,
        seed=seed,
        dtype=dtype,
    )


def load_hf_mtp_model(main_model: PreTrainedModel) -> nn.Module:
    """Load the MTP layers of ``main_model``'s checkpoint with transformers' ``MtpModel``.

    transformers 5.23 only recognises MTP keys listed in the model's
    ``_keys_to_ignore_on_load_unexpected`` (hard-coded to layer 61 for DeepSeek-V3), so the
    instance attribute is pointed at layers ``N .. N+n-1`` first.  Raises if any MTP
    weight is missing.  Useful as a reference implementation of MTP drafting.
    """
    from transformers.modeling_layers import MtpModel

    cfg = main_model.config.get_text_config()
    first = cfg.num_hidden_layers
    main_model._keys_to_ignore_on_load_unexpected = [
        rf"model\.layers\.{k}\..*" for k in range(first, first + cfg.num_mtp_layers)
    ]
    return MtpModel.from_pretrained(main_model).eval()
