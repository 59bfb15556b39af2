# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tiny Qwen3.5 checkpoints (dense and MoE) built with HF transformers, for the hybrid-model tests.

- make_qwen3_5: `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` with a mix of layer types,
  re-initialised "peaky" (see vllm/testing/checkpoints.py), optionally with `mtp.*` weights
  (`mtp_num_hidden_layers` in config.json). HF ignores `mtp.*` on load.
- make_multimodal_layout: the same weights under the multimodal names
  (`model.language_model.*`, plus a random vision tower `model.visual.*`) with a nested config,
  as `Qwen3_5ForConditionalGeneration` checkpoints ship (no image processor: text only).
- make_qwen3_5_vl: a tiny random `Qwen3_5ForConditionalGeneration` built by transformers, with
  its tokenizer (vision special tokens) and image processor files; hf_vl_greedy: HF's greedy
  reference on a prompt with images.
- make_qwen3_5_mtp_self_draft: a copy whose MTP head reproduces the (scaled) target's next token.

Facts about transformers 5.23 these builders rely on: Qwen3.5 linear-attention layers are named
`linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm,
out_proj}` (separate projections, conv1d weight [C, 1, k] without bias); full-attention
`self_attn.q_proj` is [2 * heads * head_dim, H] (query and output gate interleaved per head);
all RMSNorms except linear_attn.norm are zero-centred (scale = 1 + weight). Qwen3.5-MoE experts
save fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) with the
router `mlp.gate.weight`, `mlp.shared_expert.*` and `mlp.shared_expert_gate.weight` [1, H].
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from vllm.testing.checkpoints import (
    _LOGIT_GAIN,
    _WEIGHT_GAIN,
    _token_ids,
    build_tokenizer,
)

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


