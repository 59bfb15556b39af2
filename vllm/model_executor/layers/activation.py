# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm import _custom_ops as ops


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for an input of width 2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.cpu_op_ok(x):  # one call instead of four torch ops (the same kernels)
            return ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
