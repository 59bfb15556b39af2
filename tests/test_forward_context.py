# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The per-forward context is an explicit argument: no ambient state in vllm/ (no context
variable or thread-local outside the build-time BuildContext, no `global` rebinding in the hot
path's modules); every linear product requires its rows' kinds (forgetting them is a TypeError,
never a silent switch to BLAS); the kinds passed decide the route (the small-M kernel or BLAS)
for the same rows; and a forward nested inside another (a draft's inside a target's) leaves the
outer one's context untouched, on a real tiny Llama."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm import _custom_ops as ops
from vllm.attention.backends.torch_paged import build_attn_metadata
from vllm.config import ModelConfig, VllmConfig
from vllm.forward_context import ALL_LONG, ALL_SHORT, ForwardContext
from vllm.model_executor.layers import gemm
from vllm.model_executor.layers.attention import AttentionLayerBase
from vllm.model_executor.layers.fused_moe import FusedMoE, fused_moe
from vllm.model_executor.model_loader import get_model
from vllm.testing.checkpoints import make_llama

ROOT = Path(__file__).resolve().parents[1] / "vllm"
# Build time only: the loader sets it around a model's construction; no forward reads it.
BUILD_TIME_ONLY = {ROOT / "model_executor" / "build_context.py"}
# The modules a forward runs through: no `global` rebinding there (a swapped module global).
HOT_PATH = [
    ROOT / "forward_context.py",
    ROOT / "model_executor" / "layers",
    ROOT / "model_executor" / "models",
    ROOT / "models",
    ROOT / "attention",
    ROOT / "v1" / "worker" / "gpu",
]
BLOCK_SIZE = 4
NUM_BLOCKS = 16


