# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""ModelConfig: which checkpoint to run, in which dtype, and reading its config.json."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from vllm.config.quantization import QuantizationConfig, resolve_quantization
from vllm.logger import init_logger

logger = init_logger(__name__)


LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES = get_args(LogprobsMode)
LoadFormat = Literal["auto", "safetensors"]
LOAD_FORMATS = get_args(LoadFormat)
_DTYPES = {"auto", "float32", "float", "float16", "half", "bfloat16"}
# Sampling fields a generation_config.json may give defaults for (as vLLM reads them).
_GENERATION_DEFAULTS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
DEFAULT_MODEL_DIR = Path(__file__).parents[1] / "model_zoo" / "tiny-deepseek-mtp"


def default_model_path() -> str:
    """The bundled default model (used when no model is given)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(
            f"no model given and the bundled default model is missing at {DEFAULT_MODEL_DIR}"
        )
    return str(DEFAULT_MODEL_DIR)


def load_hf_config(model: str, trust_remote_code: bool = False) -> Any:
    """Read config.json of a local HF folder into a transformers config object."""
    path = Path(model)
    if not path.exists():
        raise ValueError(f"model path {model!r} does not exist (models load from local folders)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model path {model!r} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"config.json of {model!r} is unreadable: {e}") from e
    from transformers import AutoConfig, PretrainedConfig

    from vllm.transformers_utils.speculators import (
        is_speculators_config,
        load_speculators_hf_config,
    )

    if is_speculators_config(raw):
        return load_speculators_hf_config(model, raw)
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as e:
        # A model_type transformers does not know: keep the raw fields, the registry decides.
        logger.debug("AutoConfig failed for %s (%s); using the raw config", model, e)
        return PretrainedConfig(**raw)


def get_text_config(hf_config: Any) -> Any:
    """The language-model part of a (possibly multimodal) config."""
    getter = getattr(hf_config, "get_text_config", None)
    return getter() if getter is not None else hf_config


@functools.cache
def _warn_fp16_on_cpu() -> None:
    logger.warning("float16 is not supported well on CPU: running the model in bfloat16 instead")


def _config_dtype(hf_config: Any) -> str | None:
    for name in ("dtype", "torch_dtype"):
        v = getattr(hf_config, name, None)
        if v is not None:
            return str(v).replace("torch.", "")
    return None


@dataclass
class ModelConfig:
    """What model to run and in which dtype."""

    model: str = ""
    """Local folder of an HF-format checkpoint."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to the model folder."""
    dtype: str = "auto"
    """auto | float32 | float16 | bfloat16; auto takes the checkpoint's (fp16 -> bf16 on CPU)."""
    seed: int = 0
    """Seed for requests without their own seed."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's max_position_embeddings."""
    trust_remote_code: bool = False
    """Passed to transformers when reading the config/tokenizer."""
    served_model_name: str | list[str] | None = None
    """Name(s) the server answers to and labels metrics with; defaults to the model path."""
    quantization: str | None = None
    """Weight quantization (vLLM's --quantization): None takes the checkpoint's
    quantization_config; 'fp8' = block-quantized e4m3 weights as DeepSeek / Qwen publish them."""
    max_logprobs: int = 20
    """Most logprobs a request may ask for per position (logprobs / prompt_logprobs); -1:
    no limit (the whole vocabulary)."""
    generation_config: str = "auto"
    """Where sampling defaults come from: 'auto' reads the model folder's
    generation_config.json (its EOS ids stop generation; its temperature / top_p / top_k /
    min_p / max_new_tokens are the defaults of requests that leave them unset), 'vllm' uses
    none, any other value is a folder holding a generation_config.json."""
    limit_mm_per_prompt: dict[str, int] | None = None
    """Most multimodal items per prompt, per modality (JSON on the command line), e.g.
    {"image": 2}; default 4 images. Only for multimodal checkpoints."""
    allowed_media_domains: list[str] | None = None
    """Server: hosts whose http(s) image URLs a chat message may name. None (the default):
    remote URLs are refused (400) and only base64 data URLs are accepted; nothing is fetched
    from the network."""
    logprobs_mode: LogprobsMode = "raw_logprobs"
    """What logprobs report (vLLM's --logprobs-mode): 'raw_logprobs' (the default) and
    'raw_logits' come from the model's logits before any processing (grammar, penalties, bias,
    temperature, top-k / top-p); 'processed_logprobs' / 'processed_logits' from the logits the
    sampler draws from (all of those applied)."""
    load_format: LoadFormat = "auto"
    """How weights are read (vLLM's --load-format): 'auto' and 'safetensors' both read the
    checkpoint's safetensors files (the only format this engine loads)."""
    hf_config: Any = field(default=None, repr=False)
    """The checkpoint's config (filled in __post_init__)."""

    def __post_init__(self) -> None:
        if not self.model:
            self.model = default_model_path()
        if self.tokenizer is None:
            self.tokenizer = self.model
        for name, allowed in (("logprobs_mode", LOGPROBS_MODES), ("load_format", LOAD_FORMATS)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}"
                )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.hf_config is None:
            self.hf_config = load_hf_config(self.model, self.trust_remote_code)
        # Parsed here so a checkpoint we cannot run fails at construction, naming the field.
        self.quantization = self._resolve_quantization()[0]
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int):
            raise ValueError(f"max_logprobs must be an integer, got {self.max_logprobs!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs}")
        self._check_mm_limits()
        text = self.hf_text_config
        max_pos = getattr(text, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            self.max_model_len = int(max_pos)
        elif not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(
                f"max_model_len must be a positive integer, got {self.max_model_len!r}"
            )
        elif self.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={max_pos}"
            )

    def try_get_generation_config(self) -> dict[str, Any]:
        """The generation_config.json fields ({} with generation_config='vllm' or no file)."""
        if self.generation_config == "vllm":
            return {}
        folder = Path(self.model if self.generation_config == "auto" else self.generation_config)
        path = folder / "generation_config.json"
        if not path.is_file():
            if self.generation_config != "auto":
                raise ValueError(
                    f"generation_config {self.generation_config!r} has no generation_config.json"
                )
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is unreadable: {e}") from e
        return data if isinstance(data, dict) else {}

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling defaults generation_config.json sets (vLLM's names: max_new_tokens
        becomes max_tokens); requests that leave a field unset take these."""
        config = self.try_get_generation_config()
        out = {k: config[k] for k in _GENERATION_DEFAULTS if config.get(k) is not None}
        if config.get("max_new_tokens") is not None:
            out["max_tokens"] = config["max_new_tokens"]
        return out

    @property
    def served_model_names(self) -> list[str]:
        """served_model_name as a list (the first is the reported one), else [model]."""
        names = self.served_model_name
        if isinstance(names, str):
            names = [names]
        return list(names) if names else [self.model]

    @property
    def hf_text_config(self) -> Any:
        return get_text_config(self.hf_config)

    @property
    def is_multimodal(self) -> bool:
        """The checkpoint carries a vision tower (config.json's vision_config)."""
        return getattr(self.hf_config, "vision_config", None) is not None

    def image_limit(self) -> int:
        """Most images one prompt may carry."""
        return int((self.limit_mm_per_prompt or {}).get("image", 4))

    def _check_mm_limits(self) -> None:
        limits = self.limit_mm_per_prompt
        if limits is None:
            return
        if not isinstance(limits, dict):
            raise ValueError(f"limit_mm_per_prompt must be a dict, got {limits!r}")
        for k, v in limits.items():
            if k != "image":
                raise ValueError(f"limit_mm_per_prompt: unsupported modality {k!r} (only 'image')")
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"limit_mm_per_prompt.{k} must be an integer >= 0, got {v!r}")

    def _resolve_quantization(self) -> tuple[str | None, QuantizationConfig | None]:
        return resolve_quantization(self.quantization, self.hf_config, self.model)

    def get_quant_config(self) -> QuantizationConfig | None:
        """The parsed QuantizationConfig the model is built with, or None (unquantized)."""
        return self._resolve_quantization()[1]

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"config.json of {self.model!r} names no architectures")
        return archs[0]

    def torch_dtype(self, device_type: str):
        import torch

        name = self.dtype
        if name == "auto":
            name = _config_dtype(self.hf_config) or "float32"
        if name in ("float16", "half") and device_type == "cpu":
            # As vLLM's CPU platform: fp16 has no fast GEMM / attention path on CPUs (a fp16
            # step runs several times slower than bf16), so it runs as bf16.
            if self.dtype != "auto":
                _warn_fp16_on_cpu()
            name = "bfloat16"
        return {
            "float32": torch.float32,
            "float": torch.float32,
            "float16": torch.float16,
            "half": torch.float16,
            "bfloat16": torch.bfloat16,
        }[name]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_text_config.vocab_size)

    @property
    def is_hybrid(self) -> bool:
        """Whether the model mixes attention with linear-attention (per-request state) layers:
        its config's layer_types name some (read here, so the config imports no model)."""
        layer_types = getattr(self.hf_text_config, "layer_types", None) or ()
        return "linear_attention" in layer_types

    @property
    def num_hidden_layers(self) -> int:
        return int(self.hf_text_config.num_hidden_layers)
