# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Qwen3.5 multi-token-prediction draft (`mtp.*` weights of a Qwen3.5 / Qwen3.5-MoE checkpoint),
run by the MTP speculator on the last pipeline stage.

One draft step: x = fc([pre_fc_norm_embedding(embed(next token)); pre_fc_norm_hidden(h)])
(embedding first), then full-attention decoder layer `spec_step_idx % n`, then mtp.norm; the
normed hidden gives the logits (through the target's lm_head) and feeds the next step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig, num_mtp_layers
from vllm.forward_context import ForwardContext
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.base import build_lm_head, tie_word_embeddings
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.qwen3_5 import (
    FULL_ATTENTION,
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
)
from vllm.model_executor.models.utils import (
    WeightLoadError,
    check_all_loaded,
    load_params_strict,
)
from vllm.sequence import IntermediateTensors


class Qwen3_5MultiTokenPredictor(nn.Module):
    moe: ClassVar[bool] = False

    def __init__(self, config: Any, prefix: str = "model") -> None:
        super().__init__()
        self.num_mtp_layers = num_mtp_layers(config)
        if self.num_mtp_layers <= 0:
            raise ValueError(
                "Qwen3_5MTP needs mtp_num_hidden_layers > 0 in the checkpoint's config"
            )
        h = config.hidden_size
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = ReplicatedLinear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, FULL_ATTENTION, f"{prefix}.layers.{j}", moe=self.moe)
            for j in range(self.num_mtp_layers)
        )
        self.norm = Qwen3_5RMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps)

    def forward(
        self,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        ctx: ForwardContext,
        spec_step_idx: int = 0,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor:
        # Branch on the inputs, never on the pipeline rank: the draft lives on the last stage,
        # which is not the first, yet it must still combine the embedding with the hidden state.
        if intermediate_tensors is None:
            x = torch.cat(
                [self.pre_fc_norm_embedding(inputs_embeds), self.pre_fc_norm_hidden(hidden_states)],
                dim=-1,
            )
            hidden, residual = self.fc(x, ctx.rows), None
        else:
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        layer = self.layers[spec_step_idx % self.num_mtp_layers]
        hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3_5MoeMultiTokenPredictor(Qwen3_5MultiTokenPredictor):
    moe = True


class Qwen3_5MTP(DraftModel):
    """Qwen3.5 MTP draft. It loads its own embedding and LM head from the checkpoint's target
    names (the target holds neither on the last stage under PP; at P = 1 the target's, equal,
    are kept instead)."""

    predictor_cls: ClassVar[type[Qwen3_5MultiTokenPredictor]] = Qwen3_5MultiTokenPredictor
    # On a multimodal target, the first pass reads the images' encoder outputs at placeholder
    # inputs (where its stage holds them: see DraftModel.bind_target).
    supports_mm_inputs = True
    model: Qwen3_5MultiTokenPredictor

    def build_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str
    ) -> Qwen3_5MultiTokenPredictor:
        model = self.predictor_cls(self.config, prefix=prefix)
        self.tied = tie_word_embeddings(model_config)
        self.lm_head = build_lm_head(self.config, model.embed_tokens if self.tied else None)
        return model

    def step_network(self, spec_step_idx: int) -> Callable[..., torch.Tensor]:
        return functools.partial(self.model, spec_step_idx=spec_step_idx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """`mtp.*` -> `model.*`; the embedding and LM head come from the target's names
        (`model[.language_model].embed_tokens.weight`, `lm_head.weight`); the rest is the
        target's."""
        seen_mtp = False

        def rename(name: str) -> str | None:
            nonlocal seen_mtp
            if name.startswith("mtp."):
                seen_mtp = True
                return "model." + name[len("mtp.") :]
            if name in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
                return "model.embed_tokens.weight"
            if name == "lm_head.weight" and not self.tied:
                return name
            return None

        loaded = load_params_strict(self, weights, rename)
        if not seen_mtp:
            raise WeightLoadError(
                "speculative method 'mtp' needs the checkpoint's mtp.* weights, but it has none "
                "(config.json declares mtp_num_hidden_layers="
                f"{self.model.num_mtp_layers}); use a checkpoint that ships the MTP head"
            )
        check_all_loaded(self, loaded, {"lm_head.weight"} if self.tied else set())
        return loaded


class Qwen3_5MoeMTP(Qwen3_5MTP):
    predictor_cls = Qwen3_5MoeMultiTokenPredictor
