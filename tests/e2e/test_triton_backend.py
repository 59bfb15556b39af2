# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The CUDA path's kernels end to end, on CPU: the engine with the Triton backend forced
(VLLM_ATTENTION_BACKEND=TRITON_ATTN under TRITON_INTERPRET=1: Triton attention, KV-cache write,
RMSNorm and rotary, run by Triton's interpreter) generates HF's greedy tokens on a tiny Llama
(GQA) and a tiny DeepSeek-V3 (MLA); tests/v1/worker/test_cuda_graph.py runs MTP verify rows
through it, from emulated CUDA graphs. Also: the registry's choice per device and what it
refuses, and the two backends agree on tree masks at the impl level. Slow by nature (the
interpreter runs each kernel program in Python): tiny models, short prompts, a 32-token
budget."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import hf_greedy, make_prompts

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
SMALL = dict(dtype="float32", max_model_len=64, block_size=8, max_num_seqs=2)
SMALL["max_num_batched_tokens"] = 32


@pytest.fixture
def triton_forced(monkeypatch):
    """The Triton backend: compiled on a GPU, Triton's interpreter on CPU."""
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _impls(llm: LLM) -> set[str]:
    runner = llm.llm_engine.executor.worker.model_runner
    return {type(layer.impl).__name__ for layer in runner.attn_layers.values()}


def _greedy(llm: LLM, prompts, n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@needs_triton
@pytest.mark.parametrize(
    "family, impl",
    [("llama_dir", "TritonPagedAttentionImpl"), ("deepseek_v3_dir", "TritonMLAImpl")],
)
def test_triton_backend_greedy_equals_hf(request, triton_forced, family, impl) -> None:
    path = request.getfixturevalue(family)
    prompts = make_prompts(512, [5, 19], seed=2)
    llm = LLM(model=path, **SMALL)
    try:
        assert _impls(llm) == {impl}
        out = _greedy(llm, prompts, 6)
    finally:
        llm.shutdown()
    assert out == [hf_greedy(path, p, 6) for p in prompts]


# ---- the registry ---------------------------------------------------------------------------


def test_registry_choice_per_device(monkeypatch) -> None:
    from vllm.attention.backends import registry

    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    assert registry.attention_backend_name("cpu", 64, torch.float32) == "TORCH_SDPA"
    assert registry.mla_backend_name("cpu") == "TORCH_SDPA"
    monkeypatch.setattr(registry, "HAS_TRITON", True)
    monkeypatch.setattr(registry, "flashinfer_available", lambda: False)
    assert registry.attention_backend_name("cuda", 64, torch.bfloat16) == "TRITON_ATTN"
    assert registry.mla_backend_name("cuda") == "TRITON_MLA"
    monkeypatch.setattr(registry, "flashinfer_available", lambda: True)
    assert registry.attention_backend_name("cuda", 128, torch.bfloat16) == "FLASHINFER"
    # Shapes FlashInfer does not take (head size 80, fp32) fall back to Triton.
    assert registry.attention_backend_name("cuda", 80, torch.bfloat16) == "TRITON_ATTN"
    assert registry.attention_backend_name("cuda", 128, torch.float32) == "TRITON_ATTN"
    monkeypatch.setattr(registry, "HAS_TRITON", False)
    monkeypatch.setattr(registry, "flashinfer_available", lambda: False)
    assert registry.attention_backend_name("cuda", 64, torch.bfloat16) == "TORCH_SDPA"


def test_registry_refuses_what_cannot_run(monkeypatch) -> None:
    from vllm.attention.backends import registry

    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "NOPE")
    with pytest.raises(ValueError, match="VLLM_ATTENTION_BACKEND"):
        registry.attention_backend_name("cpu", 64, torch.float32)
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="VLLM_ATTENTION_BACKEND=TRITON_ATTN"):
        registry.attention_backend_name("cpu", 64, torch.float32)
    with pytest.raises(ValueError, match="VLLM_ATTENTION_BACKEND=TRITON_MLA"):
        registry.mla_backend_name("cpu")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    monkeypatch.setattr(registry, "flashinfer_available", lambda: False)
    with pytest.raises(ValueError, match="flashinfer"):
        registry.attention_backend_name("cuda", 64, torch.bfloat16)
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "torch_sdpa")  # any case
    assert registry.attention_backend_name("cpu", 64, torch.float32) == "TORCH_SDPA"
    with pytest.raises(ValueError, match="NOPE"):
        registry.get_attention_impl_cls("NOPE")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_cpu_default_path_is_unchanged(monkeypatch, llama_dir) -> None:
    """Without VLLM_ATTENTION_BACKEND the CPU engine builds the torch reference impls, and
    RMSNorm / rotary keep their CPU kernels even under TRITON_INTERPRET=1."""
    from vllm.triton_utils import use_triton_layer_ops

    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not use_triton_layer_ops("cpu")
    llm = LLM(model=llama_dir, **SMALL)
    try:
        assert _impls(llm) == {"TorchPagedAttentionImpl"}
    finally:
        llm.shutdown()


