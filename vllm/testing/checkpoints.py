# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tiny, deterministic Hugging Face checkpoints for the test suite.

Every builder writes a complete HF folder (``config.json``, safetensors weights,
``generation_config.json`` and the tokenizer files) that loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and returns the folder path.

Weights are re-initialised "peaky" (see :func:`_peaky_reinit_`): HF's default std=0.02
makes tiny random models emit nearly uniform logits, so greedy argmax would hinge on
float noise.  With the re-init the top-1/top-2 logit gap is typically ~0.5.

Facts about transformers 5.23 that the engine's loader relies on
-----------------------------------------------------------------

Rope config (llama, qwen2, deepseek_v3 alike): ``config.json`` holds a single
``"rope_parameters"`` dict that *contains* ``"rope_theta"`` and ``"rope_type"``
(``"default"`` when unscaled) plus the scaling keys (``factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_max_position_embeddings`` for llama3; ``factor``,
``beta_fast``, ``mscale`` ... for yarn).  There is no top-level ``rope_theta`` or
``rope_scaling`` any more.  Legacy files with top-level ``rope_theta`` / ``rope_scaling``
still load (transformers folds them into ``rope_parameters``).  Note that the config
constructors mutate a passed rope dict in place (they insert ``rope_theta``), so the
builders always pass a copy.  Weights dtype is written as ``"dtype"`` (not ``torch_dtype``).

The generic pieces (tokenizer, weight re-init, folder editing) are in hf_init.py, the DeepSeek
builders in deepseek_checkpoints.py; every builder is importable from here.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from vllm.model_zoo.smollm2 import CHATML_TEMPLATE, convert_smollm2, find_smollm2_gguf
from vllm.testing.deepseek_checkpoints import (
    V2_DEFAULTS,
    V3_DEFAULTS,
    _config_kwargs,
    _mtp_state,
    build_mla_model,
    load_hf_mtp_model,
    make_deepseek_v2,
    make_deepseek_v3,
)
from vllm.testing.hf_init import (
    _LOGIT_GAIN,
    _WEIGHT_GAIN,
    SPECIAL_TOKENS,
    _peaky_reinit_,
    _read_safetensors,
    _rope_parameters,
    _save_model,
    _token_ids,
    _train_tokenizer_json,
    _write_shards,
    build_tokenizer,
    copy_checkpoint,
    train_bpe,
    update_config_json,
)

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "V2_DEFAULTS",
    "V3_DEFAULTS",
    "_LOGIT_GAIN",
    "_WEIGHT_GAIN",
    "_config_kwargs",
    "_mtp_state",
    "_peaky_reinit_",
    "_read_safetensors",
    "_token_ids",
    "_train_tokenizer_json",
    "_write_shards",
    "build_mla_model",
    "build_tokenizer",
    "convert_smollm2",
    "copy_checkpoint",
    "find_smollm2_gguf",
    "load_hf_mtp_model",
    "logit_gaps",
    "make_deepseek_v2",
    "make_deepseek_v3",
    "make_llama",
    "make_qwen2",
    "train_bpe",
    "update_config_json",
]


# --------------------------------------------------------------------------- Llama / Qwen2


def _make_dense(
    arch: str,
    out_dir: str | os.PathLike,
    *,
    tie_word_embeddings: bool = False,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Shared body of :func:`make_llama` / :func:`make_qwen2`."""
    import transformers

    tokenizer = build_tokenizer(out_dir)
    config_cls = getattr(transformers, f"{arch}Config")
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    extra: dict[str, Any] = {}
    if arch == "Qwen2":
        extra = {"use_sliding_window": False, "max_window_layers": num_hidden_layers}
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=_rope_parameters(rope_scaling, rope_theta),
        rms_norm_eps=1e-6,
        **_token_ids(tokenizer),
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _peaky_reinit_(model, seed, output_head=model.get_output_embeddings().weight)
    _save_model(model, out_dir, dtype)
    return str(out_dir)


def make_llama(out_dir: str | os.PathLike, **kwargs: Any) -> str:
    """Write a tiny random ``LlamaForCausalLM`` checkpoint (+ tokenizer) to ``out_dir``.

    Keyword arguments (sizes, ``tie_word_embeddings``, ``seed``, ``dtype``, ...) are those of
    :func:`_make_dense`; ``rope_scaling`` (e.g. a llama3 dict) is stored in
    ``config.rope_parameters``.
    """
    return _make_dense("Llama", out_dir, **kwargs)


def make_qwen2(out_dir: str | os.PathLike, **kwargs: Any) -> str:
    """Write a tiny random ``Qwen2ForCausalLM`` checkpoint (random non-zero q/k/v biases).

    Keyword arguments are those of :func:`make_llama`.
    """
    return _make_dense("Qwen2", out_dir, **kwargs)


# --------------------------------------------------------------------------- helpers


@torch.no_grad()
def logit_gaps(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit at every position of ``input_ids`` ([B, T] -> [B*T])."""
    logits = model(input_ids=input_ids).logits.float()
    top2 = logits.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).flatten()
