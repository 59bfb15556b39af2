# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Rotary position embeddings: default, linear, llama3 and yarn (DeepSeek) frequency schedules."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.triton_utils import LayerOpsRoute


def rope_params(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers 4 or 5 style config."""
    params = getattr(config, "rope_parameters", None)
    scaling = getattr(config, "rope_scaling", None)
    theta = getattr(config, "rope_theta", None)
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = params if params.get("rope_type", "default") != "default" else scaling
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    else:
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _yarn_find_correction_dim(num_rot: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rot * 2 * math.pi))) / (2 * math.log(base))


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _inv_freq(dim: int, base: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin multiplier (yarn's attention factor)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if scaling is None:
        return inv, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        low_ff = float(scaling.get("low_freq_factor", 1.0))
        high_ff = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low_ff, old_ctx / high_ff
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > low_wl, inv / factor, mid)
        out = torch.where(wavelen < high_wl, inv, out)
        return out, 1.0
    if kind == "yarn":
        old_ctx = int(scaling.get("original_max_position_embeddings", 4096))
        beta_fast = float(scaling.get("beta_fast", 32))
        beta_slow = float(scaling.get("beta_slow", 1))
        low = math.floor(_yarn_find_correction_dim(beta_fast, dim, base, old_ctx))
        high: float = math.ceil(_yarn_find_correction_dim(beta_slow, dim, base, old_ctx))
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrap_factor = 1 - ramp
        out = (inv / factor) * (1 - extrap_factor) + inv * extrap_factor
        mscale = scaling.get("mscale")
        mscale_all = scaling.get("mscale_all_dim")
        attn_factor = scaling.get("attention_factor")
        if attn_factor is None:
            if mscale is not None and mscale_all is not None:
                attn_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
            else:
                attn_factor = yarn_get_mscale(factor)
        return out, float(attn_factor)
    raise ValueError(f"rope scaling type {kind!r} is not supported")


@functools.lru_cache(maxsize=8)
def _cos_sin_tables(
    n: int, inv_freq: tuple[float, ...], attn_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 cos / sin caches [n, rotary_dim // 2], computed in fp64; shared by every
    layer with the same rotary parameters (built once, not once per layer: ~1.4 s and 60 MiB
    for 30 layers at 8192 positions). Read-only: the kernels and _rotate only index them."""
    t = torch.arange(n, dtype=torch.float64)
    freqs = torch.outer(t, torch.tensor(inv_freq, dtype=torch.float64))
    return (freqs.cos() * attn_factor).float(), (freqs.sin() * attn_factor).float()


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first rotary_dim channels of q and k at the given positions."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        inv, self.attn_factor = _inv_freq(rotary_dim, base, scaling)
        self.inv_freq = inv
        self._cos: torch.Tensor
        self._sin: torch.Tensor
        self._build(max(max_position, 1))
        self._triton_route = LayerOpsRoute()

    def _build(self, n: int) -> None:
        self._cos, self._sin = _cos_sin_tables(
            n, tuple(self.inv_freq.tolist()), float(self.attn_factor)
        )

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; cos/sin: [T, 1, rotary_dim // 2]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        dtype = x.dtype
        rot = rot.float()
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        out = out.to(dtype)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    def _triton(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        axis: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CUDA path: one Triton launch for q and k (layers/ops/triton_rotary.py)."""
        from vllm.model_executor.layers.ops.triton_rotary import triton_rotary

        return triton_rotary(
            positions,
            q,
            k,
            self._cos,
            self._sin,
            self.head_size,
            self.rotary_dim,
            self.is_neox_style,
            axis,
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D] or [T, Hq*D]; k likewise. Returns rotated copies in the input shape."""
        # The cache covers max_position_embeddings >= max_model_len (checked by ModelConfig).
        cos = self._cos  # same device? (is_cpu / get_device: cheaper than building .device)
        if cos.is_cpu != positions.is_cpu or cos.get_device() != positions.get_device():
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
        if self._triton_route(q):
            return self._triton(positions, q, k, None)
        if (
            q.dtype == k.dtype
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and q.dim() in (2, 3)
            and k.dim() in (2, 3)
            and k.stride(-1) == 1
            and ops.cpu_op_ok(q)
        ):
            # One C++ call for q and k instead of ~20 torch ops (the same arithmetic).
            return ops.rotary_embedding(
                positions,
                q,
                k,
                self._cos,
                self._sin,
                self.head_size,
                self.rotary_dim,
                self.is_neox_style,
            )
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        q_shape, k_shape = q.shape, k.shape
        q = self._rotate(q.view(q.shape[0], -1, self.head_size), cos, sin).reshape(q_shape)
        k = self._rotate(k.view(k.shape[0], -1, self.head_size), cos, sin).reshape(k_shape)
        return q, k


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen3-VL / Qwen3.5 layout): positions [3, T] (temporal, height, width;
    equal for text) choose, per rotary frequency, the axis its angle comes from, interleaved:
    frequency i takes height when i % 3 == 1 and i < 3 * section[1], width when i % 3 == 2 and
    i < 3 * section[2], temporal otherwise. Positions [T] are plain RoPE (every axis equal)."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        mrope_section: list[int],
        is_neox_style: bool = True,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(head_size, rotary_dim, max_position, base, is_neox_style, scaling)
        if len(mrope_section) != 3:
            raise ValueError(f"mrope_section must have 3 entries, got {mrope_section}")
        axis = torch.zeros(rotary_dim // 2, dtype=torch.long)
        axis[1 : 3 * int(mrope_section[1]) : 3] = 1
        axis[2 : 3 * int(mrope_section[2]) : 3] = 2
        self.axis = axis

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        if self._cos.device != positions.device:
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
        if self.axis.device != positions.device:
            self.axis = self.axis.to(positions.device)
        axis = self.axis
        if self._triton_route(q):
            return self._triton(positions, q, k, axis)
        cols = torch.arange(axis.numel(), device=positions.device)
        # [3, T, F] -> [T, F], each frequency from its axis' position.
        cos = self._cos[positions][axis, :, cols].transpose(0, 1).unsqueeze(1)
        sin = self._sin[positions][axis, :, cols].transpose(0, 1).unsqueeze(1)
        q_shape, k_shape = q.shape, k.shape
        q = self._rotate(q.view(q.shape[0], -1, self.head_size), cos, sin).reshape(q_shape)
        k = self._rotate(k.view(k.shape[0], -1, self.head_size), cos, sin).reshape(k_shape)
        return q, k


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    is_neox_style: bool = True,
    scaling: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, scaling)
