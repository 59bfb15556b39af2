# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Qwen3.5 (dense and MoE) as multimodal targets: the vision tower (a Conv3d patch embedding,
a learned position grid resampled bilinearly to each image, 2D axial rotary positions,
full-attention ViT blocks within each image, a 2x2 patch merger into the text hidden size) on
the first pipeline stage, and the hybrid text model of qwen3_5.py, whose full-attention layers
rotate by the interleaved multimodal positions (M-RoPE: temporal / height / width)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5Model,
    Qwen3_5MoeModel,
)
from vllm.model_executor.models.utils import PPMissingLayer


def _vision_cfg(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    if value is None:
        raise ValueError(f"Qwen3.5 vision_config has no {name}")
    return value


def vision_position_ids(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, col) of every patch, patches ordered block-major over merge x merge blocks (the
    order the processor flattens them in), repeated per frame: [N, 2]."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rc = torch.stack(
            [rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()], dim=-1
        )
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps and weights into a `side`-long table for positions 0..size-1 of an axis,
    align_corners=True (the ends map onto the table's ends)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    taps = (lo.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
    dist = (src[:, None] - lo[:, None] - torch.arange(2)).abs()
    return taps, (1 - dist).clamp(min=0)


class _VisionAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


class _VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, out: int | None = None) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, out or dim)


class _PatchEmbed(nn.Module):
    def __init__(self, channels: int, dim: int, kernel: tuple[int, int, int]) -> None:
        super().__init__()
        self.proj = nn.Conv3d(channels, dim, kernel, stride=kernel)


class _PatchMerger(_VisionMLP):
    def __init__(self, dim: int, merged: int, out: int) -> None:
        super().__init__(merged, merged, out)
        self.norm = nn.LayerNorm(dim, eps=1e-6)


