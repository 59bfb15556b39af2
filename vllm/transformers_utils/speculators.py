# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft checkpoints in the `speculators` library's format (config.json with
`speculators_model_type`): the one place that reads them.

A speculators config nests the draft's decoder config under `transformer_layer_config` and keeps
the algorithm's switches at the top level. `flatten_speculators_config` turns it into the flat
HF-style dict our draft classes read (the decoder fields plus the switches, and `architectures`
naming our class); each algorithm registers its own flattener with `register_speculators_algo`.
Fields a flattener does not know, and switches it does not implement, are refused by name: a
silently ignored switch would only show up as lower acceptance.

EAGLE3 conventions (as speculators trains and vLLM serves them):
- `eagle_aux_hidden_state_layer_ids` L = the target's residual stream entering decoder layer L
  (tap 0 = embedding output, tap num_hidden_layers = the stream before the final norm); for
  L < num_hidden_layers that is HF transformers' `output_hidden_states[L]`.
- `norm_before_residual` defaults to False when absent (speculators' own default).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

SpeculatorsFlattener = Callable[[dict[str, Any], str], dict[str, Any]]

# speculators_model_type -> (engine method, flattener)
_ALGOS: dict[str, tuple[str, SpeculatorsFlattener]] = {}

# Written by speculators / transformers on save, or training-only: carry no inference meaning.
_COMMON_FIELDS = {
    "speculators_model_type",
    "speculators_version",
    "speculators_config",
    "architectures",
    "auto_map",
    "transformer_layer_config",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "model_type",
}


def register_speculators_algo(
    name: str, method: str
) -> Callable[[SpeculatorsFlattener], SpeculatorsFlattener]:
    """Register the flattener of speculators_model_type `name`, served by engine `method`."""

    def deco(fn: SpeculatorsFlattener) -> SpeculatorsFlattener:
        _ALGOS[name] = (method, fn)
        return fn

    return deco


def supported_speculators_types() -> list[str]:
    return sorted(_ALGOS)


def is_speculators_config(raw: dict[str, Any]) -> bool:
    return isinstance(raw, dict) and "speculators_model_type" in raw


def read_speculators_config(model: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The raw config.json of a speculators-format folder, or None for any other folder."""
    path = Path(model) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return raw if is_speculators_config(raw) else None


def _algo(raw: dict[str, Any], where: str) -> tuple[str, SpeculatorsFlattener]:
    kind = raw.get("speculators_model_type")
    if kind not in _ALGOS:
        raise ValueError(
            f"{where}: speculators_model_type {kind!r} is not supported; "
            f"supported: {supported_speculators_types()}"
        )
    return _ALGOS[kind]


def speculators_method(raw: dict[str, Any], where: str = "speculators config") -> str:
    """The speculative_config method that serves this checkpoint (e.g. 'eagle3')."""
    return _algo(raw, where)[0]


def speculators_num_speculative_tokens(raw: dict[str, Any]) -> int | None:
    """speculative_tokens of the first proposal method, the K the head was trained for."""
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or []
    if methods and isinstance(methods[0], dict):
        k = methods[0].get("speculative_tokens")
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    return None


def speculators_verifier(raw: dict[str, Any]) -> dict[str, Any]:
    """The verifier (target) the head was trained against: name_or_path, architectures."""
    v = (raw.get("speculators_config") or {}).get("verifier") or {}
    return v if isinstance(v, dict) else {}


def _check_fields(raw: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(k for k in raw if k not in known and not k.startswith("_"))
    if unknown:
        raise ValueError(
            f"{where}: unknown speculators config field(s) {unknown} for "
            f"speculators_model_type {raw.get('speculators_model_type')!r}; known: {sorted(known)}"
        )


def _check_common(raw: dict[str, Any], where: str) -> dict[str, Any]:
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: transformer_layer_config must be a dict, got {layer!r}")
    spec = raw.get("speculators_config")
    if spec is not None and not isinstance(spec, dict):
        raise ValueError(f"{where}: speculators_config must be a dict, got {spec!r}")
    return dict(layer)


def _bool_field(raw: dict[str, Any], name: str, default: bool, where: str) -> bool:
    v = raw.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{where}: {name} must be true or false, got {v!r}")
    return v


def _check_layer_and_vocab(
    raw: dict[str, Any], layer: dict[str, Any], where: str, what: str
) -> int:
    """Refuse decoder layer kinds and tying our heads do not build; returns draft_vocab_size
    (default: the layer's vocab_size)."""
    kinds = set(layer.get("layer_types") or []) - {"full_attention"}
    if kinds:
        raise ValueError(
            f"{where}: transformer_layer_config.layer_types {sorted(kinds)} are not supported "
            f"for {what} (only full_attention)"
        )
    if raw.get("tie_word_embeddings"):
        raise ValueError(f"{where}: tie_word_embeddings=true is not supported for {what}")
    vocab = layer.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{where}: transformer_layer_config.vocab_size must be set, got {vocab!r}")
    dv = raw.get("draft_vocab_size")
    dv = vocab if dv is None else dv
    if not isinstance(dv, int) or isinstance(dv, bool) or not 1 <= dv <= vocab:
        raise ValueError(f"{where}: draft_vocab_size must be an integer in 1..{vocab}, got {dv!r}")
    return dv


def _check_layer_ids(ids: Any, name: str, where: str) -> None:
    if (
        not isinstance(ids, list)
        or not ids
        or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids)
    ):
        raise ValueError(
            f"{where}: {name} must be a non-empty list of target layer indices, got {ids!r}"
        )


def flatten_speculators_config(raw: dict[str, Any], where: str = "") -> dict[str, Any]:
    """The flat config dict (decoder fields + algorithm switches) of a speculators config."""
    where = where or "speculators config"
    _, fn = _algo(raw, where)
    flat = fn(raw, where)
    flat["speculators_model_type"] = raw["speculators_model_type"]
    k = speculators_num_speculative_tokens(raw)
    if k is not None:
        flat["num_lookahead_tokens"] = k
    flat["speculators_verifier"] = speculators_verifier(raw)
    return flat


def load_speculators_hf_config(model: str | Path, raw: dict[str, Any]) -> Any:
    """A transformers config object of the flattened speculators config."""
    from transformers import AutoConfig

    flat = flatten_speculators_config(raw, where=f"config.json of {str(model)!r}")
    model_type = flat.pop("model_type")
    return AutoConfig.for_model(model_type, **flat)


# ---------------------------------------------------------------------------- EAGLE3

_EAGLE3_FIELDS = _COMMON_FIELDS | {
    "draft_vocab_size",
    "norm_before_residual",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",  # training only
    "tie_word_embeddings",  # always false: lm_head is over the draft vocabulary
}
# Decoder types whose layer our EAGLE3 head implements (Qwen3's q/k norms are not built).
_EAGLE3_LAYER_TYPES = ("llama",)


@register_speculators_algo("eagle3", method="eagle3")
def _flatten_eagle3(raw: dict[str, Any], where: str) -> dict[str, Any]:
    _check_fields(raw, _EAGLE3_FIELDS, where)
    layer = _check_common(raw, where)
    # speculators builds a Qwen3 layer when model_type is absent.
    model_type = layer.get("model_type", "qwen3")
    if model_type not in _EAGLE3_LAYER_TYPES:
        raise ValueError(
            f"{where}: transformer_layer_config.model_type {model_type!r} is not supported for "
            f"eagle3 heads; supported: {list(_EAGLE3_LAYER_TYPES)}"
        )
    dv = _check_layer_and_vocab(raw, layer, where, "eagle3 heads")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        _check_layer_ids(ids, "eagle_aux_hidden_state_layer_ids", where)
    norm_before_fc = _bool_field(raw, "norm_before_fc", False, where)
    fc_norm = _bool_field(raw, "fc_norm", False, where)
    if norm_before_fc and fc_norm:
        raise ValueError(f"{where}: norm_before_fc and fc_norm are mutually exclusive")
    flat = dict(layer)
    flat.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type=model_type,
        draft_vocab_size=dv,
        norm_before_residual=_bool_field(raw, "norm_before_residual", False, where),
        norm_before_fc=norm_before_fc,
        fc_norm=fc_norm,
        norm_output=_bool_field(raw, "norm_output", False, where),
        tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        # The weight names of this layout (layers.N.*, input_norm, fc_norm.N).
        eagle3_layout="speculators",
    )
    if raw.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = raw["target_hidden_size"]
    return flat


# ---------------------------------------------------------------------------- DFlash / DSpark

_DFLASH_FIELDS = _COMMON_FIELDS | {
    "draft_vocab_size",
    "block_size",
    "target_hidden_size",
    "aux_hidden_state_layer_ids",
    "mask_token_id",
    "sliding_window_non_causal",
    "sample_from_anchor",
    "tie_word_embeddings",  # always false: lm_head is over the draft vocabulary
}
_DSPARK_FIELDS = _DFLASH_FIELDS | {
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
}
DSPARK_MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def _int_field(raw: dict[str, Any], name: str, where: str, lo: int, hi: int | None = None) -> int:
    v = raw.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{where}: {name} must be an integer {rng}, got {v!r}")
    return v


def _flatten_dflash_family(raw: dict[str, Any], where: str, dspark: bool) -> dict[str, Any]:
    """DFlash (and DSpark, which adds its Markov and confidence heads): a block of
    block_size draft positions [anchor, mask, mask, ...] drafted in one forward, attending to
    the context the target's aux hidden states give and bidirectionally within the block.

    aux_hidden_state_layer_ids use the EAGLE3 tap convention (tap L = the stream entering
    target layer L), which is how speculators extracts them for training."""
    _check_fields(raw, _DSPARK_FIELDS if dspark else _DFLASH_FIELDS, where)
    layer = _check_common(raw, where)
    dv = _check_layer_and_vocab(raw, layer, where, "DFlash-family heads")
    vocab = int(layer["vocab_size"])
    raw = {k: v for k, v in raw.items() if v is not None}
    block = _int_field(raw, "block_size", where, 1)
    if raw.get("mask_token_id") is None:
        raise ValueError(
            f"{where}: mask_token_id is required (the token the block's draft positions hold)"
        )
    mask = _int_field(raw, "mask_token_id", where, 0, vocab - 1)
    ids = raw.get("aux_hidden_state_layer_ids")
    _check_layer_ids(ids, "aux_hidden_state_layer_ids", where)
    assert ids is not None  # _check_layer_ids raised otherwise
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: aux_hidden_state_layer_ids {ids} has duplicates")
    flat = dict(layer)
    flat.update(
        architectures=["DSparkDraftModel" if dspark else "DFlashDraftModel"],
        model_type=layer.get("model_type", "qwen3"),
        draft_vocab_size=dv,
        block_size=block,
        mask_token_id=mask,
        sample_from_anchor=_bool_field(raw, "sample_from_anchor", dspark, where),
        tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    )
    if raw.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = _int_field(raw, "target_hidden_size", where, 1)
    if dspark:
        rank = _int_field({"markov_rank": 256, **raw}, "markov_rank", where, 0)
        head = raw.get("markov_head_type", "vanilla")
        if head not in DSPARK_MARKOV_HEAD_TYPES:
            raise ValueError(
                f"{where}: markov_head_type {head!r} is not supported; "
                f"supported: {list(DSPARK_MARKOV_HEAD_TYPES)}"
            )
        conf = _bool_field(raw, "enable_confidence_head", True, where)
        with_markov = _bool_field(raw, "confidence_head_with_markov", True, where)
        if conf and with_markov and rank == 0:
            raise ValueError(f"{where}: confidence_head_with_markov=true needs markov_rank > 0")
        flat.update(
            markov_rank=rank,
            markov_head_type=head,
            enable_confidence_head=conf,
            confidence_head_with_markov=with_markov,
        )
    return flat


@register_speculators_algo("dflash", method="dflash")
def _flatten_dflash(raw: dict[str, Any], where: str) -> dict[str, Any]:
    return _flatten_dflash_family(raw, where, dspark=False)


@register_speculators_algo("dspark", method="dspark")
def _flatten_dspark(raw: dict[str, Any], where: str) -> dict[str, Any]:
    return _flatten_dflash_family(raw, where, dspark=True)
