# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""PEFT LoRA checkpoints (adapter_config.json + adapter_model.safetensors): reading, and the
checks that refuse what the engine cannot apply, each naming the problem."""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Projections an adapter may target: attention (q/k/v/o; MLA's q_a / q_b / kv_a) and the
# dense MLP; the engine packs q/k/v into qkv_proj and gate/up into gate_up_proj.
SUPPORTED_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class PEFTConfig:
    r: int
    alpha: float
    rslora: bool = False
    rank_pattern: dict[str, int] | None = None
    alpha_pattern: dict[str, float] | None = None
    max_rank: int = 16

    def check_rank(self, path: str, module: str, r: int) -> None:
        if r > self.max_rank:
            where = f" ({module})" if module else ""
            raise ValueError(
                f"LoRA adapter {path!r} has rank {r}{where}, above max_lora_rank={self.max_rank}"
            )

    @staticmethod
    def _pick(pattern: dict | None, module: str, default):
        for key, value in (pattern or {}).items():  # PEFT's rule: a suffix match of the key
            if re.match(rf"(.*\.)?{key}$", module):
                return value
        return default

    def rank(self, module: str, path: str = "") -> int:
        r = int(self._pick(self.rank_pattern, module, self.r))
        self.check_rank(path, module, r)
        return r

    def scaling(self, module: str) -> float:
        """lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), per module."""
        r, alpha = self.rank(module), float(self._pick(self.alpha_pattern, module, self.alpha))
        return alpha / math.sqrt(r) if self.rslora else alpha / r


@dataclass
class PEFTAdapter:
    config: PEFTConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """HF module path (e.g. model.layers.0.self_attn.q_proj) -> (A [r, in], B [out, r])."""


def read_peft_config(path: str, max_lora_rank: int) -> PEFTConfig:
    folder = Path(path)
    cfg_file = folder / "adapter_config.json"
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter path {path!r} is not a folder")
    if not cfg_file.is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise ValueError(
            f"{path!r} is not a PEFT LoRA adapter: it needs adapter_config.json and "
            "adapter_model.safetensors"
        )
    try:
        cfg: dict[str, Any] = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_file}: not a readable JSON adapter config ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    refused = {
        "modules_to_save": "replaces whole modules (e.g. a trained lm_head)",
        "use_dora": "DoRA",
        "target_parameters": "LoRA on parameters, e.g. fused MoE experts",
        "lora_bias": "trained LoRA biases",
        "fan_in_fan_out": "Conv1D layers",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key}={cfg[key]!r} ({what}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={cfg['bias']!r} is not supported")
    for r in [cfg.get("r"), *(cfg.get("rank_pattern") or {}).values()]:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"LoRA adapter {path!r}: r must be a positive integer, got {r!r}")
    config = PEFTConfig(
        r=cfg["r"],
        alpha=float(cfg.get("lora_alpha", 8)),
        rslora=bool(cfg.get("use_rslora")),
        rank_pattern=cfg.get("rank_pattern") or None,
        alpha_pattern=cfg.get("alpha_pattern") or None,
        max_rank=max_lora_rank,
    )
    config.check_rank(path, "", config.r)
    return config


def _module_shapes(path: str) -> dict[str, dict[str, tuple[int, ...]]]:
    from safetensors import safe_open

    file = str(Path(path) / "adapter_model.safetensors")
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                out.setdefault(key, {})["shape"] = tuple(f.get_slice(key).get_shape())
    except Exception as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
    return out


def _parse_keys(path: str, keys: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """module path -> {"A": value, "B": value}, refusing unsupported or incomplete ones."""
    modules: dict[str, dict[str, Any]] = {}
    for key, value in keys.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"LoRA adapter {path!r}: tensor {key!r} is not a lora_A / lora_B weight "
                "(embedding LoRA, biases and saved modules are not supported)"
            )
        module = m["module"]
        leaf = module.rpartition(".")[2]
        if ".experts." in module:
            raise ValueError(
                f"LoRA adapter {path!r}: {module} is a routed MoE expert; LoRA on experts is "
                "not supported"
            )
        if leaf not in SUPPORTED_TARGETS:
            raise ValueError(
                f"LoRA adapter {path!r}: target module {module!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_TARGETS)})"
            )
        modules.setdefault(module, {})[m["ab"]] = value
    for module, ab in modules.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_A or lora_B missing")
    if not modules:
        raise ValueError(f"LoRA adapter {path!r} holds no lora_A / lora_B weights")
    return modules


def _check_pair(path: str, module: str, a: tuple, b: tuple, r: int, dims: Any) -> None:
    if len(a) != 2 or len(b) != 2 or a[0] != r or b[1] != r:
        raise ValueError(
            f"LoRA adapter {path!r}: {module} has lora_A {a} / lora_B {b}, not [r, in] / "
            f"[out, r] with r={r}"
        )
    if dims is not None and (a[1], b[0]) != dims:
        raise ValueError(
            f"LoRA adapter {path!r}: {module} maps {a[1]} -> {b[0]} features but the model's "
            f"{module.rpartition('.')[2]} maps {dims[0]} -> {dims[1]} (an adapter of another "
            "base model?)"
        )


def check_adapter(path: str, hf_config: Any, max_lora_rank: int) -> PEFTConfig:
    """Refuse, naming the problem, an adapter this model cannot run; reads shapes only."""
    cfg = read_peft_config(path, max_lora_rank)
    modules = _parse_keys(path, _module_shapes(path))
    for module, ab in modules.items():
        dims = expected_dims(hf_config, module, path)
        _check_pair(path, module, ab["A"]["shape"], ab["B"]["shape"], cfg.rank(module, path), dims)
    return cfg


def load_adapter(path: str, max_lora_rank: int) -> PEFTAdapter:
    """The adapter's tensors (float32 on the CPU), checked for form (not against a model)."""
    from safetensors.torch import load_file

    cfg = read_peft_config(path, max_lora_rank)
    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    modules = _parse_keys(path, tensors)
    weights = {}
    for module, ab in modules.items():
        a, b = ab["A"].float(), ab["B"].float()
        _check_pair(path, module, tuple(a.shape), tuple(b.shape), cfg.rank(module, path), None)
        weights[module] = (a, b)
    return PEFTAdapter(cfg, weights)