@torch.no_grad()
def _reinit_(module: nn.Module, seed: int, output_head: torch.Tensor | None = None) -> None:
    """Peaky re-init (vllm/testing/checkpoints.py rules) plus Gated DeltaNet's A_log / dt_bias.

    Zero-centred norms get weights U[-0.5, 0.5] (scale U[0.5, 1.5]); linear_attn.norm (a plain
    scale) U[0.5, 1.5]; A_log = log U[0.5, 4] (decays between e^-0.35 and e^-4 per token at
    a = 0), dt_bias N(0, 0.5^2)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, param in module.named_parameters():
        shape = param.shape
        if output_head is not None and param is output_head:
            value = randn(shape) * (_LOGIT_GAIN / shape[-1] ** 0.5)
        elif "embed_tokens" in name:
            value = randn(shape)
        elif name.endswith("A_log"):
            value = (torch.rand(shape, generator=gen) * 3.5 + 0.5).log()
        elif name.endswith("dt_bias"):
            value = randn(shape) * 0.5
        elif name.endswith("linear_attn.norm.weight"):
            value = torch.rand(shape, generator=gen) + 0.5
        elif "norm" in name and param.ndim == 1:
            value = torch.rand(shape, generator=gen) - 0.5
        elif param.ndim >= 2:
            value = randn(shape) * (_WEIGHT_GAIN / shape[-1] ** 0.5)
        else:
            raise AssertionError(f"no re-init rule for parameter {name} {tuple(shape)}")
        param.copy_(value.to(param.dtype))


def _read(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _write(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    for old in list(folder.glob("*.safetensors")) + list(folder.glob("*.index.json")):
        old.unlink()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        folder / "model.safetensors",
        {"format": "pt"},
    )


@torch.no_grad()
def _mtp_state(config: Any, moe: bool, n: int, seed: int) -> dict[str, torch.Tensor]:
    """`mtp.*` tensors: fc, the two pre-fc norms, n full-attention decoder layers, and the final
    norm. MoE experts stay fused here (the target's are saved per expert), so the loaders see
    both layouts."""
    Layer: type[torch.nn.Module]
    if moe:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer as Layer,
        )
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer
    h = config.hidden_size
    block_config = copy.deepcopy(config)
    block_config.layer_types = ["full_attention"] * max(n, config.num_hidden_layers)
    state: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed + 7)
    for j in range(n):
        torch.manual_seed(seed + 100 + j)
        layer = Layer(block_config, layer_idx=j)
        _reinit_(layer, seed + 100 + j)
        for k, v in layer.state_dict().items():
            state[f"mtp.layers.{j}.{k}"] = v.detach().clone()
    state["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * (_WEIGHT_GAIN / (2 * h) ** 0.5)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        state[f"mtp.{name}.weight"] = torch.rand(h, generator=gen) - 0.5
    return state


def make_qwen3_5(
    out_dir: str | os.PathLike,
    *,
    moe: bool = False,
    layer_types: list[str] | None = None,
    mtp_num_hidden_layers: int = 0,
    tie_word_embeddings: bool = False,
    hidden_size: int = 64,
    seed: int = 0,
) -> str:
    """Write a tiny random Qwen3.5 (or Qwen3.5-MoE) checkpoint (+ tokenizer); returns the path.

    Default layout: 4 layers [linear, full, linear, full] (both halves of a 2-stage pipeline
    hold both kinds), attention 4 q / 2 kv heads of 16 (rotary on 4 dims), linear attention
    2 k-heads / 4 v-heads of 16 with a kernel-4 conv; MoE: 8 experts, top-2, a shared expert.
    """
    import transformers

    out = Path(out_dir)
    tokenizer = build_tokenizer(out)
    types = list(layer_types or LAYER_TYPES)
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=len(types),
        layer_types=types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_token_ids(tokenizer),
    )
    # The dense and MoE families share every field used below.
    config: transformers.PretrainedConfig
    model_cls: type[transformers.PreTrainedModel]
    if moe:
        kwargs.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
        config = transformers.Qwen3_5MoeTextConfig(**kwargs)
        model_cls = transformers.Qwen3_5MoeForCausalLM
    else:
        config = transformers.Qwen3_5TextConfig(intermediate_size=128, **kwargs)
        model_cls = transformers.Qwen3_5ForCausalLM
    if mtp_num_hidden_layers:
        config.mtp_num_hidden_layers = mtp_num_hidden_layers
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _reinit_(model, seed, output_head=model.get_output_embeddings().weight)
    model.config.dtype = torch.float32
    model.save_pretrained(str(out), safe_serialization=True)
    if mtp_num_hidden_layers:
        tensors = _read(out)
        tensors.update(_mtp_state(config, moe, mtp_num_hidden_layers, seed))
        _write(out, tensors)
    return str(out)


def make_multimodal_layout(out_dir: str | os.PathLike, src_dir: str | os.PathLike) -> str:
    """Copy a make_qwen3_5 checkpoint as a `...ForConditionalGeneration` one: text weights
    under `model.language_model.*`, a random vision tower under `model.visual.*`, a nested
    config."""
    src, out = Path(src_dir), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    text_cfg = json.loads((src / "config.json").read_text())
    arch = text_cfg["architectures"][0]
    moe = "Moe" in arch
    tensors = {}
    for k, v in _read(src).items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model.") :]
        tensors[k] = v
    vision_cfg = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text_cfg["hidden_size"],
        "num_position_embeddings": 16,
    }
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(3)
    visual = Qwen3_5VisionModel(Qwen3_5VisionConfig(**vision_cfg))
    _reinit_vision_(visual, 3)
    for k, v in visual.state_dict().items():
        tensors["model.visual." + k] = v.detach().clone()
    _write(out, tensors)
    text_cfg.pop("architectures", None)
    cfg = {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text_cfg,
        "vision_config": vision_cfg,
        "tie_word_embeddings": bool(text_cfg.get("tie_word_embeddings", False)),
        "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return str(out)


@torch.no_grad()
def make_qwen3_5_mtp_self_draft(
    out_dir: str | os.PathLike, src_dir: str | os.PathLike, *, target_scale: float = 0.0
) -> str:
    """Copy a make_qwen3_5 checkpoint with MTP weights so the MTP head reproduces the target's
    next-token choice (analytically, as vllm.testing.spec_checkpoints.make_mtp_self_draft does):
    every target layer's output projections (o_proj, linear_attn.out_proj, MLP/expert and shared
    expert down_proj) are scaled by target_scale (0: logits = lm_head(norm(embed(token)))), and
    the MTP head gets pre_fc_norm_embedding = identity scale, pre_fc_norm_hidden = 0 (scale 0),
    fc = [I | 0], decoder block outputs 0, mtp.norm = the target's final norm. The head then
    computes lm_head(norm(rmsnorm(embed(next token)))): with target_scale = 0 every draft is
    accepted - but only if the fc input branch runs (skipping it loses the next token)."""
    src, out = Path(src_dir), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    tensors = _read(out)
    if not any(k.startswith("mtp.") for k in tensors):
        raise ValueError(f"{src} has no mtp.* weights")
    # A multimodal checkpoint keeps the text model under model.language_model.
    lm = "model.language_model."
    if lm + "embed_tokens.weight" not in tensors:
        lm = "model."
    h = tensors[lm + "embed_tokens.weight"].shape[1]
    out_proj = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
    for k, v in list(tensors.items()):
        if k.startswith(lm + "layers.") and k.endswith(out_proj):
            tensors[k] = v * target_scale
        elif k.startswith("mtp.layers.") and (
            k.endswith(out_proj) or k.endswith("shared_expert_gate.weight")
        ):
            tensors[k] = torch.zeros_like(v)
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)
    tensors["mtp.pre_fc_norm_hidden.weight"] = -torch.ones(h)
    fc = torch.zeros(h, 2 * h)
    fc[:, :h] = torch.eye(h)
    tensors["mtp.fc.weight"] = fc
    tensors["mtp.norm.weight"] = tensors[lm + "norm.weight"].clone()
    _write(out, tensors)
    return str(out)


# ---- multimodal (vision) checkpoints ----------------------------------------------------------

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


# Std of every vision matrix (conv kernel, qkv / proj / MLP / merger, position table). At the
# 1 / sqrt(fan_in) scale of the text layers a vision tower barely moves the logits, and a
# wrong rotary, position grid or merge order can still give HF's greedy text; at 0.2 each of
# them changes it (tests/models/test_qwen3_5_vl.py asserts so, module by module).
VISION_WEIGHT_STD = 0.2

# The learned position table's std: the patch embedding's outputs are ~VISION_WEIGHT_STD *
# sqrt(3 * 2 * 8 * 8) ~ 4 per channel, and the table added to them must be of that size for
# its resampling and orientation to show in the text.
VISION_POSITION_STD = 4.0
# Text RoPE base: with 8 rotary dims and base 10000 three of the four frequencies turn by
# < 0.1 rad per position, too little for wrong M-RoPE positions to change the text; base 10
# turns them by 1, 0.56, 0.32 and 0.18 rad.
VL_ROPE_THETA = 10.0

# A Qwen-VL style chat template: it loops over a message's content parts and writes an image
# part as the vision placeholder, as the real checkpoints' templates do.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' or 'image' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@torch.no_grad()
def _reinit_vision_(module: nn.Module, seed: int) -> None:
    """Vision tower: matrices and conv kernels N(0, VISION_WEIGHT_STD^2), the position table
    N(0, VISION_POSITION_STD^2), biases N(0, 0.1^2), LayerNorm scales U[0.5, 1.5]."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        shape = param.shape
        if name.endswith("pos_embed.weight"):
            value = torch.randn(shape, generator=gen) * VISION_POSITION_STD
        elif param.ndim >= 2:
            value = torch.randn(shape, generator=gen) * VISION_WEIGHT_STD
        elif "norm" in name and name.endswith("weight"):
            value = torch.rand(shape, generator=gen) + 0.5
        else:
            value = torch.randn(shape, generator=gen) * 0.1
        param.copy_(value.to(param.dtype))


