# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Mixture-of-experts layer pieces: the expert loop against a per-token brute force, and the
per-expert / fused checkpoint layouts against HF transformers' own expert module."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.fused_moe import (
    FusedMoE,
    fuse_experts,
    fused_moe,
    split_fused_experts,
)
from vllm.model_executor.models.utils import check_all_loaded, load_params_strict

transformers = pytest.importorskip("transformers")


def test_fused_moe_matches_per_token_loop() -> None:
    g = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 7, 12, 5, 4, 2
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g)
    w2 = torch.randn(e, h, inter, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    ref = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            gate, up = (w13[ids[i, j]] @ x[i]).split(inter)
            ref[i] += weights[i, j] * (w2[ids[i, j]] @ (torch.nn.functional.silu(gate) * up))
    out = fused_moe(x, w13, w2, weights, ids, None)  # outside a forward: BLAS
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _hf_experts(seed: int = 0):
    """HF transformers' DeepSeek-V3 experts module (fused 3-D weights), randomly filled."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    cfg = transformers.DeepseekV3Config(
        hidden_size=12, moe_intermediate_size=5, n_routed_experts=3, num_experts_per_tok=2
    )
    torch.manual_seed(seed)
    experts = DeepseekV3Experts(cfg).eval()
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    return experts


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_checkpoint_layouts_load_into_fused_moe_like_hf(layout: str) -> None:
    """HF's fused in-memory experts, written per expert (split_fused_experts) or as they are,
    load through the strict loader into FusedMoE, which then computes what HF's module does."""
    hf = _hf_experts()
    state = {f"layers.1.mlp.experts.{k}": v for k, v in hf.state_dict().items()}
    if layout == "per_expert":
        state = split_fused_experts(state)
        assert len(state) == 3 * 3  # gate, up, down per expert
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    model.layers[1].mlp = torch.nn.Module()
    model.layers[1].mlp.experts = FusedMoE(3, 12, 5)
    check_all_loaded(model, load_params_strict(model, state.items()))
    x = torch.randn(6, 12)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0], [1, 2]])
    weights = torch.rand(6, 2)
    with torch.no_grad():
        ref = hf(x, ids, weights)
        out = model.layers[1].mlp.experts(x, weights, ids, None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fuse_experts_inverts_split() -> None:
    state = {f"model.layers.1.mlp.experts.{k}": v for k, v in _hf_experts().state_dict().items()}
    state["model.layers.1.mlp.gate.weight"] = torch.ones(3, 12)
    split = split_fused_experts(state)
    assert split["model.layers.1.mlp.gate.weight"] is state["model.layers.1.mlp.gate.weight"]
    fused = fuse_experts(split)
    assert fused.keys() == state.keys()
    for k, v in state.items():
        torch.testing.assert_close(fused[k], v)
    # A layer's own state dict (nothing before `mlp.`) round-trips too.
    own = {k[len("model.layers.1.") :]: v for k, v in state.items()}
    assert fuse_experts(split_fused_experts(own)).keys() == own.keys()
