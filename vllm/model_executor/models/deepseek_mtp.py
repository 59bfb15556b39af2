# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeepSeek multi-token-prediction (MTP) draft: the extra `model.layers.{N+i}` blocks of a
DeepSeek-V3 checkpoint, run by the MTP speculator on the last pipeline stage."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig, num_mtp_layers
from vllm.forward_context import ForwardContext, RowKinds
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.base import build_lm_head
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    get_spec_layer_idx_from_weight_name,
)
from vllm.model_executor.models.draft import DraftModel, SharedModule
from vllm.model_executor.models.utils import (
    WeightLoadError,
    check_all_loaded,
    load_params_strict,
)

# Weights of an MTP layer that sit next to (not inside) its decoder block.
_SPEC_LAYER_PARTS = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")


class SharedHead(nn.Module):
    """The MTP layer's own final norm and vocabulary projection."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6))
        self.head = build_lm_head(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)


class DeepSeekMultiTokenPredictorLayer(nn.Module):
    """x = eh_proj([enorm(embed(next token)), hnorm(h_prev)]); h = block(x) incl. residual."""

    # Its own table, or one shared with another MTP layer / the target after loading.
    embed_tokens: nn.Module

    def __init__(
        self, config: Any, prefix: str, layer_idx: int, mtp_block: nn.Module | None = None
    ) -> None:
        """mtp_block: a prebuilt decoder block (V3.2 passes its sparse one)."""
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config)
        if mtp_block is None:
            mtp_block = DeepseekV2DecoderLayer(
                config, prefix=f"{prefix}.mtp_block", layer_idx=layer_idx
            )
        self.mtp_block = mtp_block

    def forward(
        self,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        # Position 0 has no previous token whose hidden state could pair with this embedding.
        inputs_embeds = inputs_embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.eh_proj(
            torch.cat([self.enorm(inputs_embeds), self.hnorm(previous_hidden_states)], dim=-1),
            ctx.rows,
        )
        hidden, residual = self.mtp_block(positions, x, None, ctx)
        return hidden + residual


class DeepSeekMultiTokenPredictor(nn.Module):
    """The MTP layers keyed by absolute layer index; draft step s uses layer start + s % n
    (DeepSeekMTP runs that layer)."""

    def __init__(
        self,
        config: Any,
        prefix: str = "model",
        layer_fn: Callable[[str, int], nn.Module] | None = None,
    ) -> None:
        """layer_fn(prefix, layer_idx) builds one MTP layer (default: the V2/V3 one)."""
        super().__init__()
        if layer_fn is None:
            layer_fn = lambda p, i: DeepSeekMultiTokenPredictorLayer(config, p, i)
        self.mtp_start_layer_idx = int(config.num_hidden_layers)
        self.num_mtp_layers = num_mtp_layers(config)
        if self.num_mtp_layers <= 0:
            raise ValueError(
                "DeepSeekMTP needs num_nextn_predict_layers > 0 in the checkpoint's config"
            )
        start = self.mtp_start_layer_idx
        self.layers = nn.ModuleDict(
            {
                str(i): layer_fn(f"{prefix}.layers.{i}", i)
                for i in range(start, start + self.num_mtp_layers)
            }
        )

    def mtp_layers(self) -> list[DeepSeekMultiTokenPredictorLayer]:
        return [self.layer_for_step(s) for s in range(self.num_mtp_layers)]

    def layer_for_step(self, spec_step_idx: int) -> DeepSeekMultiTokenPredictorLayer:
        layer = self.layers[str(self.mtp_start_layer_idx + spec_step_idx % self.num_mtp_layers)]
        assert isinstance(layer, DeepSeekMultiTokenPredictorLayer)
        return layer

    def compute_logits(
        self, hidden_states: torch.Tensor, rows: RowKinds | None, spec_step_idx: int = 0
    ) -> torch.Tensor:
        head = self.layer_for_step(spec_step_idx).shared_head
        return head.head(head(hidden_states), rows).float()


class DeepSeekMTP(DraftModel):
    """DeepSeek-V2/V3 MTP draft model: each MTP layer has its own embedding and head (loaded
    from the checkpoint; the target's where identical, to keep one copy)."""

    model: DeepSeekMultiTokenPredictor

    def build_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str
    ) -> DeepSeekMultiTokenPredictor:
        return DeepSeekMultiTokenPredictor(self.config, prefix=prefix)

    def shared_modules(self) -> list[SharedModule]:
        """Every MTP layer's embedding and shared_head.head (its own, aliased to the target's
        embedding / LM head where equal)."""
        out = []
        for layer in self.model.mtp_layers():
            out.append(SharedModule("embed_tokens", layer, "embed_tokens", True))
            out.append(SharedModule("lm_head", layer.shared_head, "head", True))
        return out

    def embed_input_ids(self, input_ids: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self.model.layer_for_step(spec_step_idx).embed_tokens(input_ids)

    def step_network(self, spec_step_idx: int) -> DeepSeekMultiTokenPredictorLayer:
        return self.model.layer_for_step(spec_step_idx)

    def compute_logits(
        self, hidden_states: torch.Tensor, rows: RowKinds | None, spec_step_idx: int = 0
    ) -> torch.Tensor:
        return self.model.compute_logits(hidden_states, rows, spec_step_idx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `model.layers.{N+i}.*` from the target checkpoint; everything else is the
        target's. A layer without its own embed_tokens gets the top-level
        `model.embed_tokens.weight` (always from the checkpoint, so it exists on any stage)."""
        config = self.config
        top_embed: list[torch.Tensor] = []

        def rename(name: str) -> str | None:
            if name == "model.embed_tokens.weight":
                return name
            layer = get_spec_layer_idx_from_weight_name(config, name)
            if layer is None or "rotary_emb.inv_freq" in name:
                return None
            prefix = f"model.layers.{layer}."
            rest = name[len(prefix) :]
            if rest.split(".", 1)[0] in _SPEC_LAYER_PARTS:
                return name
            return f"{prefix}mtp_block.{rest}"

        def custom(name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> bool:
            if name == "model.embed_tokens.weight":
                top_embed.append(tensor)
                return True
            return False

        loaded = load_params_strict(self, weights, rename, custom=custom)
        params = dict(self.named_parameters())
        # Layers without a table of their own share one copy of the top-level table.
        top_table: nn.Module | None = None
        for idx, layer in self.model.layers.items():
            assert isinstance(layer, DeepSeekMultiTokenPredictorLayer)
            name = f"model.layers.{idx}.embed_tokens.weight"
            if name in loaded:
                continue
            if not top_embed:
                raise WeightLoadError(
                    f"checkpoint has neither {name!r} nor 'model.embed_tokens.weight' for the "
                    "MTP draft's embedding"
                )
            if tuple(top_embed[0].shape) != tuple(params[name].shape):
                raise WeightLoadError(
                    f"weight 'model.embed_tokens.weight' has shape {tuple(top_embed[0].shape)} "
                    f"but {name!r} expects {tuple(params[name].shape)}"
                )
            if top_table is None:
                with torch.no_grad():
                    params[name].copy_(top_embed[0].to(params[name].dtype))
                top_table = layer.embed_tokens
            else:
                layer.embed_tokens = top_table
            loaded.add(name)
        _dedupe_embeddings(self.model.mtp_layers())
        check_all_loaded(self, loaded)
        return {n for n in loaded if n in params}


def _dedupe_embeddings(layers: list[DeepSeekMultiTokenPredictorLayer]) -> None:
    """Alias MTP layers whose embedding tables are equal to one module: one copy in memory
    (under pipeline parallelism nothing else shares them; see DraftModel.bind_target)."""
    kept: list[nn.Module] = []
    for layer in layers:
        table = layer.embed_tokens
        weight = table.get_parameter("weight")
        same = next(
            (k for k in kept if k is table or torch.equal(k.get_parameter("weight"), weight)), None
        )
        if same is None:
            kept.append(table)
        else:
            layer.embed_tokens = same