def make_qwen3_5_vl(
    out_dir: str | os.PathLike,
    *,
    moe: bool = False,
    layer_types: list[str] | None = None,
    mtp_num_hidden_layers: int = 0,
    seed: int = 0,
) -> str:
    """Write a tiny random `Qwen3_5ForConditionalGeneration` (or the MoE one) with its vision
    tower, tokenizer (plus the vision special tokens and a Qwen-VL style chat template) and
    image processor (preprocessor_config.json: 8-pixel patches, 2x2 merge, 256 to 16384 pixels
    after resizing to multiples of 16); returns the path.

    Text model as make_qwen3_5 (hidden 64, 4 layers by default) with M-RoPE over 8 rotary dims
    (sections [2, 1, 1], interleaved); vision: 2 blocks of width 32 (2 heads), an 8x8 learned
    position grid (a 64x64 image's patch grid; smaller and larger images resample it),
    out_hidden_size = 64, weights of std VISION_WEIGHT_STD."""
    import transformers

    out = Path(out_dir)
    tokenizer = build_tokenizer(out)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    types = list(layer_types or LAYER_TYPES)
    text: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=len(types),
        layer_types=types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": VL_ROPE_THETA,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **_token_ids(tokenizer),
    )
    if moe:
        text.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
    else:
        text.update(intermediate_size=128)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=64,
        hidden_act="gelu_pytorch_tanh",
    )
    cfg_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_cls = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    config = cfg_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if mtp_num_hidden_layers:
        config.text_config.mtp_num_hidden_layers = mtp_num_hidden_layers
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _reinit_(model.model.language_model, seed, output_head=None)
    _reinit_(model.lm_head, seed + 1, output_head=model.lm_head.weight)
    _reinit_vision_(model.model.visual, seed + 2)
    model.config.dtype = torch.float32
    model.save_pretrained(str(out), safe_serialization=True)
    if mtp_num_hidden_layers:
        tensors = _read(out)
        tensors.update(_mtp_state(config.text_config, moe, mtp_num_hidden_layers, seed))
        _write(out, tensors)
    from transformers import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(
        patch_size=8,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 16 * 16, "longest_edge": 128 * 128},
    ).save_pretrained(str(out))
    return str(out)