# ---- tree masks at the impl level -----------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_tree_mask_backends_agree(monkeypatch, kind) -> None:
    """A step whose verify rows form draft trees (metadata.tree_mask): the Triton impl and the
    torch reference impl (SDPA over the gathered context with the mask) give the same rows."""
    from vllm.attention.backends.mla.torch_mla import MLADims, TorchMLAImpl
    from vllm.attention.backends.mla.triton_mla import TritonMLAImpl
    from vllm.attention.backends.torch_paged import (
        TorchPagedAttentionImpl,
        build_attn_metadata,
    )
    from vllm.attention.backends.triton_attn import TritonPagedAttentionImpl

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(0)
    q_lens, seq_lens, bs = [4, 3], [15, 9], 4
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    table = torch.randperm(16, generator=g).numpy().reshape(2, 8)
    tree = torch.zeros(2, 4, 4, dtype=torch.bool)
    for r, parents in enumerate([[-1, 0, 0, 1], [-1, 0, 0, -1]]):
        for i in range(4):
            j = i
            while j >= 0:
                tree[r, i, j] = True
                j = parents[j]
    T = int(qsl[-1])

    def meta():
        m = build_attn_metadata(qsl, np.array(seq_lens), table, bs, "cpu")
        m.tree_mask = tree
        return m

    if kind == "gqa":
        H, hkv, D = 4, 2, 16
        q = torch.randn(T, H * D, generator=g)
        k = torch.randn(T, hkv * D, generator=g)
        v = torch.randn(T, hkv * D, generator=g)
        cache = torch.randn(2, 16 * bs, hkv, D, generator=g)
        outs = [
            impl(H, D, hkv, 0.25).forward(q, k, v, cache.clone(), meta())
            for impl in (TorchPagedAttentionImpl, TritonPagedAttentionImpl)
        ]
        causal = TorchPagedAttentionImpl(H, D, hkv, 0.25).forward(
            q, k, v, cache.clone(), build_attn_metadata(qsl, np.array(seq_lens), table, bs, "cpu")
        )
    else:
        dims = MLADims(4, 8, 8, 8, 24, 0.2)
        q = torch.randn(T, 4, 32, generator=g)
        latent = torch.randn(16 * bs, 1, 32, generator=g)
        outs = [
            impl(dims).attend_latent(q, latent, meta()) for impl in (TorchMLAImpl, TritonMLAImpl)
        ]
        causal = TorchMLAImpl(dims).attend_latent(
            q, latent, build_attn_metadata(qsl, np.array(seq_lens), table, bs, "cpu")
        )
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=2e-4)
    assert not torch.allclose(outs[0], causal, atol=1e-3)


# ---- FlashInfer -----------------------------------------------------------------------------


def test_flashinfer_page_lists() -> None:
    """The CSR page lists the FlashInfer plan gets: each request's first ceil(seq_len /
    block_size) blocks, the last one's fill."""
    from vllm.attention.backends.flashinfer import page_lists
    from vllm.attention.backends.torch_paged import build_attn_metadata

    table = np.array([[7, 3, 9, 0], [2, 5, 0, 0], [4, 1, 6, 8]])
    meta = build_attn_metadata(np.array([0, 1, 4, 6]), np.array([9, 4, 13]), table, 4, "cpu")
    indptr, indices, last = page_lists(meta)
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [7, 3, 9, 2, 4, 1, 6, 8]
    assert last.tolist() == [1, 4, 1]


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="FlashInfer runs on CUDA, when installed",
)
def test_flashinfer_impl_matches_reference() -> None:
    from vllm.attention.backends.flashinfer import FlashInferAttentionImpl
    from vllm.attention.backends.torch_paged import build_attn_metadata
    from vllm.attention.ops.triton_paged_attention import paged_attention_reference

    g = torch.Generator().manual_seed(0)
    q_lens, seq_lens, bs, H, hkv, D = [1, 4, 9], [30, 17, 9], 16, 8, 2, 128
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    table = torch.randperm(12, generator=g).numpy().reshape(3, 4)
    T = int(qsl[-1])
    dt = torch.bfloat16
    q = torch.randn(T, H * D, generator=g).to(dt).cuda()
    k = torch.randn(T, hkv * D, generator=g).to(dt).cuda()
    v = torch.randn(T, hkv * D, generator=g).to(dt).cuda()
    cache = torch.randn(2, 12 * bs, hkv, D, generator=g).to(dt).cuda()
    meta = build_attn_metadata(qsl, np.array(seq_lens), table, bs, "cuda")
    out = FlashInferAttentionImpl(H, D, hkv, D**-0.5).forward(q, k, v, cache, meta)
    bt, sl, qs, _ = meta.device_layout()
    ref = paged_attention_reference(
        q.view(T, H, D), cache[0], cache[1], bt, sl, qs, D**-0.5, bs
    ).view(T, H * D)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
