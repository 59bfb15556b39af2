# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Causal depthwise conv1d with a carried state (torch reference, CPU and CUDA), for one padded
batch and over the per-request state slots of a flattened token batch (varlen).

The state of a sequence is the last (kernel - 1) inputs it has seen, so a sequence processed in
pieces gives the same outputs as processed at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from vllm.attention.backends.gdn_attn import GDNAttentionMetadata

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


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    meta: GDNAttentionMetadata,
    activation: str | None = "silu",
    checkpoints: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv of the flattened x [T, C] per request, continuing and updating
    conv_states [S, P, C, k - 1] (and the checkpoints [C_ids, C, k - 1] the metadata names);
    returns [T, C]."""
    k = conv_states.shape[-1] + 1
    out = torch.zeros_like(x)
    init = meta.initial_states(conv_states)
    g = meta.short
    if g is not None:
        xg = g.padded(x).transpose(1, 2)  # [Rg, C, L]
        y, padded = causal_conv1d(xg, weight, init[g.rows], bias, activation)
        out[g.token_flat] = y.transpose(1, 2).reshape(-1, x.shape[1])[g.valid]
        conv_states[g.store_slots, g.store_pos] = conv_state_at(
            padded, g.store_rows, g.store_steps, k
        ).to(conv_states.dtype)
        if checkpoints is not None and g.ckpt_ids is not None:
            assert g.ckpt_rows is not None and g.ckpt_steps is not None
            checkpoints[g.ckpt_ids] = conv_state_at(padded, g.ckpt_rows, g.ckpt_steps, k).to(
                checkpoints.dtype
            )
    qsl = meta.query_start_loc_np
    for r in meta.long_rows:
        a, b = int(qsl[r]), int(qsl[r + 1])
        y, padded = causal_conv1d(x[a:b].t()[None], weight, init[r : r + 1], bias, activation)
        out[a:b] = y[0].t()
        slot = int(meta.state_slots_np[r])
        conv_states[slot, 0] = padded[0, :, -(k - 1) :].to(conv_states.dtype)
        if checkpoints is not None:
            for off, ck in meta.long_ckpts.get(r, []):
                # The state after `off` steps: the k - 1 inputs ending at step off - 1.
                checkpoints[ck] = padded[0, :, off : off + k - 1].to(checkpoints.dtype)
    return out