def make_test_image(seed: int, size: tuple[int, int] = (24, 32)):
    """A random RGB PIL image (width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@torch.no_grad()
def hf_vl_greedy(
    path: str, prompt: str, images: list, max_new_tokens: int, model: Any = None
) -> list[int]:
    """HF transformers' greedy continuation of a prompt with images (each `<|image_pad|>` of the
    prompt expanded to its image's tokens, as transformers' Qwen3-VL processor does): the
    reference the engine is checked against. `model`: an already loaded HF model of `path`."""
    import numpy as np
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    proc = transformers.AutoImageProcessor.from_pretrained(path)
    if model is None:
        model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model.eval()
    text = prompt
    kwargs: dict[str, Any] = {}
    if images:
        pix = proc(images=images, return_tensors="pt")
        merge = proc.merge_size**2
        parts = text.split("<|image_pad|>")
        assert len(parts) == len(images) + 1, "one <|image_pad|> per image"
        text = parts[0]
        for grid, rest in zip(pix["image_grid_thw"], parts[1:]):
            text += "<|image_pad|>" * int(grid.prod() // merge) + rest
        kwargs = dict(pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    kwargs["mm_token_type_ids"] = (ids == image_id).int()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        **kwargs,
    )
    return [int(t) for t in np.asarray(out[0, ids.shape[1] :])]