class Qwen3_5VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _VisionAttention(dim)
        self.mlp = _VisionMLP(dim, mlp_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        n, dim = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs = []
        start = 0
        # Full attention within each image (frame), never across images.
        for length in lengths:
            sl = slice(start, start + length)
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1)
            )
            outs.append(o.transpose(0, 1).reshape(length, dim))
            start += length
        x = x + self.attn.proj(torch.cat(outs))
        h = self.mlp.linear_fc1(self.norm2(x))
        return x + self.mlp.linear_fc2(F.gelu(h, approximate="tanh"))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation over the whole head dim; x [N, heads, D], cos/sin [N, D]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class Qwen3_5VisionModel(nn.Module):
    """The vision tower: pixel patches [N, C * T * P * P] of the images of grid_thw -> one
    embedding of the text hidden size per merged (merge x merge) patch group, per image."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = int(_vision_cfg(config, "hidden_size"))
        self.num_heads = int(_vision_cfg(config, "num_heads"))
        self.in_channels = int(_vision_cfg(config, "in_channels", 3))
        self.patch_size = int(_vision_cfg(config, "patch_size"))
        self.temporal_patch_size = int(_vision_cfg(config, "temporal_patch_size"))
        self.merge = int(_vision_cfg(config, "spatial_merge_size"))
        act = getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"Qwen3.5 vision: hidden_act {act!r} is not supported")
        rope = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.head_dim = dim // self.num_heads
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.patch_embed = _PatchEmbed(self.in_channels, dim, kernel)
        num_pos = int(_vision_cfg(config, "num_position_embeddings"))
        self.side = int(num_pos**0.5)
        self.pos_embed = nn.Embedding(num_pos, dim)
        self.blocks = nn.ModuleList(
            Qwen3_5VisionBlock(dim, self.num_heads, int(_vision_cfg(config, "intermediate_size")))
            for _ in range(int(_vision_cfg(config, "depth")))
        )
        merged = dim * self.merge**2
        self.merger = _PatchMerger(dim, merged, int(_vision_cfg(config, "out_hidden_size")))
        self.merged_dim = merged

    def _pos_embeds(self, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned square position table resampled to each image's grid (bilinear,
        align_corners), in the patches' block-major order: [N, dim]."""
        rc = vision_position_ids(grid_thw, self.merge)
        parts = []
        start = 0
        for t, h, w in grid_thw:
            n = t * h * w
            rows, cols = rc[start : start + n, 0], rc[start : start + n, 1]
            ht, hw = _bilinear_taps(rows, h, self.side)
            wt, ww = _bilinear_taps(cols, w, self.side)
            idx = (ht[:, :, None] * self.side + wt[:, None, :]).reshape(n, 4)
            weights = (hw[:, :, None] * ww[:, None, :]).reshape(n, 4)
            table = self.pos_embed(idx.to(self.pos_embed.weight.device))
            parts.append((table * weights.to(table)[:, :, None]).sum(1))
            start += n
        return torch.cat(parts)

    def _rotary(self, grid_thw: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, ...]:
        rc = vision_position_ids(grid_thw, self.merge).to(device)
        half = self.head_dim // 2
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, half, 2, device=device).float() / half))
        freqs = (rc[..., None].float() * inv).reshape(rc.shape[0], -1)  # [N, (h, w) freqs]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        w = self.patch_embed.proj.weight
        p, t = self.patch_size, self.temporal_patch_size
        x = self.patch_embed.proj(pixel_values.to(w).view(-1, self.in_channels, t, p, p))
        x = x.view(x.shape[0], -1)
        x = x + self._pos_embeds(grid_thw).to(x.dtype)
        cos, sin = self._rotary(grid_thw, x.device)
        lengths = [h * w_ for t_, h, w_ in grid_thw for _ in range(t_)]
        for blk in self.blocks:
            x = blk(x, cos, sin, lengths)
        x = self.merger.norm(x).view(-1, self.merged_dim)
        x = self.merger.linear_fc2(F.gelu(self.merger.linear_fc1(x)))
        sizes = [t_ * h * w_ // self.merge**2 for t_, h, w_ in grid_thw]
        return list(torch.split(x, sizes))


_VISUAL = ("model.visual.", "visual.")


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """Qwen3.5 with its vision tower: the tower (`visual`) is built on the first pipeline stage
    only, next to the embedding, where the runner merges its outputs into the input
    embeddings; the text model takes [3, T] M-RoPE positions (or [T] for text alone)."""

    supports_multimodal: ClassVar[bool] = True
    hf_to_vllm_prefix = {
        "model.language_model.": "model.",
        "model.visual.": "visual.",
    }

    visual: Qwen3_5VisionModel | PPMissingLayer

    def __init__(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> None:
        super().__init__(vllm_config, model_config, prefix)
        vision = getattr(model_config.hf_config, "vision_config", None)
        if vision is None:
            raise ValueError(
                f"{type(self).__name__}: config.json has no vision_config (a multimodal "
                "checkpoint is expected)"
            )
        if get_pp_group().is_first_rank:
            self.visual = Qwen3_5VisionModel(vision)
        else:
            self.visual = PPMissingLayer()
        # Images encoded so far (every call is one batch of images; tests count them).
        self.num_encoded_images = 0

    def skip_weight(self, name: str) -> bool:
        if name.startswith(_VISUAL):
            # Vision weights are the first stage's; elsewhere there is no tower to fill.
            return not get_pp_group().is_first_rank or name.endswith("rotary_pos_emb.inv_freq")
        return super().skip_weight(name)

    def embed_multimodal(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Encoder outputs, one [tokens, H] tensor per image (first stage only)."""
        if not isinstance(self.visual, Qwen3_5VisionModel):
            raise RuntimeError("the vision encoder runs on the first pipeline stage only")
        self.num_encoded_images += len(grid_thw)
        dtype = self.visual.patch_embed.proj.weight.dtype
        return [e.to(dtype) for e in self.visual(pixel_values, grid_thw)]


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    model_cls = Qwen3_5MoeModel


__all__ = [
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5Model",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5VisionModel",
]
