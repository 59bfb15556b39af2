# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Causal depthwise conv1d with a carried state (torch reference, CPU and CUDA).

The state of a sequence is the last (kernel - 1) inputs it has seen, so a sequence processed in
pieces gives the same outputs as processed at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Queries up to this long use the multiply-add form instead of conv1d.
_SHORT = 16


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of x [B, C, L] continuing from conv_state [B, C, k - 1].

    weight is [C, k] (or nn.Conv1d's [C, 1, k]). Returns (out [B, C, L], the padded input
    [B, C, k - 1 + L]); the state after step i is padded[..., i + 1 : i + k] (see
    conv_state_at), the final one padded[..., -(k - 1):].
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    channels, k = weight.shape
    padded = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    if x.shape[-1] <= _SHORT:
        # Decode / verify: a few multiply-adds per channel beat conv1d's fixed overhead.
        windows = padded.to(weight.dtype).unfold(-1, k, 1)  # [B, C, L, k]
        out = (windows * weight[:, None, :]).sum(-1)
        if bias is not None:
            out = out + bias[:, None]
    else:
        out = F.conv1d(padded.to(weight.dtype), weight.unsqueeze(1), bias, groups=channels)
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return out.to(x.dtype), padded


def conv_state_at(
    padded: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor, kernel_size: int
) -> torch.Tensor:
    """The conv state of sequence rows[n] after its step steps[n]: padded [B, C, k - 1 + L]
    (from causal_conv1d) -> [N, C, k - 1]."""
    windows = padded.unfold(-1, kernel_size - 1, 1)  # [B, C, L + 1, k - 1]; window j ends at j-1
    return windows[rows, :, steps + 1]
