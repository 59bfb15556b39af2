# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Weight quantization as configured: the checkpoint's `quantization_config` parsed and checked
against the user's `quantization` (ValueError naming the field). Plain data; which layer method
computes with it is model_executor's business (layers/quantization)."""

from __future__ import annotations

from typing import Any


class QuantizationConfig:
    """One quantization method's settings, parsed from config.json (plain data: the layers' methods
    for it are chosen in model_executor/layers/quantization)."""

    name: str = ""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        raise NotImplementedError


def _parse_block(value: Any) -> tuple[int, int]:
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    )
    if not ok:
        raise ValueError(
            "quantization_config.weight_block_size must be two positive integers [bn, bk] "
            f"(per-block FP8 scales), got {value!r}"
        )
    return int(value[0]), int(value[1])


class Fp8Config(QuantizationConfig):
    """Block FP8 (`quant_method: fp8`) as parsed from config.json."""

    name = "fp8"

    def __init__(
        self,
        weight_block_size: tuple[int, int],
        activation_scheme: str = "dynamic",
        modules_to_not_convert: list[str] | None = None,
    ) -> None:
        self.weight_block_size = weight_block_size
        self.activation_scheme = activation_scheme
        # Informational: layers load as the checkpoint stores them (a linear whose weight comes
        # unquantized stays unquantized), so the list only has to be well-formed.
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        method = str(config.get("quant_method", "")).lower()
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method must be 'fp8', got {method!r}")
        fmt = config.get("fmt", "e4m3")  # HF's FineGrainedFP8Config does not write it
        if fmt != "e4m3":
            raise ValueError(
                f"quantization_config.fmt {fmt!r} is not supported; supported: ['e4m3'] "
                "(float8_e4m3fn weights)"
            )
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(
                f"quantization_config.activation_scheme {scheme!r} is not supported; "
                "supported: ['dynamic'] (static activation scales are not implemented)"
            )
        scale_fmt = config.get("scale_fmt")
        if scale_fmt not in (None, "float", "ue8m0"):
            raise ValueError(
                f"quantization_config.scale_fmt {scale_fmt!r} is not supported; "
                "supported: ['float', 'ue8m0']"
            )
        skip = config.get("modules_to_not_convert", config.get("ignored_layers"))
        if skip is not None and not (
            isinstance(skip, list) and all(isinstance(s, str) for s in skip)
        ):
            raise ValueError(
                f"quantization_config.modules_to_not_convert must be a list of names, got {skip!r}"
            )
        return cls(_parse_block(config.get("weight_block_size")), scheme, skip)


_CONFIGS: dict[str, type[QuantizationConfig]] = {"fp8": Fp8Config}
QUANTIZATION_METHODS = ("fp8",)


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The `quantization_config` dict of config.json (top level, or the text config of a
    multimodal checkpoint), or None for an unquantized checkpoint."""
    for cfg in (hf_config, getattr(hf_config, "get_text_config", lambda: None)()):
        qc = getattr(cfg, "quantization_config", None) if cfg is not None else None
        if qc is None:
            continue
        if hasattr(qc, "to_dict"):
            qc = qc.to_dict()
        if not isinstance(qc, dict):
            raise ValueError(
                f"config.json quantization_config must be an object, got {type(qc).__name__}"
            )
        return qc
    return None


def resolve_quantization(
    requested: str | None, hf_config: Any, model: str
) -> tuple[str | None, QuantizationConfig | None]:
    """(method name, parsed config) for a checkpoint; requested is the user's `quantization`
    (None: take the checkpoint's). Raises ValueError naming the field for anything we cannot
    run: an unknown method, a mismatch with the checkpoint, or bad quantization_config fields."""
    if requested is not None and (
        not isinstance(requested, str) or requested not in QUANTIZATION_METHODS
    ):
        raise ValueError(
            f"quantization {requested!r} is not supported; supported: {list(QUANTIZATION_METHODS)}"
        )
    qc = checkpoint_quantization_config(hf_config)
    if qc is None:
        if requested is not None:
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint quantized ahead of time, but "
                f"config.json of {model!r} has no quantization_config (quantizing unquantized "
                "weights at load is not supported)"
            )
        return None, None
    method = qc.get("quant_method")
    if not isinstance(method, str) or method.lower() not in QUANTIZATION_METHODS:
        raise ValueError(
            f"config.json of {model!r}: quantization_config.quant_method {method!r} is not "
            f"supported; supported: {list(QUANTIZATION_METHODS)}"
        )
    method = method.lower()
    if requested is not None and requested != method:
        raise ValueError(
            f"quantization={requested!r} does not match the checkpoint's quantization_config."
            f"quant_method {method!r} ({model!r})"
        )
    return method, _CONFIGS[method].from_config(qc)