def _ambient_state(path: Path) -> list[str]:
    """Context variables and thread-locals a module creates or imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "contextvars"]
        elif isinstance(node, ast.ImportFrom):
            if node.module == "contextvars" or (
                node.module == "threading" and any(a.name == "local" for a in node.names)
            ):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in ("local", "ContextVar"):
            if isinstance(node.value, ast.Name) and node.value.id in ("threading", "contextvars"):
                found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "ContextVar":
            found.append("ContextVar")
    return [f"{path.relative_to(ROOT.parent)}: {f}" for f in found]


def test_no_context_variable_or_thread_local_on_the_hot_path() -> None:
    files = sorted(ROOT.rglob("*.py"))
    assert ROOT / "forward_context.py" in files
    found = [f for p in files if p not in BUILD_TIME_ONLY for f in _ambient_state(p)]
    assert found == [], found
    # The scan sees the one allowed use, so it would see another.
    assert _ambient_state(next(iter(BUILD_TIME_ONLY)))
    rebinding = []
    for top in HOT_PATH:
        for p in sorted(top.rglob("*.py")) if top.is_dir() else [top]:
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                if isinstance(node, ast.Global):
                    rebinding.append(f"{p.relative_to(ROOT.parent)}: global {node.names}")
    assert rebinding == [], rebinding


# --------------------------------------------------------------------------- a real model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    if os.environ.get("VLLM_CPU_KERNELS", "1") == "0" or not ops.cpu_kernels_available():
        pytest.skip("the CPU small-M kernel is off or did not build")
    path = make_llama(tmp_path_factory.mktemp("llama"), num_hidden_layers=2)
    model = get_model(VllmConfig(model_config=ModelConfig(model=path)), device="cpu")
    for m in model.modules():
        if isinstance(m, AttentionLayerBase):
            m.kv_cache = torch.zeros(m.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))
    return model


def _clear_cache(model) -> None:
    for m in model.modules():
        if isinstance(m, AttentionLayerBase) and m.kv_cache is not None:
            m.kv_cache.zero_()


def _linears(model) -> dict[str, torch.nn.Module]:
    layer = model.model.layers[0]
    return {
        "qkv_proj": layer.self_attn.qkv_proj,
        "o_proj": layer.self_attn.o_proj,
        "gate_up_proj": layer.mlp.gate_up_proj,
        "down_proj": layer.mlp.down_proj,
        "lm_head": model.lm_head,
    }


@pytest.fixture
def kernel_calls(monkeypatch):
    """The row count of every small-M kernel call (a spy: it records, then runs the kernel)."""
    calls: list[int] = []
    real = gemm.linear_small_m

    def spy(x, weight, bias):
        calls.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(gemm, "linear_small_m", spy)
    return calls


def test_a_linear_product_without_its_rows_kinds_is_a_type_error(llama) -> None:
    x = torch.randn(3, llama.config.hidden_size)
    for name, layer in _linears(llama).items():
        with pytest.raises(TypeError):
            layer(x)
        layer(x if name != "down_proj" else torch.randn(3, layer.in_features), None)  # legal
    w = torch.randn(5, x.shape[1])
    with pytest.raises(TypeError):
        gemm.linear(x, w)
    with pytest.raises(TypeError):
        gemm.linear(x, w, None)
    with pytest.raises(TypeError):
        llama.compute_logits(x)
    with pytest.raises(TypeError):
        llama(torch.zeros(3, dtype=torch.long), torch.arange(3))  # the forward needs ctx
    experts = FusedMoE(2, x.shape[1], 4)
    ids, weights = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(TypeError):
        experts(x, weights, ids)
    with pytest.raises(TypeError):
        fused_moe(x, experts.w13_weight, experts.w2_weight, weights, ids)


def _meta(q_lens: list[int], first_block: int, short_query_len: int, start: int = 0):
    """Requests of q_lens new tokens after `start` cached ones, request r in blocks
    first_block + 4r .. (their own, so forwards of different metas write apart)."""
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    table = first_block + 4 * np.arange(len(q_lens))[:, None] + np.arange(4)[None, :]
    return build_attn_metadata(
        qsl,
        np.array(q_lens) + start,
        table,
        BLOCK_SIZE,
        torch.device("cpu"),
        short_query_len=short_query_len,
    )


def _positions(q_lens: list[int], start: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([np.arange(start, start + q) for q in q_lens]))


def test_the_rows_kinds_passed_decide_the_route(llama, kernel_calls) -> None:
    """The same rows, through a layer and through the model: all-decode kinds take the small-M
    kernel, prefill kinds (or None) take BLAS; what decides is the argument alone."""
    g = torch.Generator().manual_seed(0)
    h = llama.config.hidden_size
    x = torch.randn(3, h, generator=g)
    for name, layer in _linears(llama).items():
        xin = x if name != "down_proj" else torch.randn(3, layer.in_features, generator=g)
        kernel_calls.clear()
        y_kernel = layer(xin, ALL_SHORT)
        assert kernel_calls == [3], name
        kernel_calls.clear()
        y_blas = layer(xin, ALL_LONG)
        assert layer(xin, None).shape == y_blas.shape
        assert kernel_calls == [], name
        torch.testing.assert_close(y_kernel, y_blas, atol=1e-4, rtol=1e-4)
    # A model forward over three one-token decode rows (two tokens cached per request).
    ids = torch.tensor([3, 5, 7])
    ctx = ForwardContext(_meta([1, 1, 1], 0, short_query_len=1, start=2))
    outs = {}
    num_linears = 4 * len(llama.model.layers)  # qkv, o, gate_up, down per layer
    for kinds, ctx_used, expected in [
        ("decode", ctx, [3] * num_linears),
        ("prefill", ctx.with_rows(ALL_LONG), []),
    ]:
        _clear_cache(llama)
        kernel_calls.clear()
        with torch.no_grad():
            outs[kinds] = llama(ids, _positions([1, 1, 1], 2), ctx=ctx_used)
        assert kernel_calls == expected, kinds
    torch.testing.assert_close(outs["decode"], outs["prefill"], atol=1e-4, rtol=1e-4)


def test_a_nested_forward_leaves_the_outer_forwards_context_alone(llama, kernel_calls) -> None:
    """A draft-like forward (two one-token decode rows, its own blocks) run from inside a
    target-like forward (a 6-token prefill chunk) halfway through its layers: each computes
    exactly what it computes alone, each on its own route (the target's rows stay BLAS after
    the nested forward's decode rows took the kernel)."""
    target_ids = torch.tensor([1, 4, 9, 16, 25, 36])
    draft_ids = torch.tensor([2, 3])
    target_ctx = ForwardContext(_meta([6], 0, short_query_len=1))
    target_pos = _positions([6])
    draft_pos = _positions([1, 1], 3)

    def target() -> torch.Tensor:
        return llama(target_ids, target_pos, ctx=target_ctx)

    def draft() -> torch.Tensor:
        # Built while the target's context object exists (and its forward is running).
        return llama(draft_ids, draft_pos, ctx=ForwardContext(_meta([1, 1], 8, 1, start=3)))

    with torch.no_grad():
        _clear_cache(llama)
        target_alone = target()
        _clear_cache(llama)
        kernel_calls.clear()
        draft_alone = draft()
        assert kernel_calls == [2] * (4 * len(llama.model.layers))

        _clear_cache(llama)
        kernel_calls.clear()
        nested: list[torch.Tensor] = []

        def run_draft_once(*_) -> None:
            if not nested:  # the hook fires in the draft's own layer 0 too
                nested.append(torch.empty(0))
                nested[0] = draft()

        hook = llama.model.layers[0].register_forward_hook(run_draft_once)
        try:
            target_nested = target()
        finally:
            hook.remove()
    assert len(nested) == 1
    assert torch.equal(target_nested, target_alone)
    assert torch.equal(nested[0], draft_alone)
    # Only the draft's rows took the kernel; every one of the target's 6 rows went to BLAS.
    assert kernel_calls == [2] * (4 * len(llama.model.layers))
    assert target_ctx.attn_metadata.num_tokens == 6 and target_ctx.rows.all_long
