# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EAGLE-1 draft head for Llama-family targets (the public EAGLE layout, as vLLM serves it).

The draft's input at each position is fc(concat[embed(next token), target feature]) with fc
2H -> H (its bias optional, as the checkpoint has it). The target feature is the target's last
hidden state after its final norm - what the target model returns and what vLLM feeds EAGLE-1;
later draft steps feed back the draft's own output. Then `num_hidden_layers` Llama decoder
layers, the first without an input_layernorm (its input already is the fc output), and no final
norm: the output stream (hidden + residual) predicts the next feature, to which the target's LM
head is applied directly. embed_tokens is optional (else the target's is shared), lm_head is
the target's unless the checkpoint ships one. `add_para_norm` (the HASS variant) normalises the
embedding and the feature before fc.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.forward_context import ForwardContext
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import RoutedLinear
from vllm.model_executor.model_loader.weight_utils import safetensors_weight_names
from vllm.model_executor.models.base import build_lm_head
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.utils import check_all_loaded, load_params_strict


def _checkpoint_name(name: str) -> str:
    """Checkpoint names come with or without a leading `model.` (lm_head never has one)."""
    return name[len("model.") :] if name.startswith("model.") else name


class EagleLlamaModel(nn.Module):
    def __init__(self, config: Any, fc_bias: bool, prefix: str = "model") -> None:
        super().__init__()
        h = int(config.hidden_size)
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = RoutedLinear(2 * h, h, bias=fc_bias)
        qkv_bias = bool(getattr(config, "attention_bias", False))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, prefix=f"{prefix}.layers.{i}")
            for i in range(int(config.num_hidden_layers))
        )
        self.layers[0].input_layernorm = nn.Identity()
        self.add_para_norm = bool(getattr(config, "add_para_norm", False))
        if self.add_para_norm:
            self.embedding_layernorm = RMSNorm(h, eps)
            self.hidden_states_layernorm = RMSNorm(h, eps)

    def forward(
        self,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """The output stream (hidden + residual of the last layer): the predicted feature, for
        the LM head and fed back alike."""
        if self.add_para_norm:
            inputs_embeds = self.embedding_layernorm(inputs_embeds)
            hidden_states = self.hidden_states_layernorm(hidden_states)
        hidden = self.fc(torch.cat([inputs_embeds, hidden_states], dim=-1), ctx.rows)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        return hidden + residual


class EagleLlamaForCausalLM(DraftModel):
    """EAGLE-1 draft (draft folder `architectures: ["LlamaForCausalLM"]`, method "eagle")."""

    model: EagleLlamaModel

    def build_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str
    ) -> EagleLlamaModel:
        config = self.config
        if int(getattr(config, "num_hidden_layers", 0) or 0) < 1:
            raise ValueError(
                f"EAGLE draft {model_config.model!r}: num_hidden_layers must be >= 1, got "
                f"{getattr(config, 'num_hidden_layers', None)!r}"
            )
        names = {_checkpoint_name(n) for n in safetensors_weight_names(model_config.model)}
        self.lm_head = build_lm_head(config)
        # Set from the checkpoint by load_weights; what it lacks is shared from the target.
        self.has_own_embed_tokens = False
        self.has_own_lm_head = False
        return EagleLlamaModel(config, fc_bias="fc.bias" in names, prefix=prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            name = _checkpoint_name(name)
            return name if name == "lm_head.weight" else "model." + name

        loaded = load_params_strict(self, weights, rename)
        self.has_own_embed_tokens = "model.embed_tokens.weight" in loaded
        self.has_own_lm_head = "lm_head.weight" in loaded
        # A missing embedding / LM head is the target's (DraftModel.bind_target).
        check_all_loaded(self, loaded, shared={"model.embed_tokens.weight", "lm_head.weight"})
        return loaded
