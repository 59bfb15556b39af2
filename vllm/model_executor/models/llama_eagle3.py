# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EAGLE3 draft head for Llama-family targets: fc over the target's aux hidden states, a first
decoder layer whose attention reads [embedding ; hidden] (optionally more plain layers after it),
and an LM head over a reduced draft vocabulary.

Two public checkpoint layouts load into it: the legacy one (`LlamaForCausalLMEagle3`, layer 0 as
`midlayer.*`, switches at the top level or in `eagle_config`) and the speculators format
(`speculators_model_type: "eagle3"`, flattened by vllm/transformers_utils/speculators.py; layers
as `layers.N.*`, `input_norm` for norm_before_fc, `fc_norm.N` for fc_norm).

Forward of one draft step (what speculators trains, what vLLM serves):
  hidden  = fc(cat(aux taps))            [step 0; later steps: the previous step's output]
  x       = cat(input_layernorm(embed(token)), hidden_norm(hidden))
  residual= hidden_norm(hidden) if norm_before_residual else hidden
  h       = residual + attn(x);  h = h + mlp(post_attention_layernorm(h));  (more layers ...)
  logits  = lm_head(norm(h))  over the draft vocabulary; target id = draft id + d2t[draft id]
  fed back to the next step: h (the pre-norm stream), or norm(h) when norm_output is set.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.config.draft import (
    eagle3_switch,
    get_eagle3_aux_layers_from_config,
    get_eagle3_use_aux_hidden_state_from_config,
)
from vllm.forward_context import ForwardContext, RowKinds
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import RoutedLinear
from vllm.model_executor.models.draft import DraftVocabModel, check_combined_taps
from vllm.model_executor.models.interfaces import CombinesHiddenStates, TargetShares
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from vllm.model_executor.models.utils import load_params_strict

logger = init_logger(__name__)


class Eagle3DecoderLayer(nn.Module):
    """Decoder layer whose q/k/v read concat[input_layernorm(embeds), hidden_norm(hidden)]."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        h = config.hidden_size
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(
            config,
            bool(getattr(config, "attention_bias", False)),
            prefix=f"{prefix}.self_attn",
            input_size=2 * h,
        )
        self.mlp = LlamaMLP(h, config.intermediate_size, bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.norm_before_residual = eagle3_switch(config, "norm_before_residual")

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual): their sum is the stream after this layer."""
        if self.norm_before_residual:
            hidden_states = self.hidden_norm(hidden_states)
            residual = hidden_states
        else:
            residual = hidden_states
            hidden_states = self.hidden_norm(hidden_states)
        x = torch.cat([self.input_layernorm(embeds), hidden_states], dim=-1)
        attn = self.self_attn(positions, x, ctx)
        hidden_states, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(hidden_states, ctx), residual


class Eagle3LlamaModel(nn.Module):
    def __init__(self, config: Any, prefix: str = "model") -> None:
        super().__init__()
        h = config.hidden_size
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        n_layers = int(getattr(config, "num_hidden_layers", 1) or 1)
        qkv_bias = bool(getattr(config, "attention_bias", False))
        self.layers = nn.ModuleList(
            [Eagle3DecoderLayer(config, prefix=f"{prefix}.layers.0")]
            + [
                LlamaDecoderLayer(config, qkv_bias, prefix=f"{prefix}.layers.{i}")
                for i in range(1, n_layers)
            ]
        )
        self.fc = None
        self.input_norm = None  # norm_before_fc: one RMSNorm over the concatenated taps
        self.fc_norm = None  # fc_norm: one RMSNorm per tap before concatenation
        if get_eagle3_use_aux_hidden_state_from_config(config):
            target_h = int(getattr(config, "target_hidden_size", None) or h)
            num_aux = len(get_eagle3_aux_layers_from_config(config) or (0, 0, 0))
            self.fc = RoutedLinear(num_aux * target_h, h, bias=False)
            if eagle3_switch(config, "norm_before_fc"):
                self.input_norm = RMSNorm(num_aux * target_h, eps)
            if eagle3_switch(config, "fc_norm"):
                self.fc_norm = nn.ModuleList([RMSNorm(target_h, eps) for _ in range(num_aux)])
            if self.input_norm is not None and self.fc_norm is not None:
                raise ValueError("EAGLE3 config sets both norm_before_fc and fc_norm")
        self.norm = RMSNorm(h, eps)
        self.norm_output = eagle3_switch(config, "norm_output")
        # The compute dtype (built under the model's default dtype); fc's weight may be kept
        # in bf16 under an fp32 draft (keeps_exact_bf16_weights).
        self.dtype = torch.get_default_dtype()

    def combine(self, aux: torch.Tensor, rows: RowKinds | None) -> torch.Tensor:
        if self.fc is None:
            return aux
        aux = aux.to(self.dtype)
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        elif self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux, rows)

    def forward(
        self,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed hidden for the LM head, stream fed back to the next draft step)."""
        hidden, residual = self.layers[0](positions, inputs_embeds, hidden_states, ctx)
        for layer in self.layers[1:]:
            hidden, residual = layer(positions, hidden, residual, ctx)
        normed, prenorm = self.norm(hidden, residual)
        return normed, (normed if self.norm_output else prenorm)


class LlamaForCausalLMEagle3(DraftVocabModel, CombinesHiddenStates):
    """EAGLE3 draft (legacy `LlamaForCausalLMEagle3` folders and speculators `eagle3` ones)."""

    model: Eagle3LlamaModel
    keeps_exact_bf16_weights = True

    def build_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str
    ) -> Eagle3LlamaModel:
        self.init_draft_vocab(self.config)
        return Eagle3LlamaModel(self.config, prefix=prefix)

    def bind_target(self, shares: TargetShares) -> None:
        super().bind_target(shares)
        check_combined_taps(self, self.model.fc, shares)

    def combine_hidden_states(
        self, hidden_states: torch.Tensor, rows: RowKinds | None
    ) -> torch.Tensor:
        return self.model.combine(hidden_states, rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if name in ("t2d", "verifier_lm_head.weight", "verifier_norm.weight"):
                return None  # training-time buffers (t2d is d2t's inverse mask)
            if "rotary_emb.inv_freq" in name:
                return None
            if name.startswith("model."):
                name = name[len("model.") :]
            if name.startswith("midlayer."):
                name = "layers.0." + name[len("midlayer.") :]
            if name in ("d2t", "lm_head.weight"):
                if name == "d2t" and self.d2t is None:
                    return None  # identity map over a full vocabulary
                return name
            return "model." + name

        return self.finish_draft_vocab_loading(load_params_strict(self, weights, rename))
