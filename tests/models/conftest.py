# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tiny Qwen3.5 checkpoints (dense and MoE, each with one MTP layer), built once per test run."""

from __future__ import annotations

import pytest

from vllm.testing import qwen3_5_checkpoints as q35


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4 layers [linear, full, linear, full], dense MLP, one random MTP layer."""
    return q35.make_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), mtp_num_hidden_layers=1)


@pytest.fixture(scope="session")
def qwen3_5_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Same layout with MoE MLPs (8 experts, top-2, gated shared expert), one MTP layer."""
    return q35.make_qwen3_5(
        tmp_path_factory.mktemp("qwen3_5_moe"), moe=True, mtp_num_hidden_layers=1, seed=1
    )


@pytest.fixture(scope="session")
def qwen3_5_self_draft_dir(tmp_path_factory: pytest.TempPathFactory, qwen3_5_dir) -> str:
    """Bigram target whose MTP head reproduces it exactly: every draft is accepted."""
    return q35.make_qwen3_5_mtp_self_draft(
        tmp_path_factory.mktemp("qwen3_5_self"), qwen3_5_dir, target_scale=0.0
    )


@pytest.fixture(scope="session")
def qwen3_5_near_self_draft_dir(tmp_path_factory: pytest.TempPathFactory, qwen3_5_dir) -> str:
    """The target keeps some of its layers (scale 0.3): drafts are partly accepted."""
    return q35.make_qwen3_5_mtp_self_draft(
        tmp_path_factory.mktemp("qwen3_5_near"), qwen3_5_dir, target_scale=0.3
    )


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: intra-op threads only contend on a shared machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
