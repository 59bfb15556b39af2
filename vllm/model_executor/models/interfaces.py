# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Model capability interfaces: pipeline parallelism, what a target offers its draft
(TargetShares) and the optional draft capabilities speculators call, EAGLE3 aux hidden states."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from vllm.forward_context import RowKinds
from vllm.model_executor.models.aux_hidden_states import AuxSlotLayout
from vllm.sequence import IntermediateTensors


@runtime_checkable
class SupportsPP(Protocol):
    """A model that can be split into pipeline stages."""

    supports_pp: ClassVar[bool] = True

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors: ...


# What a class inheriting SupportsPP without a factory of its own has (refused by supports_pp).
_STUB_FACTORY = SupportsPP.make_empty_intermediate_tensors


def supports_pp(model: object) -> bool:
    """A class qualifies by its flag, its forward signature and a factory of its own (not the
    Protocol's empty stub, which a class inheriting SupportsPP gets for free); an instance must
    also have a factory that works: it makes IntermediateTensors holding hidden_states."""
    cls: Any = model if isinstance(model, type) else type(model)
    if not getattr(cls, "supports_pp", False):
        return False
    if "intermediate_tensors" not in inspect.signature(cls.forward).parameters:
        return False
    if isinstance(model, type):
        return getattr(cls, "make_empty_intermediate_tensors", None) not in (None, _STUB_FACTORY)
    factory = getattr(model, "make_empty_intermediate_tensors", None)
    if not callable(factory) or getattr(factory, "__func__", None) is _STUB_FACTORY:
        return False
    # On the meta device: shapes only, nothing allocated.
    made = factory(1, torch.float32, torch.device("meta"))
    return isinstance(made, IntermediateTensors) and "hidden_states" in made


def check_supports_pp(model: object) -> None:
    """Refuse a model class (or instance) that cannot run under pipeline parallelism."""
    if not supports_pp(model):
        cls = model if isinstance(model, type) else type(model)
        raise ValueError(
            f"{cls.__name__} does not support pipeline parallelism "
            "(Pipeline parallelism is not supported for this model: it needs supports_pp, "
            "forward(..., intermediate_tensors) and a make_empty_intermediate_tensors factory)"
        )


# ---- speculative decoding (EAGLE / EAGLE3 / MTP drafts and the targets that feed them) --------


@dataclass(frozen=True)
class TargetShares:
    """What a target offers the draft that runs next to it on its (last) pipeline stage, built
    once both are loaded (CausalLMBase.draft_shares) and handed to DraftModel.bind_target.
    A module absent on this stage (a PPMissingLayer) is None."""

    hidden_size: int
    embed_tokens: nn.Module | None = None
    """The input embedding, where a draft that ships none embeds its proposals with."""
    lm_head: nn.Module | None = None
    """The LM head (also what an MTP layer's identical shared_head.head aliases)."""
    topk_indices_buffer: torch.Tensor | None = None
    """DeepSeek-V3.2: the buffer the target's indexers write the selected positions to."""
    aux_hidden_state_layers: tuple[int, ...] = ()
    """The taps the target returns besides its last hidden states (EAGLE3), sorted."""
    has_encoder_outputs: bool = False
    """This stage holds the target's encoder (multimodal) outputs: the encoder runs with the
    embedding, on the first stage, so a draft on the last of several stages has none."""


# ---- optional draft capabilities: the speculators call these, they probe no attribute names --


class SupportsTopkSharing(ABC):
    """A draft (DeepSeek-V3.2 MTP) whose steps 1.. can reuse the sparse-attention top-k indices
    its step 0 selected instead of running their indexers."""

    @property
    @abstractmethod
    def shares_topk_across_steps(self) -> bool:
        """Whether the draft's config asks for the reuse (index_share_for_mtp_iteration)."""

    @abstractmethod
    def set_skip_topk(self, skip: bool) -> None:
        """skip=True: the indexers do not run; attention reads the top-k buffer as it is."""

    @abstractmethod
    def compact_topk_indices(self, rows: torch.Tensor) -> None:
        """Move row rows[i] of the top-k buffer to row i (the rows the next draft step runs on
        continue those rows of the step before)."""


class CombinesHiddenStates(ABC):
    """A draft whose first pass reads a combination (an fc) of the target's aux hidden states
    (EAGLE3, DFlash) rather than its last hidden states."""

    @abstractmethod
    def combine_hidden_states(
        self, hidden_states: torch.Tensor, rows: RowKinds | None
    ) -> torch.Tensor:
        """[T, num_taps * target_hidden] concatenated taps -> [T, hidden]; rows: the kinds of
        the T rows (the target step's layout: ForwardContext.laid_out_as)."""


class HasDraftVocab(ABC):
    """A draft whose LM head covers its own (possibly reduced) vocabulary: draft id i is target
    id draft_to_target[i] (None: the target's vocabulary)."""

    draft_to_target: torch.Tensor | None

    @abstractmethod
    def compute_draft_logits(
        self, hidden_states: torch.Tensor, rows: RowKinds | None
    ) -> torch.Tensor:
        """Logits over the draft vocabulary [T, draft_vocab_size]; rows: the kinds of the T
        rows (ALL_SHORT: the rows being sampled)."""

    @abstractmethod
    def scatter_to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [N, Vd] -> target-vocabulary ones (-inf outside)."""


class EagleModelMixin:
    """Aux hidden-state taps of a decoder (the inner `.model` of a target): which layers it
    taps, and the slots of this pipeline stage (aux_hidden_states.AuxSlotLayout)."""

    supports_aux_hidden_states_over_pp: bool = False
    aux_layout: AuxSlotLayout = AuxSlotLayout()
    start_layer: int = 0

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self.aux_layout.taps

    def _set_aux_hidden_state_layers(self, layers: Iterable[int]) -> None:
        self.aux_layout = AuxSlotLayout.for_stage(layers, int(self.start_layer))


class SupportsEagle3:
    """A target whose decoder (`self.model`, an EagleModelMixin) can return aux hidden states."""

    supports_eagle3: ClassVar[bool] = True
    config: Any
    model: Any

    def set_aux_hidden_state_layers(self, layers: Iterable[int]) -> None:
        inner = self.model
        if not isinstance(inner, EagleModelMixin):
            raise RuntimeError(f"{type(inner).__name__} cannot tap aux hidden states")
        inner._set_aux_hidden_state_layers(layers)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        n = int(self.config.num_hidden_layers)
        return (2, n // 2, n - 3)


def supports_eagle3(model: object) -> bool:
    cls = model if isinstance(model, type) else type(model)
    return bool(getattr(cls, "supports_eagle3", False))
