# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Loading a draft model next to its target: build it from the draft config, then alias the
target's embedding / LM head where the draft ships none (or an identical copy)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.interfaces import check_supports_pp
from vllm.model_executor.models.registry import resolve_model_cls
from vllm.model_executor.models.utils import PPMissingLayer

logger = init_logger(__name__)


def _real(module: nn.Module | None) -> nn.Module | None:
    """The module, or None when it is absent on this stage; a LoRA-style wrapper is unwrapped."""
    if module is None or isinstance(module, PPMissingLayer):
        return None
    return getattr(module, "base_layer", module)


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    return getattr(module, "weight", None) if module is not None else None


def _should_share(
    draft_model: nn.Module,
    own_flag: str,
    draft_module: nn.Module | None,
    target_module: nn.Module | None,
) -> bool:
    """Share when the target has the module and the draft has no copy of its own, or a copy
    exactly equal to the target's."""
    if target_module is None:
        return False
    if draft_module is None or not getattr(draft_model, own_flag, False):
        return True
    return _same_weights(draft_module, target_module)


def _same_weights(a: nn.Module | None, b: nn.Module | None) -> bool:
    wa, wb = _weight(a), _weight(b)
    if wa is None or wb is None or wa.shape != wb.shape:
        return False
    if wa.device != wb.device:  # compare on the CPU rather than copy across devices
        return torch.equal(wa.cpu(), wb.cpu())
    return torch.equal(wa, wb)


def _check_shape(what: str, draft_module: nn.Module | None, target_module: nn.Module) -> None:
    dw, tw = _weight(draft_module), _weight(target_module)
    if dw is not None and tw is not None and dw.shape != tw.shape:
        raise RuntimeError(
            f"the draft ships no {what} and cannot share the target's: the draft expects "
            f"{tuple(dw.shape)}, the target has {tuple(tw.shape)}"
        )


def get_target_lm_head(
    target_model: nn.Module, target_language_model: nn.Module
) -> nn.Module | None:
    return _real(getattr(target_language_model, "lm_head", None))


def maybe_share_target_embed(
    draft_model: nn.Module, draft_inner: nn.Module, target_inner: nn.Module
) -> None:
    """Alias the target's embedding into an EAGLE-style draft that has none (or a copy).

    MTP-style drafts (no `has_own_embed_tokens` attribute) load their own table from the
    checkpoint under pipeline parallelism. A draft that needs the target's table on a stage
    where the target holds none cannot embed its proposals at all: that is an error.
    """
    target_embed = _real(getattr(target_inner, "embed_tokens", None)) or _real(
        getattr(target_inner, "embedding", None)
    )
    if get_pp_group().world_size > 1 and not hasattr(draft_model, "has_own_embed_tokens"):
        return
    draft_embed = getattr(draft_inner, "embed_tokens", None)
    if target_embed is None:
        if hasattr(draft_inner, "embed_tokens") and not getattr(
            draft_model, "has_own_embed_tokens", False
        ):
            raise RuntimeError(
                f"the draft {type(draft_model).__name__} ships no embed_tokens and the target "
                "has none on this pipeline stage: nothing to embed its proposals with; the "
                "target must keep embed_tokens on the last stage"
            )
        return
    if draft_embed is not None and _should_share(
        draft_model, "has_own_embed_tokens", draft_embed, target_embed
    ):
        if not getattr(draft_model, "has_own_embed_tokens", False):
            _check_shape("embed_tokens", draft_embed, target_embed)
        draft_inner.embed_tokens = target_embed


def _share_mtp_layer_weights(draft_inner: nn.Module, target_embed, target_head) -> None:
    """MTP layers carry their own embedding and shared_head.head (loaded from the checkpoint);
    alias the target's where they are identical, to keep one copy in memory."""
    layers = getattr(draft_inner, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        return
    for layer in layers.values():
        if _same_weights(getattr(layer, "embed_tokens", None), target_embed):
            layer.embed_tokens = target_embed
        shared_head = getattr(layer, "shared_head", None)
        if shared_head is not None and _same_weights(
            getattr(shared_head, "head", None), target_head
        ):
            shared_head.head = target_head


def load_eagle_model(
    target_model: nn.Module, vllm_config: VllmConfig, device: torch.device | str = "cpu"
) -> nn.Module:
    """Build and load the draft of speculative_config, then share the target's embedding and
    LM head where allowed, and its DSA top-k buffer where the draft has one."""
    spec = vllm_config.speculative_config
    assert spec is not None  # only speculators call this
    multi_stage = get_pp_group().world_size > 1
    if multi_stage:
        # The draft lives on the last stage next to its target: it must be buildable there.
        check_supports_pp(resolve_model_cls(spec.draft_model_config.architecture))
    draft = get_model(vllm_config, model_config=spec.draft_model_config, device=device)
    if multi_stage:
        check_supports_pp(draft)
    get_language_model = getattr(target_model, "get_language_model", None)
    target_lm = get_language_model() if get_language_model is not None else target_model
    target_inner = cast(nn.Module, target_lm.model)
    draft_inner = getattr(draft, "model", draft)
    target_embed = _real(getattr(target_inner, "embed_tokens", None))
    target_head = get_target_lm_head(target_model, target_lm)
    maybe_share_target_embed(draft, draft_inner, target_inner)
    draft_head = getattr(draft, "lm_head", None)
    if draft_head is not None:
        # (_should_share is False without a target head.)
        if target_head is not None and _should_share(
            draft, "has_own_lm_head", draft_head, target_head
        ):
            if not getattr(draft, "has_own_lm_head", False):
                _check_shape("lm_head", draft_head, target_head)
            draft.lm_head = target_head
        elif not getattr(draft, "has_own_lm_head", True):
            raise RuntimeError(
                f"the draft {type(draft).__name__} ships no lm_head and the target has none "
                "on this pipeline stage"
            )
    _share_mtp_layer_weights(draft_inner, target_embed, target_head)
    buf = getattr(target_inner, "topk_indices_buffer", None)
    if buf is not None:
        from vllm.model_executor.layers.attention.sparse_mla_attention import (
            share_topk_indices_buffer,
        )

        share_topk_indices_buffer(draft, buf)
    return draft


def should_gather_mm_embeds_for_draft(target_model: nn.Module, has_encoder_outputs: bool) -> bool:
    """Whether the draft's first pass should read the target's encoder (multimodal) embeddings:
    only where this rank holds the encoder outputs (the encoder runs with the embedding, on the
    first stage) and the target takes multimodal input. Otherwise - a text-only target, or the
    last of several stages, where no encoder output exists - the draft embeds its input ids
    itself and never touches a gather."""
    return has_encoder_outputs and bool(getattr(target_model, "supports_multimodal", False))
