# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EAGLE3 aux hidden states: which target layers to tap for a draft, and the checks on them."""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from vllm.config import VllmConfig
from vllm.config.draft import get_eagle3_aux_layers_from_config
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import (
    EagleModelMixin,
    SupportsEagle3,
    supports_eagle3,
)

logger = init_logger(__name__)


def set_eagle3_aux_hidden_state_layers(
    target_model: nn.Module, draft_hf_config: Any, method: str = "eagle3"
) -> tuple[int, ...]:
    """Point the target's taps at the layers the draft was trained on; returns them sorted
    (the draft checks, when bound, that its fc reads that many)."""
    if not supports_eagle3(target_model):
        raise RuntimeError(
            f"Model does not support EAGLE3 interface ({type(target_model).__name__})"
        )
    target = cast(SupportsEagle3, target_model)
    ids = get_eagle3_aux_layers_from_config(draft_hf_config)
    if ids is None:
        ids = target.get_eagle3_default_aux_hidden_state_layers()
        logger.warning(
            "the EAGLE3 draft config names no eagle_aux_hidden_state_layer_ids; tapping the "
            "default layers %s (acceptance will be low if the draft was trained on others)",
            ids,
        )
    n = int(target.config.num_hidden_layers)
    bad = [i for i in ids if not 0 <= int(i) <= n]
    if bad:
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {list(ids)} has layer(s) {bad} outside 0..{n} "
            "of the target"
        )
    taps = tuple(sorted({int(i) for i in ids}))
    if get_pp_group().world_size > 1:
        verify_supports_aux_hidden_states_over_pp(target_model, method)
    target.set_aux_hidden_state_layers(taps)
    return taps


def verify_supports_aux_hidden_states_over_pp(model: nn.Module, method: str) -> None:
    """Under pipeline parallelism a target must relay its taps through IntermediateTensors;
    only decoders that opt in (`supports_aux_hidden_states_over_pp`) do."""
    inner = getattr(model, "model", None)
    if not (isinstance(inner, EagleModelMixin) and inner.supports_aux_hidden_states_over_pp):
        raise ValueError(
            f"{type(model).__name__} does not support {method} with pipeline parallelism "
            "(its decoder does not set supports_aux_hidden_states_over_pp)"
        )


def configure_target_aux_taps(model: nn.Module, vllm_config: VllmConfig) -> tuple[int, ...]:
    """Every stage of an EAGLE3 target taps the layers the draft's config names (stages
    without the drafter produce and relay taps too); returns the taps, () when the method
    uses none."""
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        return ()
    if not spec.uses_aux_hidden_states:
        return ()
    cfg = spec.draft_model_config.hf_text_config
    return set_eagle3_aux_hidden_state_layers(model, cfg, method=spec.method)
