# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The one base of speculative-decoding drafts (MTP heads, EAGLE / EAGLE3, DFlash / DSpark) and
its contract with the target: a draft is built and loaded on its own, then bound to its target
once (bind_target), taking what it declares it shares (shared_modules; the V3.2 top-k buffer,
the aux taps, the encoder outputs in subclasses) from the target's TargetShares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.forward_context import ForwardContext, RowKinds
from vllm.model_executor.layers.linear import RoutedLinear
from vllm.model_executor.models.base import INTERMEDIATE_KEYS, ModelBase
from vllm.model_executor.models.interfaces import HasDraftVocab, SupportsPP, TargetShares
from vllm.model_executor.models.utils import (
    WeightLoadError,
    check_all_loaded,
    make_empty_intermediate_tensors_factory,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

# (hidden states the logits are computed from, hidden states fed back to the next draft step)
DraftOutput = tuple[torch.Tensor, torch.Tensor]
# What a draft network returns: a DraftOutput, or one tensor that is both.
DraftStepOutput = DraftOutput | torch.Tensor


@dataclass(frozen=True)
class SharedModule:
    """A module of the draft that the target's module of the same kind may stand in for."""

    kind: Literal["embed_tokens", "lm_head"]
    """Which of TargetShares' modules fits here."""
    owner: nn.Module
    name: str
    """The attribute of owner holding it."""
    own: bool
    """The draft's checkpoint shipped it: kept, unless equal to the target's (then one copy
    is kept in memory); else the target's is required."""


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    w = getattr(module, "weight", None)
    return w if isinstance(w, torch.Tensor) else None


def _logical_shape(module: nn.Module | None, w: torch.Tensor) -> tuple[int, ...]:
    """A weight's shape as the whole model sees it: a vocab-parallel embedding / LM head
    holds its rank's rows of org_vocab_size."""
    vocab = getattr(module, "org_vocab_size", None)
    return (int(vocab), *w.shape[1:]) if isinstance(vocab, int) else tuple(w.shape)


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    wa, wb = _weight(a), _weight(b)
    if wa is None or wb is None or wa.shape != wb.shape:
        return False
    if wa.device != wb.device:  # compare on the CPU rather than copy across devices
        return torch.equal(wa.cpu(), wb.cpu())
    return torch.equal(wa, wb)


class DraftModel(ModelBase, SupportsPP):
    """A draft the speculator runs on the last pipeline stage. It never runs split over stages,
    but implements SupportsPP so a pipeline-parallel engine can build it there; its
    intermediate tensors are shaped like the hidden states it consumes.

    Subclasses build `model` (the draft network) and what sits next to it (the LM head) in
    build_model. The forward of every draft embeds its input ids (embed_input_ids, per draft
    step), runs the step's network (step_network: `model` unless the steps differ) on
    (positions, inputs_embeds, hidden_states, ctx) - ctx the draft forward's ForwardContext,
    forward's required keyword argument - and returns (hidden for the logits, hidden fed
    back to the next draft step); a network returning one tensor gives both."""

    supports_pp: ClassVar[bool] = True
    # Whether the draft's first pass can take the target's encoder (multimodal) embeddings.
    supports_mm_inputs: ClassVar[bool] = False
    # Whether an fp32 draft on CPU may keep a bf16 checkpoint's linear weights in bf16
    # (layers/exact_bf16.py: exact; set where no code takes a weight's dtype for the
    # compute dtype).
    keeps_exact_bf16_weights: ClassVar[bool] = False

    model: nn.Module
    lm_head: nn.Module
    # Set by load_weights where the checkpoint may omit them (EAGLE-family heads).
    has_own_embed_tokens: bool = True
    has_own_lm_head: bool = True

    def __init__(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> None:
        super().__init__(vllm_config, model_config, prefix)
        # What bind_target decided (set once, after both models are loaded).
        self.bound_shares: TargetShares | None = None
        self.gather_mm_embeds = False
        self.model = self.build_model(vllm_config, model_config, maybe_prefix(prefix, "model"))

    def build_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str
    ) -> nn.Module:
        """The draft network (from self.config, its parameters named under prefix); also
        builds what the draft holds next to it (lm_head, ...)."""
        raise NotImplementedError

    # ---- the binding ----------------------------------------------------------------------
    def shared_modules(self) -> list[SharedModule]:
        """The draft's modules its target's may stand in for (default: `model.embed_tokens`
        and `lm_head`)."""
        return [
            SharedModule("embed_tokens", self.model, "embed_tokens", self.has_own_embed_tokens),
            SharedModule("lm_head", self, "lm_head", self.has_own_lm_head),
        ]

    def bind_target(self, shares: TargetShares) -> None:
        """Take from the target what the draft shares with it; once, after both are loaded.

        A shared module the draft lacks becomes the target's (RuntimeError when the target
        has none on this stage); one it ships is kept unless it equals the target's. The first
        pass gathers the target's encoder outputs only where the draft takes them and this
        stage holds them. Subclasses bind more (the top-k buffer, the taps) after this."""
        if self.bound_shares is not None:
            raise RuntimeError(f"{type(self).__name__} is already bound to its target")
        for slot in self.shared_modules():
            offered = shares.embed_tokens if slot.kind == "embed_tokens" else shares.lm_head
            if offered is None:
                if not slot.own:
                    raise RuntimeError(_nothing_to_share(self, slot.kind))
                continue
            current = getattr(slot.owner, slot.name)
            if slot.own and not _same_weights(current, offered):
                continue
            dw, tw = _weight(current), _weight(offered)
            if not slot.own and dw is not None and tw is not None:
                want, have = _logical_shape(current, dw), _logical_shape(offered, tw)
                if want != have:
                    raise RuntimeError(
                        f"the draft ships no {slot.kind} and cannot share the target's: the "
                        f"draft expects {want}, the target has {have}"
                    )
            setattr(slot.owner, slot.name, offered)
        self.gather_mm_embeds = self.supports_mm_inputs and shares.has_encoder_outputs
        self.bound_shares = shares

    # ---- running ----------------------------------------------------------------------------
    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        make = make_empty_intermediate_tensors_factory(
            INTERMEDIATE_KEYS, int(self.config.hidden_size)
        )
        return make(batch_size, dtype, device)

    def embed_input_ids(self, input_ids: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self.model.get_submodule("embed_tokens")(input_ids)

    def step_network(self, spec_step_idx: int) -> Callable[..., DraftStepOutput]:
        """What runs draft step spec_step_idx: (positions, inputs_embeds, hidden_states, ctx)
        -> its output (MTP: the step's layer)."""
        return self.model

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
        *,
        ctx: ForwardContext,
    ) -> DraftOutput:
        if inputs_embeds is None:
            assert input_ids is not None, "the draft embeds input_ids"
            inputs_embeds = self.embed_input_ids(input_ids, spec_step_idx)
        out = self.step_network(spec_step_idx)(positions, inputs_embeds, hidden_states, ctx)
        return out if isinstance(out, tuple) else (out, out)

    def compute_logits(
        self, hidden_states: torch.Tensor, rows: RowKinds | None, spec_step_idx: int = 0
    ) -> torch.Tensor:
        """Logits over the target's vocabulary; rows: the kinds of hidden_states' rows
        (ALL_SHORT: the rows being sampled)."""
        return self.lm_head(hidden_states, rows).float()


def _nothing_to_share(draft: nn.Module, kind: str) -> str:
    what = type(draft).__name__
    if kind == "embed_tokens":
        return (
            f"the draft {what} ships no embed_tokens and the target has none on this pipeline "
            "stage: nothing to embed its proposals with; the target must keep embed_tokens on "
            "the last stage"
        )
    return f"the draft {what} ships no {kind} and the target has none on this pipeline stage"


def check_combined_taps(draft: nn.Module, fc: nn.Linear | None, shares: TargetShares) -> None:
    """The draft's fc reads the concatenation of the target's taps: their number must fit."""
    if fc is None:
        return
    taps = shares.aux_hidden_state_layers
    need = len(taps) * shares.hidden_size
    if fc.in_features != need:
        raise ValueError(
            f"the target taps layers {list(taps)} ({need} features) but the fc of the draft "
            f"{type(draft).__name__} expects {fc.in_features} (eagle_aux_hidden_state_layer_ids "
            "of its config)"
        )


class DraftVocabModel(DraftModel, HasDraftVocab):
    """A draft head with its own (possibly reduced) vocabulary: logits over draft_vocab_size
    ids, mapped to target ids by `d2t` (target id of draft id i is i + d2t[i]), and an
    embedding / LM head either shipped by the checkpoint or shared from the target."""

    vocab_size: int
    draft_vocab_size: int
    lm_head: nn.Linear
    d2t: nn.Parameter | None
    draft_to_target: torch.Tensor | None

    def init_draft_vocab(self, config: Any) -> None:
        """The draft vocabulary, LM head and d2t map of a head built from HF `config`."""
        hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or self.vocab_size)
        self.lm_head = RoutedLinear(hidden_size, self.draft_vocab_size, bias=False)
        if self.draft_vocab_size != self.vocab_size:
            self.d2t = nn.Parameter(
                torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False
            )
        else:
            self.d2t = None
        # draft id -> target id, derived from d2t once it is loaded.
        self.register_buffer("draft_to_target", None, persistent=False)

    def compute_draft_logits(
        self, hidden_states: torch.Tensor, rows: RowKinds | None
    ) -> torch.Tensor:
        return self.lm_head(hidden_states, rows).float()

    def scatter_to_target(self, logits: torch.Tensor) -> torch.Tensor:
        if self.draft_to_target is None:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        out[:, self.draft_to_target] = logits
        return out

    def compute_logits(
        self, hidden_states: torch.Tensor, rows: RowKinds | None, spec_step_idx: int = 0
    ) -> torch.Tensor:
        """Logits over the TARGET vocabulary (tokens outside the draft vocab get -inf)."""
        return self.scatter_to_target(self.compute_draft_logits(hidden_states, rows))

    def finish_draft_vocab_loading(self, loaded: set[str]) -> set[str]:
        """After the weights named `loaded` were loaded: whether the draft ships its own
        embedding / LM head (else the target's are shared), that nothing else is missing, and
        the draft -> target id map of a reduced vocabulary (target id = i + d2t[i])."""
        what = type(self).__name__
        if self.d2t is not None and "d2t" not in loaded:
            raise WeightLoadError(
                f"{what} has draft_vocab_size={self.draft_vocab_size} < "
                f"vocab_size={self.vocab_size} but its checkpoint has no 'd2t' map"
            )
        self.has_own_embed_tokens = "model.embed_tokens.weight" in loaded
        self.has_own_lm_head = "lm_head.weight" in loaded
        if not self.has_own_lm_head and self.d2t is not None:
            raise WeightLoadError(f"{what} with a reduced vocabulary must ship lm_head.weight")
        # Missing embedding / head are the target's (bind_target).
        check_all_loaded(self, loaded, shared={"model.embed_tokens.weight", "lm_head.weight"})
        if self.d2t is not None:
            ids = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                raise WeightLoadError(f"{what} d2t maps draft ids outside the target vocabulary")
            self.draft_to_target = ids
        return loaded