def expected_dims(hf_config: Any, module: str, path: str = "") -> tuple[int, int] | None:
    """(in, out) features of an HF module of the supported families; None where unknown."""
    from vllm.config import get_text_config

    c = get_text_config(hf_config)
    leaf = module.rpartition(".")[2]
    m = _LAYER.search(module)
    layer = int(m[1]) if m else -1
    if not 0 <= layer < int(c.num_hidden_layers):
        raise ValueError(
            f"LoRA adapter {path!r}: {module} is not in one of the model's "
            f"{c.num_hidden_layers} decoder layers"
        )
    h, heads = int(c.hidden_size), int(c.num_attention_heads)
    types = getattr(c, "layer_types", None)
    if (
        leaf in ("q_proj", "k_proj", "v_proj", "o_proj")
        and types
        and types[layer] != ("full_attention")
    ):
        raise ValueError(
            f"LoRA adapter {path!r}: {module} targets layer {layer}, a {types[layer]} layer "
            "(only full-attention layers have q/k/v/o projections)"
        )
    if getattr(c, "kv_lora_rank", None):  # MLA
        rope, qk = int(c.qk_rope_head_dim), int(c.qk_nope_head_dim) + int(c.qk_rope_head_dim)
        q_rank = getattr(c, "q_lora_rank", None)
        attn = {
            "q_proj": (h, heads * qk),
            "q_a_proj": (h, q_rank),
            "q_b_proj": (q_rank, heads * qk),
            "kv_a_proj_with_mqa": (h, int(c.kv_lora_rank) + rope),
            "o_proj": (heads * int(c.v_head_dim), h),
        }
    else:
        hd = int(getattr(c, "head_dim", None) or h // heads)
        kv = int(c.num_key_value_heads) * hd
        # Qwen3.5 packs each head's output gate next to its query rows.
        gated = getattr(c, "attn_output_gate", str(c.model_type).startswith("qwen3_5"))
        q = heads * hd * (2 if gated else 1)
        attn = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (heads * hd, h)}
    if leaf in attn:
        dims = attn[leaf]
        d_in, d_out = dims
        if d_in is None or d_out is None:
            raise ValueError(f"LoRA adapter {path!r}: the model has no {leaf}")
        return (int(d_in), int(d_out))
    if leaf not in ("gate_proj", "up_proj", "down_proj"):
        raise ValueError(f"LoRA adapter {path!r}: the model has no {leaf}")
    if ".shared_experts." in module:
        inter = int(c.moe_intermediate_size) * int(getattr(c, "n_shared_experts", 1) or 1)
    elif ".shared_expert." in module:
        inter = int(c.shared_expert_intermediate_size)
    else:
        moe = getattr(c, "n_routed_experts", None) or getattr(c, "num_experts", None)
        dense = layer < int(getattr(c, "first_k_dense_replace", 0) or 0)
        if moe and not dense:
            raise ValueError(
                f"LoRA adapter {path!r}: {module} targets layer {layer}, whose MLP is a mixture "
                "of experts (LoRA on experts is not supported)"
            )
        inter = int(c.intermediate_size)
    return (inter, h) if leaf == "down_proj" else (h, inter)


class LoRAChecker:
    """The engine's gate for LoRARequests: LoRA enabled, the adapter runnable by this model
    (checked once per adapter id), and an id never reused for another adapter."""

    def __init__(self, config: Any, hf_config: Any) -> None:
        self.config = config  # LoRAConfig | None
        self.hf_config = hf_config
        self._seen: dict[int, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def check(self, lr: Any) -> None:
        from vllm.lora.request import LoRARequest

        if not isinstance(lr, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lr).__name__}")
        if self.config is None:
            raise ValueError(
                f"LoRA adapter {lr.lora_name!r} requested but LoRA is not enabled "
                "(enable_lora=True / --enable-lora)"
            )
        key = (lr.lora_name, lr.lora_path)
        with self._lock:
            seen = self._seen.get(lr.lora_int_id)
        if seen == key:
            return
        if seen is not None:
            raise ValueError(
                f"lora_int_id {lr.lora_int_id} is already used by adapter {seen[0]!r} "
                f"({seen[1]}); give {lr.lora_name!r} its own id"
            )
        check_adapter(lr.lora_path, self.hf_config, self.config.max_lora_rank)
        with self._lock:
            self._seen.setdefault(lr.lora_int_id, key)

    def checked(self, lr: Any) -> Any:
        if lr is not None:
            self.check(lr)
        return lr

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter's id may name another adapter later."""
        with self._lock:
            self._seen.pop(lora_int_id, None)
