# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""HybridSpeculator: a draft model (MTP, EAGLE, EAGLE3) and a draft-free proposer (suffix
decoding or prompt lookup) side by side, chosen per request and per step.

Both propose every step: the draft-free proposer first (a few lookups), then the draft model,
whose first pass writes its own KV at every position the target computed - except, for a
one-layer EAGLE head, on the rows of requests the draft-free proposer serves: those are kept
and caught up before the head drafts for them again (FirstPassDeferral). A request takes the
draft-free proposal when that proposer matched at least `hybrid_min_match_length` tokens (a
long match is a strong sign the text repeats: code edits, tool-call JSON, retries), else the
draft model's. The draft model drafts at most `hybrid_model_num_speculative_tokens` tokens; a
draft-free proposal may use the whole `num_speculative_tokens`. Verification is the same for
both, so the output is the target's; the scheduler's adaptive K sees one acceptance history per
request, whichever proposer served it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.config import SPEC_METHODS, VllmConfig
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator, ProposeInputs
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

if TYPE_CHECKING:
    from vllm.model_executor.models.base import CausalLMBase


def _speculator_class(method: str) -> Any:
    module, name = SPEC_METHODS[method].speculator.split(":")
    return getattr(importlib.import_module(module), name)


class HybridSpeculator(BaseSpeculator):
    """The model runner sees one speculator; everything about the draft model (its module, KV
    layers, multimodal gather, warm-up) is the draft model speculator's."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        spec = vllm_config.speculative_config
        if spec is None or spec.hybrid_method is None:
            raise ValueError("a hybrid speculator needs speculative_config.hybrid_method")
        self.drafter = _speculator_class(spec.method)(vllm_config, device)
        # The draft model's own K within the num_speculative_tokens-wide drafts.
        self.drafter.max_draft_steps = spec.hybrid_model_num_speculative_tokens
        self.free = _speculator_class(spec.hybrid_method)(vllm_config, device)
        self.min_match = spec.hybrid_min_match_length
        self.num_speculative_steps = spec.num_speculative_tokens
        # Requests x steps served by each proposer, and the drafts each proposed.
        self.num_steps_by = {"model": 0, spec.hybrid_method: 0}
        self.num_drafts_by = {"model": 0, spec.hybrid_method: 0}
        self.free_name = spec.hybrid_method
        self.last_use_free = np.zeros(0, dtype=bool)  # the last propose()'s rows served free

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class does not define: the draft model's attributes.
        if name in ("drafter", "free"):
            raise AttributeError(name)
        return getattr(self.drafter, name)

    @property
    def model(self):  # type: ignore[override]
        return self.drafter.model

    @property
    def gathers_mm_embeds(self) -> bool:
        return self.drafter.gathers_mm_embeds

    @property
    def num_lookahead_tokens(self) -> int:
        return max(self.drafter.num_lookahead_tokens, self.free.num_lookahead_tokens)

    def load_model(self, target_model: CausalLMBase) -> None:
        self.drafter.load_model(target_model)
        self.free.load_model(target_model)

    def capture(self) -> None:
        self.drafter.capture()
        self.free.capture()

    def end_warm_up(self) -> None:
        self.drafter.end_warm_up()
        self.free.end_warm_up()
        self.num_steps_by = dict.fromkeys(self.num_steps_by, 0)
        self.num_drafts_by = dict.fromkeys(self.num_drafts_by, 0)

    def on_request_removed(self, slot: int, output_token_ids: np.ndarray) -> None:
        self.drafter.on_request_removed(slot, output_token_ids)
        self.free.on_request_removed(slot, output_token_ids)

    def after_requests_removed(self) -> None:
        self.drafter.after_requests_removed()

    def propose(self, inputs: ProposeInputs) -> np.ndarray:
        free = self.free.propose(inputs)
        match = getattr(self.free, "last_match_lengths", np.zeros(len(free), dtype=np.int64))
        use_free = (match >= self.min_match) & (free[:, 0] != PAD_TOKEN_ID) & inputs.has_sample
        self.last_use_free = use_free
        drafts = self.drafter.propose(_model_rows_only(inputs, use_free))
        out = drafts.copy()
        out[use_free] = free[use_free]
        sampled = inputs.has_sample
        n_free = int(use_free.sum())
        self.num_steps_by[self.free_name] += n_free
        self.num_steps_by["model"] += int(sampled.sum()) - n_free
        self.num_drafts_by[self.free_name] += int((free[use_free] != PAD_TOKEN_ID).sum())
        model_rows = sampled & ~use_free
        self.num_drafts_by["model"] += int((drafts[model_rows] != PAD_TOKEN_ID).sum())
        return out

    def row_proposers(self, method: str, num_rows: int) -> list[str]:
        return [self.free_name if f else method for f in self.last_use_free[:num_rows].tolist()]


def _model_rows_only(inputs: ProposeInputs, use_free: np.ndarray) -> ProposeInputs:
    """The draft model's inputs: the rows served by the draft-free proposer verify none of its
    drafts next step (where the scheduler decided per request), so a one-layer EAGLE head keeps
    their rows instead of running its first pass on them (FirstPassDeferral)."""
    if inputs.req_draft_steps is None or not use_free.any():
        return inputs
    ks = np.array(inputs.req_draft_steps, dtype=np.int64)
    ks[use_free] = 0
    return dataclasses.replace(inputs, req_draft_steps=ks)
