# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EagleSpeculator: an EAGLE / EAGLE3 head drafting from the target's hidden states."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn

from vllm.v1.worker.gpu.sample.sampler import SamplingArrays
from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import AutoRegressiveSpeculator
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers
from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

if TYPE_CHECKING:
    from vllm.model_executor.models.llama_eagle3 import LlamaForCausalLMEagle3


class EagleSpeculator(AutoRegressiveSpeculator):
    aux_hidden_state_layers: tuple[int, ...] = ()
    # Greedy drafting with a reduced draft vocabulary: argmax over the draft vocabulary and
    # map the winner through d2t, instead of scattering every row into a -inf target-vocab
    # tensor each step (only a probabilistic draft, keyed by target token id, needs that).
    _draft_vocab_argmax = False

    def load_draft_model(
        self, target_model: nn.Module, target_attn_layer_names: set[str]
    ) -> nn.Module:
        draft = load_eagle_model(target_model, self.vllm_config, self.device)
        cfg = self.draft_model_config.hf_text_config
        if self.speculative_config.uses_aux_hidden_states:
            self.aux_hidden_state_layers = set_eagle3_aux_hidden_state_layers(
                target_model, cfg, draft
            )
        self._draft_vocab_argmax = (
            self.draft_sample_method != "probabilistic"
            and getattr(draft, "draft_to_target", None) is not None
            and hasattr(draft, "compute_draft_logits")
        )
        return draft

    @property
    def _eagle3(self) -> LlamaForCausalLMEagle3:
        # Only read when _draft_vocab_argmax: a draft-vocabulary (EAGLE3-style) head.
        return cast("LlamaForCausalLMEagle3", self.model)

    def _compute_logits(self, hidden: torch.Tensor, draft_step: int) -> torch.Tensor:
        if self._draft_vocab_argmax:
            return self._eagle3.compute_draft_logits(hidden)
        return super()._compute_logits(hidden, draft_step)

    def sample_draft(
        self, logits: torch.Tensor, positions: np.ndarray, sampling: SamplingArrays
    ) -> torch.Tensor:
        if self._draft_vocab_argmax:
            d2t = self._eagle3.draft_to_target
            assert d2t is not None  # _draft_vocab_argmax requires it
            return d2t[logits.argmax(-1)]
        return super().sample_draft(logits, positions, sampling)

    def _num_aux_hidden_states(self) -> int:
        return len(self.aux_hidden_state_layers)
