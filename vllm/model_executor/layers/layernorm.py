# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""RMSNorm with an optional fused residual add (the residual stream convention of vLLM models)."""

from __future__ import annotations

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.triton_utils import LayerOpsRoute


class RMSNorm(nn.Module):
    """RMSNorm; subclasses that override _norm (other formulas) keep the torch path."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self._triton_route = LayerOpsRoute()
        # The fused kernels compute RMSNorm's own formula; a subclass with another keeps torch.
        self._plain = type(self)._norm is RMSNorm._norm

    def _fused_cpu_ok(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (
            self._plain
            and self.weight.dtype == x.dtype
            and (x.is_contiguous() or x.dim() == 2)  # 2-D: rows may be strided (a slice)
            and (
                residual is None
                or (
                    residual.dtype == x.dtype
                    and residual.shape == x.shape
                    and residual.is_contiguous()
                )
            )
            and ops.cpu_op_ok(x)
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if self._plain and self._triton_route(x):
            # The CUDA path: one Triton launch (model_executor/layers/ops/triton_rms_norm.py).
            from vllm.model_executor.layers.ops.triton_rms_norm import triton_rms_norm

            return triton_rms_norm(x, self.weight, self.variance_epsilon, residual)
        if self._fused_cpu_ok(x, residual):
            # One C++ pass instead of ~8 torch ops (the same arithmetic).
            if residual is None:
                return ops.rms_norm(x, self.weight, self.variance_epsilon)
            return ops.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
