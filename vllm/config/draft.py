# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Reading a draft head's HF config without building it: the EAGLE3 taps and head switches, the
DFlash / DSpark block fields, and the check of a DFlash / DSpark draft against its target. The
config validates drafts with these; the draft models build themselves from them."""

from __future__ import annotations

from typing import Any

DFLASH_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def _eagle_config(config: Any) -> dict[str, Any]:
    ec = getattr(config, "eagle_config", None) or {}
    return ec if isinstance(ec, dict) else vars(ec)


def get_eagle3_aux_layers_from_config(config: Any) -> tuple[int, ...] | None:
    """Target layers the draft was trained on (tap L = the stream entering layer L)."""
    ec = _eagle_config(config)
    ids = ec.get("eagle_aux_hidden_state_layer_ids") or getattr(
        config, "eagle_aux_hidden_state_layer_ids", None
    )
    return tuple(int(i) for i in ids) if ids else None


def get_eagle3_use_aux_hidden_state_from_config(config: Any) -> bool:
    return bool(_eagle_config(config).get("use_aux_hidden_state", True))


def eagle3_switch(config: Any, name: str) -> bool:
    """A boolean EAGLE3 head switch, at the top level of the config or inside eagle_config."""
    v = getattr(config, name, None)
    if v is None:
        v = _eagle_config(config).get(name)
    return bool(v)


def dflash_field(config: Any, name: str, default: Any = None) -> Any:
    """A DFlash / DSpark field, at the top level (speculators format) or in dflash_config
    (native DFlash configs)."""
    v = getattr(config, name, None)
    if v is None:
        dc = getattr(config, "dflash_config", None) or {}
        v = (dc if isinstance(dc, dict) else vars(dc)).get(name)
    return default if v is None else v


def sample_from_anchor(config: Any) -> bool:
    return bool(dflash_field(config, "sample_from_anchor", False))


def block_query_len(config: Any, num_speculative_tokens: int) -> int:
    """Positions of the block one propose runs: the anchor plus K masks, or K when the
    anchor slot drafts too."""
    return num_speculative_tokens + (0 if sample_from_anchor(config) else 1)


def verify_dflash_draft(
    config: Any, method: str, num_speculative_tokens: int, target: Any, where: str
) -> None:
    """Refuse a DFlash / DSpark draft config this engine cannot serve as asked, naming the
    field; normalise a native DFlash config's taps (output of layer i = tap i + 1). target: the
    target's ModelConfig (its vocab_size)."""
    where = f"speculative_config.model {where!r}"
    archs = list(getattr(config, "architectures", None) or [])
    want = DFLASH_ARCHITECTURES[method]
    if archs[:1] != [want]:
        raise ValueError(
            f"{where}: method {method!r} needs a {want} draft (speculators_model_type "
            f"{method!r}), its config names architectures {archs}"
        )
    if get_eagle3_aux_layers_from_config(config) is None:
        native = dflash_field(config, "target_layer_ids")
        if not native:
            raise ValueError(
                f"{where}: the draft names no target layers (aux_hidden_state_layer_ids / "
                "dflash_config.target_layer_ids)"
            )
        config.eagle_config = {
            "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in native],
            "use_aux_hidden_state": True,
        }
    mask = dflash_field(config, "mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < int(target.vocab_size):
        raise ValueError(
            f"{where}: mask_token_id must be a token id of the target vocabulary "
            f"(0..{int(target.vocab_size) - 1}), got {mask!r}"
        )
    block = dflash_field(config, "block_size")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{where}: block_size must be an integer >= 1, got {block!r}")
    q = block_query_len(config, num_speculative_tokens)
    if q > block:
        anchor = "true" if sample_from_anchor(config) else "false"
        raise ValueError(
            f"speculative_config.num_speculative_tokens={num_speculative_tokens} does not fit "
            f"{where}'s block_size={block} (sample_from_anchor={anchor}: at most "
            f"{block if sample_from_anchor(config) else block - 1} draft tokens per block)"
        )
    head_type = dflash_field(config, "markov_head_type", "vanilla")
    if method == "dspark" and head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(
            f"{where}: markov_head_type {head_type!r} is not supported; supported: "
            f"{list(MARKOV_HEAD_TYPES)}"
        )
