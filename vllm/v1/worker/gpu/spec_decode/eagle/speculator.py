# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EagleSpeculator: an EAGLE / EAGLE3 head drafting from the target's hidden states."""

from __future__ import annotations

from torch import nn

from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import AutoRegressiveSpeculator
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
    set_eagle3_aux_hidden_state_layers,
    uses_aux_hidden_states,
)
from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model


class EagleSpeculator(AutoRegressiveSpeculator):
    aux_hidden_state_layers: tuple[int, ...] = ()

    def load_draft_model(
        self, target_model: nn.Module, target_attn_layer_names: set[str]
    ) -> nn.Module:
        draft = load_eagle_model(target_model, self.vllm_config, self.device)
        cfg = self.draft_model_config.hf_text_config
        if uses_aux_hidden_states(self.method, cfg):
            self.aux_hidden_state_layers = set_eagle3_aux_hidden_state_layers(
                target_model, cfg, draft
            )
        return draft

    def _num_aux_hidden_states(self) -> int:
        return len(self.aux_hidden_state_layers)
