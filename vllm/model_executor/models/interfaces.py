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
    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, num_taps * target_hidden] concatenated taps -> [T, hidden]."""


class HasDraftVocab(ABC):
    """A draft whose LM head covers its own (possibly reduced) vocabulary: draft id i is target
    id draft_to_target[i] (None: the target's vocabulary)."""

    draft_to_target: torch.Tensor | None

    @abstractmethod
    def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [T, draft_vocab_size]."""

    @abstractmethod
    def scatter_to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [N, Vd] -> target-vocabulary ones (-inf outside)."""


AUX_HIDDEN_STATE_KEY = "aux_hidden_states_"


class EagleModelMixin:
    """Aux hidden-state taps of a decoder (the inner `.model` of a target).

    Tap L is the residual stream entering layer L (hidden + residual after layer L - 1; tap 0 is
    the embedding output, tap num_layers the stream before the final norm). Under pipeline
    parallelism each stage packs its local taps into IntermediateTensors slots numbered globally
    in tap order, and the last stage collects the upstream slots before its own.
    """

    aux_hidden_state_layers: tuple[int, ...] = ()
    supports_aux_hidden_states_over_pp: bool = False
    AUX_HIDDEN_STATE_KEY: str = AUX_HIDDEN_STATE_KEY
    _aux_slot_base_cached: int = 0
    _aux_upstream_total_cached: int = 0

    def _set_aux_hidden_state_layers(self, layers: Iterable[int]) -> None:
        self.aux_hidden_state_layers = tuple(sorted({int(x) for x in layers}))
        self._aux_slot_base_cached = 0
        self._aux_upstream_total_cached = 0
        self._cache_aux_pp_layout()

    def _cache_aux_pp_layout(self) -> None:
        """Slot base of this stage = taps produced upstream (a tap equal to this stage's first
        layer is the stream the previous stage sends, so it counts as upstream)."""
        from bisect import bisect_right

        from vllm.distributed.parallel_state import get_pp_group

        pp = get_pp_group()
        if pp.world_size < 2 or pp.is_first_rank:
            return
        base = bisect_right(self.aux_hidden_state_layers, int(getattr(self, "start_layer", 0)))
        self._aux_slot_base_cached = base
        if pp.is_last_rank:
            self._aux_upstream_total_cached = base

    def _maybe_add_hidden_state(
        self,
        aux: list[torch.Tensor],
        layer_idx: int,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> None:
        if layer_idx in self.aux_hidden_state_layers:
            # A fresh tensor: later layers must not be able to change what was tapped.
            aux.append(hidden + residual if residual is not None else hidden.clone())

    def pack_local_aux_hidden_states(self, aux: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        base = self._aux_slot_base_cached
        return {f"{self.AUX_HIDDEN_STATE_KEY}{base + i}": t for i, t in enumerate(aux)}

    def upstream_aux_hidden_state_keys(self) -> tuple[str, ...]:
        """The aux slots this stage receives from the stages before it (a middle stage relays
        them unchanged; its receive buffer must hold them): empty on the first stage."""
        return tuple(f"{self.AUX_HIDDEN_STATE_KEY}{i}" for i in range(self._aux_slot_base_cached))

    def collect_remote_aux_hidden_states(
        self, intermediate_tensors: IntermediateTensors | None
    ) -> list[torch.Tensor]:
        total = self._aux_upstream_total_cached
        if total == 0 or intermediate_tensors is None:
            return []
        out: list[torch.Tensor] = []
        for i in range(total):
            key = f"{self.AUX_HIDDEN_STATE_KEY}{i}"
            if key not in intermediate_tensors:
                raise RuntimeError(
                    f"Missing {key} in the intermediate tensors from the previous stage "
                    f"(expected {total} upstream aux hidden states for taps "
                    f"{self.aux_hidden_state_layers})"
                )
            out.append(intermediate_tensors[key])
        return out


class SupportsEagle3:
    """A target whose decoder (`self.model`, an EagleModelMixin) can return aux hidden states."""

    supports_eagle3: ClassVar[bool] = True
    config: Any
    model: Any

    def set_aux_hidden_state_layers(self, layers: Iterable[int]) -> None:
        lm = getattr(self, "get_language_model", lambda: self)()
        inner = lm.model
        if not isinstance(inner, EagleModelMixin):
            raise RuntimeError(f"{type(inner).__name__} cannot tap aux hidden states")
        inner._set_aux_hidden_state_layers(layers)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        n = int(self.config.num_hidden_layers)
        return (2, n // 2, n - 3)


def supports_eagle3(model: object) -> bool:
    cls = model if isinstance(model, type) else type(model)
    return bool(getattr(cls, "supports_eagle3", False))
