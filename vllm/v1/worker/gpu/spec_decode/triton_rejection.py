# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The rejection sampler's accept step in Triton (CUDA and ROCm from one source; Triton's
interpreter on CPU), on device tensors. Its reference is rejection_sample_tokens (numpy), the
step the engine runs on the host: see rejection_sampler.py for what it computes and why it is
lossless.

One program per request: its rows' target tokens and drafts, the first row whose draft differs
from the target's token, the accepted prefix plus the target's token after it written into
sampled [R, width] (PAD_TOKEN_ID past it) and the count into num_sampled [R] (0 for a request
without logits rows).
"""

from __future__ import annotations

import torch

from vllm.triton_utils import LazyKernel, next_pow2, tl
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID


def _accept_kernel(
    target_ptr,
    draft_ptr,
    cu_ptr,
    sampled_ptr,
    num_sampled_ptr,
    stride_s,
    width,
    PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    lo = tl.load(cu_ptr + r)
    n = tl.load(cu_ptr + r + 1) - lo
    d = tl.maximum(n - 1, 0)
    offs = tl.arange(0, BLOCK)
    tok = tl.load(target_ptr + lo + offs, mask=offs < n, other=PAD)
    draft = tl.load(draft_ptr + lo + offs, mask=offs < d, other=PAD)
    mismatch = (offs < d) & (draft != tok)
    first_bad = tl.min(tl.where(mismatch, offs, BLOCK), axis=0)
    num = tl.where(n > 0, tl.minimum(first_bad, d) + 1, 0)
    out = tl.where(offs < num, tok, PAD)
    tl.store(sampled_ptr + r.to(tl.int64) * stride_s + offs, out, mask=offs < width)
    tl.store(num_sampled_ptr + r, num)


_KERNEL = LazyKernel(_accept_kernel)


def triton_rejection_sample(
    target_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled [R, width] int64, num_sampled [R] int64) on the inputs' device, as
    rejection_sample_tokens computes them; width must be at least the most rows of any
    request (the engine's K + 1)."""
    if target_tokens.shape != draft_token_ids.shape:
        raise ValueError(
            f"draft_token_ids {tuple(draft_token_ids.shape)} must match target_tokens "
            f"{tuple(target_tokens.shape)}"
        )
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    R = cu_num_logits.shape[0] - 1
    dev = target_tokens.device
    sampled = torch.empty(R, width, dtype=torch.int64, device=dev)
    num_sampled = torch.empty(R, dtype=torch.int64, device=dev)
    if R > 0:
        _KERNEL[(R,)](
            target_tokens.to(torch.int64).contiguous(),
            draft_token_ids.to(torch.int64).contiguous(),
            cu_num_logits.to(torch.int64).contiguous(),
            sampled,
            num_sampled,
            sampled.stride(0),
            width,
            PAD=PAD_TOKEN_ID,
            BLOCK=next_pow2(width),
        )
    return sampled, num_sampled
