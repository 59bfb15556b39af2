# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Base classes of the models: a decoder's pipeline-stage skeleton (the inner `.model`) and the
causal LM around it (LM head, tying, logits, strict weight loading, what it offers a draft).
The drafts' base is in draft.py."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.forward_context import ForwardContext, RowKinds
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsPP, TargetShares
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    check_all_loaded,
    load_params_strict,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

# Last stage: the normed hidden states, or (hidden, aux hidden states in tap order) when EAGLE3
# taps are set; every other stage: what it sends on.
DecoderOutput = torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]

INTERMEDIATE_KEYS = ("hidden_states", "residual")


def tie_word_embeddings(model_config: ModelConfig) -> bool:
    """Whether lm_head shares embed_tokens' weight. Multimodal checkpoints keep the flag at the
    top level, text-only ones in the text config (for them the two are one object)."""
    top = getattr(model_config.hf_config, "tie_word_embeddings", None)
    if top is not None:
        return bool(top)
    return bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))


def build_lm_head(config: Any, tie_to: nn.Module | None = None) -> nn.Linear:
    """The vocabulary projection (an nn.Linear: never quantized; split over the vocabulary
    with TP, its logits gathered), sharing tie_to's weight when given (tied word
    embeddings: the same rows of the vocabulary on each rank)."""
    head = ParallelLMHead(config.hidden_size, config.vocab_size, bias=False)
    if tie_to is not None:
        head.weight = tie_to.get_parameter("weight")
    return head


class DecoderLayerBase(nn.Module):
    """A pre-norm decoder block on the fused residual stream: input_layernorm, the token mixer
    (attention), post_attention_layernorm, the MLP. forward(positions, hidden_states, residual,
    ctx) returns (mlp output, residual); their sum is the stream after the block. ctx (the
    forward's ForwardContext) goes to the mixer and the MLP. Subclasses build the norms and the
    MLP, and self_attn or their own mix()."""

    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module
    self_attn: nn.Module

    def mix(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The block's token mixer over the normed stream (default: self_attn)."""
        return self.self_attn(positions, hidden_states, ctx)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.mix(positions, hidden_states, ctx)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states, ctx), residual


class DecoderModelBase(nn.Module, EagleModelMixin):
    """One pipeline stage of a pre-norm decoder with a fused residual stream.

    embed_tokens on the first stage (and on the last when the LM head is tied to it, or when a
    draft there shares it: keep_embed), this stage's layers (PPMissingLayer in the slots other
    stages own, global indices kept), the final norm on the last stage. forward embeds (first
    stage) or takes the hidden_states / residual the previous stage sent, runs this stage's
    layers, and returns IntermediateTensors or, on the last stage, the normed hidden states.
    EAGLE3 taps (EagleModelMixin) ride along, placed by the stage's AuxSlotLayout: local taps
    in numbered slots of what a stage sends, upstream slots relayed by a middle stage,
    collected by the last one, and reserved in every receiving stage's buffer.

    Subclasses build one layer in make_layer; a layer is called as
    layer(positions, hidden_states, residual, ctx) -> (hidden_states, residual), ctx being the
    forward's ForwardContext (forward's required keyword argument).
    """

    norm_cls: ClassVar[type[RMSNorm]] = RMSNorm

    config: Any
    embed_tokens: nn.Embedding | PPMissingLayer
    layers: nn.ModuleList
    norm: RMSNorm | PPMissingLayer
    start_layer: int
    end_layer: int

    def __init__(
        self,
        config: Any,
        prefix: str = "model",
        *,
        tied: bool | None = None,
        keep_embed: bool = False,
    ) -> None:
        """tied: lm_head shares embed_tokens (None: the config's tie_word_embeddings);
        keep_embed: build embed_tokens on the last stage for a draft that shares it (see
        VllmConfig.target_embed_on_last_stage)."""
        super().__init__()
        self.validate_config(config)
        self.config = config
        if tied is None:
            tied = bool(getattr(config, "tie_word_embeddings", False))
        pp = get_pp_group()
        if pp.is_first_rank or ((tied or keep_embed) and pp.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            int(config.num_hidden_layers),
            lambda p: self.make_layer(int(p.rsplit(".", 1)[1]), p),
            prefix=f"{prefix}.layers",
        )
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.norm = self.norm_cls(config.hidden_size, eps) if pp.is_last_rank else PPMissingLayer()

    def validate_config(self, config: Any) -> None:
        """Raise ValueError naming what this decoder cannot run (before any layer is built)."""

    def make_layer(self, layer_idx: int, prefix: str) -> nn.Module:
        """Decoder layer layer_idx (global index) named prefix."""
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """Zeros shaped like what the previous stage sends: hidden_states, residual and the
        EAGLE3 aux slots produced upstream."""
        keys = INTERMEDIATE_KEYS + self.aux_layout.upstream_keys()
        make = make_empty_intermediate_tensors_factory(keys, int(self.config.hidden_size))
        return make(batch_size, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *,
        ctx: ForwardContext,
    ) -> DecoderOutput:
        aux: list[torch.Tensor] = []
        layout = self.aux_layout
        remote = layout.collect(intermediate_tensors)
        residual: torch.Tensor | None
        if intermediate_tensors is None:
            if inputs_embeds is None:
                assert input_ids is not None, "the first stage embeds input_ids"
                inputs_embeds = self.embed_input_ids(input_ids)
            hidden, residual = inputs_embeds, None
            layout.tap(aux, self.start_layer, hidden, residual)
        else:
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for idx in range(self.start_layer, self.end_layer):
            hidden, residual = self.layers[idx](positions, hidden, residual, ctx)
            layout.tap(aux, idx + 1, hidden, residual)
        if not get_pp_group().is_last_rank:
            assert residual is not None, "a stage with no layers cannot send a residual"
            return IntermediateTensors(
                {
                    "hidden_states": hidden,
                    "residual": residual,
                    **layout.relay(intermediate_tensors),
                    **layout.pack(aux),
                }
            )
        hidden, _ = self.norm(hidden, residual)
        if remote or aux:
            return hidden, remote + aux
        return hidden


