# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The one list of speculative methods (what each needs, which speculator runs it, named by
string so the config imports no worker module) and the draft architectures each target family
ships or accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class SpecMethod:
    """What one speculative method needs and what runs it (the one list of methods)."""

    family: str
    """mtp | eagle | eagle3 | dflash | ngram | suffix: the draft layout the config checks."""
    speculator: str
    """`module:Class` of the speculator that runs it (imported by init_speculator, so the
    config imports no model or worker module)."""
    needs_draft_model: bool
    """speculative_config.model is required (else the draft is in the target checkpoint)."""
    draft_shares_target_embed: bool
    """A draft of this method may ship no input embedding and share the target's, which the
    target then keeps on the last pipeline stage, where the draft runs."""
    aux_hidden_states: str
    """never | config | always: whether the draft reads the target's aux hidden states
    ("config": unless the draft config's eagle_config sets use_aux_hidden_state false)."""
    has_draft_model: bool = True
    """The method runs a draft network (False: drafts come from the request's own tokens)."""


_SPEC = "vllm.v1.worker.gpu.spec_decode"
_MTP = SpecMethod("mtp", f"{_SPEC}.mtp.speculator:MTPSpeculator", False, False, "never")
_EAGLE = f"{_SPEC}.eagle.speculator:EagleSpeculator"
_DFLASH = f"{_SPEC}.dflash.speculator:DFlashSpeculator"
SPEC_METHODS: dict[str, SpecMethod] = {
    "mtp": _MTP,
    "eagle": SpecMethod("eagle", _EAGLE, True, True, "never"),
    "eagle3": SpecMethod("eagle3", _EAGLE, True, True, "config"),
    # Block-parallel drafts: one forward proposes the whole block from the anchor token.
    "dflash": SpecMethod("dflash", _DFLASH, True, True, "always"),
    "dspark": SpecMethod("dflash", _DFLASH, True, True, "always"),
    # Prompt lookup: the continuation of the longest earlier match of the request's last n-gram.
    "ngram": SpecMethod(
        "ngram", f"{_SPEC}.ngram.speculator:NgramSpeculator", False, False, "never", False
    ),
    # Suffix decoding: the longest earlier match in the request's tokens or in earlier
    # requests' outputs, drafted by frequency.
    "suffix": SpecMethod(
        "suffix", f"{_SPEC}.suffix.speculator:SuffixSpeculator", False, False, "never", False
    ),
    # No drafter: structured-output requests draft the tokens their grammar forces.
    "jump_forward": SpecMethod(
        "jump_forward",
        f"{_SPEC}.ngram.speculator:JumpForwardSpeculator",
        False,
        False,
        "never",
        False,
    ),
}
# Target architecture -> the architecture of its in-checkpoint MTP draft.
MTP_DRAFT_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "DeepSeekMTPModel",
    "DeepseekV3ForCausalLM": "DeepSeekMTPModel",
    # model_type deepseek_v32 / glm_moe_dsa: MTP layers with their own DSA indexer.
    "DeepseekV32ForCausalLM": "DeepseekV32MTP",
    "GlmMoeDsaForCausalLM": "DeepseekV32MTP",
    "Qwen3_5ForCausalLM": "Qwen3_5MTP",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5MTP",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeMTP",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeMTP",
}


def num_mtp_layers(hf_text_config: Any) -> int:
    """MTP layers a checkpoint ships (DeepSeek num_nextn_predict_layers, Qwen3.5
    mtp_num_hidden_layers)."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        v = getattr(hf_text_config, key, None)
        if v:
            return int(v)
    return 0


_METHOD_ALIASES = {
    "deepseek_mtp": "mtp",
    "qwen3_5_mtp": "mtp",
    "qwen3_next_mtp": "mtp",
    "mimo_mtp": "mtp",
    "ernie_mtp": "mtp",
    "glm4_moe_mtp": "mtp",
    "[ngram]": "ngram",
}

EAGLE1_DRAFT_ARCHITECTURES = {
    "LlamaForCausalLM": "EagleLlamaForCausalLM",
    "EagleLlamaForCausalLM": "EagleLlamaForCausalLM",
}
EAGLE1_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def verify_mtp_target(draft: Any, target: Any, k: int, is_tree: bool) -> None:
    """Check that the target ships MTP layers of a supported architecture and point the draft
    config at its MTP draft class; warn where drafts outnumber the layers (a chain)."""
    n = num_mtp_layers(target.hf_text_config)
    if n <= 0:
        raise ValueError(
            f"speculative_config.method='mtp' needs a target with MTP layers, but "
            f"{target.model!r} has none (num_nextn_predict_layers is 0 or missing)"
        )
    arch = MTP_DRAFT_ARCHITECTURES.get(target.architecture)
    if arch is None:
        raise ValueError(
            f"speculative_config.method='mtp' is not supported for {target.architecture}"
            f"; supported: {sorted(MTP_DRAFT_ARCHITECTURES)}"
        )
    draft.hf_config.architectures = [arch]
    if k > n and not is_tree:
        logger.warning(
            "num_speculative_tokens=%d exceeds the %d MTP layer(s) of %s: draft step s "
            "reuses layer s mod %d, so acceptance decays at later positions",
            k,
            n,
            target.model,
            n,
        )
