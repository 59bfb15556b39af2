# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Llama (and, with qkv bias, Qwen2): GQA attention with RoPE, SwiGLU MLP, RMSNorm."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.rotary_embedding import get_rope, rope_params
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    check_all_loaded,
    init_pp_decoder,
    load_params_strict,
    maybe_prefix,
    spec_decode_needs_target_embed,
)
from vllm.sequence import IntermediateTensors


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = ReplicatedLinear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = ReplicatedLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = ReplicatedLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(torch.cat([self.gate_proj(x), self.up_proj(x)], -1)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, prefix: str) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        o_bias = bool(getattr(config, "attention_bias", False)) and not qkv_bias
        self.q_proj = ReplicatedLinear(h, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = ReplicatedLinear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = ReplicatedLinear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = ReplicatedLinear(self.num_heads * self.head_dim, h, bias=o_bias)
        theta, scaling = rope_params(config)
        self.rotary_emb = get_rope(
            self.head_dim,
            self.head_dim,
            int(config.max_position_embeddings),
            theta,
            is_neox_style=True,
            scaling=scaling,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, prefix: str) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(config, qkv_bias, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module, EagleModelMixin):
    qkv_bias = False
    supports_aux_hidden_states_over_pp = True

    def __init__(self, config: Any, prefix: str = "model", keep_embed: bool = False) -> None:
        """keep_embed: build embed_tokens on this stage even if not first (an EAGLE draft on
        the last stage shares it, see spec_decode_needs_target_embed)."""
        super().__init__()
        self.config = config
        tied = bool(getattr(config, "tie_word_embeddings", False))
        init_pp_decoder(
            self,
            config,
            lambda p: LlamaDecoderLayer(config, self.qkv_bias, p),
            lambda: RMSNorm(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6)),
            prefix,
            embed_on_last=tied or keep_embed,
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        """Last stage: the normed hidden states, or (hidden, aux hidden states in tap order)
        when EAGLE3 taps are set; other stages: IntermediateTensors (+ their packed taps)."""
        aux: list[torch.Tensor] = []
        remote = self.collect_remote_aux_hidden_states(intermediate_tensors)
        if intermediate_tensors is None:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
            self._maybe_add_hidden_state(aux, self.start_layer, hidden, residual)
        else:
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for idx in range(self.start_layer, self.end_layer):
            hidden, residual = self.layers[idx](positions, hidden, residual)
            self._maybe_add_hidden_state(aux, idx + 1, hidden, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors(
                {
                    "hidden_states": hidden,
                    "residual": residual,
                    **self.pack_local_aux_hidden_states(aux),
                }
            )
        hidden, _ = self.norm(hidden, residual)
        if remote or aux:
            return hidden, remote + aux
        return hidden


class LlamaForCausalLM(nn.Module, SupportsEagle3):
    """Llama causal LM; supports pipeline parallelism and EAGLE3 aux hidden states."""

    supports_pp = True
    model_cls = LlamaModel

    def __init__(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> None:
        super().__init__()
        config = model_config.hf_text_config
        self.config = config
        self.model = self.model_cls(
            config,
            prefix=maybe_prefix(prefix, "model"),
            keep_embed=spec_decode_needs_target_embed(vllm_config),
        )
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if get_pp_group().is_last_rank:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if self.tied:
                self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if self.tied and name == "lm_head.weight":
                return None  # tied checkpoints may still carry a copy
            return name

        loaded = load_params_strict(self, weights, rename)
        shared = {"lm_head.weight"} if self.tied else set()
        check_all_loaded(self, loaded, shared)
        return loaded