def _present(module: nn.Module) -> nn.Module | None:
    """The module, or None where another pipeline stage holds it."""
    return None if isinstance(module, PPMissingLayer) else module


class ModelBase(nn.Module):
    """What the loader builds: from the engine config and this model's own config (a draft's
    differs from its target's), with the name prefix of its parameters."""

    config: Any

    def __init__(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> None:
        super().__init__()
        self.config = model_config.hf_text_config


class CausalLMBase(ModelBase, SupportsPP):
    """A decoder (`self.model`, a DecoderModelBase built from model_cls) plus the LM head: an
    nn.Linear on the last stage (sharing embed_tokens' weight when tied), PPMissingLayer
    elsewhere; supports pipeline parallelism.

    Weight loading is strict (load_params_strict: every parameter of this stage exactly once,
    expert stacks and quantized layers included); a checkpoint name is first checked by
    skip_weight (weights another model loads, or that this one derives), then renamed by
    hf_to_vllm_prefix. Subclasses with more to skip override skip_weight.
    """

    supports_pp: ClassVar[bool] = True
    # Its layers are split over tensor-parallel ranks (heads, columns); others refuse TP > 1.
    supports_tp: ClassVar[bool] = False
    # Takes multimodal input (its encoder runs on the first stage, with the embedding).
    supports_multimodal: ClassVar[bool] = False
    model_cls: ClassVar[type[DecoderModelBase]]
    # Checkpoint names held by other models (an MTP draft, a vision encoder) or derived.
    skip_prefixes: ClassVar[tuple[str, ...]] = ()
    skip_substrs: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    # Checkpoint prefix -> parameter prefix (e.g. a multimodal checkpoint's language model).
    hf_to_vllm_prefix: ClassVar[dict[str, str]] = {}

    model: DecoderModelBase
    lm_head: nn.Linear | PPMissingLayer
    tied: bool

    def __init__(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> None:
        super().__init__(vllm_config, model_config, prefix)
        self.tied = tie_word_embeddings(model_config)
        self.model = self._init_model(
            vllm_config,
            maybe_prefix(prefix, "model"),
            keep_embed=vllm_config.target_embed_on_last_stage,
        )
        if get_pp_group().is_last_rank:
            self.lm_head = build_lm_head(
                self.config, self.model.embed_tokens if self.tied else None
            )
        else:
            self.lm_head = PPMissingLayer()

    def _init_model(
        self, vllm_config: VllmConfig, prefix: str, keep_embed: bool
    ) -> DecoderModelBase:
        """The inner decoder; subclasses whose decoder needs more of the config override it."""
        return self.model_cls(self.config, prefix, tied=self.tied, keep_embed=keep_embed)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        return self.model.make_empty_intermediate_tensors(batch_size, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *,
        ctx: ForwardContext,
    ) -> DecoderOutput:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds, ctx=ctx)

    def compute_logits(self, hidden_states: torch.Tensor, rows: RowKinds | None) -> torch.Tensor:
        """Logits of hidden_states' rows; rows: their kinds (ALL_SHORT for the rows being
        sampled; None for prefill-kind rows, e.g. prompt logprobs)."""
        return self.lm_head(hidden_states, rows).float()

    def draft_shares(self) -> TargetShares:
        """What a draft running next to this stage of the model may take from it (after the
        aux taps are set: set_aux_hidden_state_layers)."""
        return TargetShares(
            hidden_size=int(self.config.hidden_size),
            embed_tokens=_present(self.model.embed_tokens),
            lm_head=_present(self.lm_head),
            aux_hidden_state_layers=self.model.aux_hidden_state_layers,
            has_encoder_outputs=self.supports_multimodal and get_pp_group().is_first_rank,
        )

    def skip_weight(self, name: str) -> bool:
        """Whether checkpoint weight `name` is not this model's to load: skip_prefixes,
        skip_substrs, and the copy a tied checkpoint may still carry of lm_head."""
        return (
            name.startswith(self.skip_prefixes)
            or any(s in name for s in self.skip_substrs)
            or (self.tied and name == "lm_head.weight")
        )

    def checkpoint_to_param_name(self, name: str) -> str | None:
        """The parameter a checkpoint weight fills, None for one skipped on purpose."""
        if self.skip_weight(name):
            return None
        for old, new in self.hf_to_vllm_prefix.items():
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_params_strict(self, weights, self.checkpoint_to_param_name)
        check_all_loaded(self, loaded, {"lm_head.weight"} if self.tied else ())
        params = dict(self.named_parameters(remove_duplicate=False))
        return {n for n in loaded if n in params}
