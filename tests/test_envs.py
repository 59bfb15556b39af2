# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""vllm/envs.py is the only reader of the environment: every variable documented, read on
access, and a malformed value refused with the variable's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vllm
from vllm import envs

PACKAGE = Path(vllm.__file__).parent

# A malformed value of every variable that has a form to check.
BAD_VALUES = {
    "VLLM_TEST_FAULT_RAISE": "1:x",
    "VLLM_PP_STEP_TIMEOUT_S": "-1",
    "VLLM_PP_COMM_TIMEOUT_S": "soon",
    "VLLM_CHAT_TEMPLATE_TIMEOUT_S": "inf",
    "VLLM_CPU_KVCACHE_SPACE": "0",
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "VLLM_FP8_DEQUANT": "sometimes",
    "VLLM_CPU_LINEAR_ISA": "sse9",
    "VLLM_CPU_PREFILL_ATTN_ISA": "amx",
    "VLLM_CPU_PREFILL_GEMM": "cublas",
    "VLLM_STEP_COST_BUDGET_S": "0",
    "VLLM_LOGGING_LEVEL": "LOUD",
    "TRITON_INTERPRET": "maybe",
    "VLLM_CPU_KERNELS": "perhaps",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "perhaps",
    "VLLM_CPU_ONEDNN_CACHE_CAPACITY": "many",
    "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
    "VLLM_DP_CPU_BIND": "0-|1",
    "VLLM_RAY_PER_WORKER_CPUS": "0",
    "VLLM_RAY_PLACEMENT_TIMEOUT_S": "never",
}
FREE_TEXT = {
    "VLLM_PP_LAYER_PARTITION",  # checked against P and the layer count (test_pp_indices)
    "VLLM_SPARSE_MLA_BACKEND",  # checked against the backend registry
    "VLLM_API_KEY",
    "VLLM_CPU_KERNELS_BUILD_DIR",
    "VLLM_BENCH_CACHE",
    "VLLM_CACHE_ROOT",
    "XDG_CACHE_HOME",
    "RAY_ADDRESS",
    "VLLM_HOST_IP",  # an address gloo binds to: checked when the worker binds it
    "OMP_NUM_THREADS",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY",  # oneDNN's own
    "LRU_CACHE_CAPACITY",  # PyTorch ideep's own
}


def _python_files() -> list[Path]:
    """The engine's modules: all of vllm/ but envs.py itself and vllm/testing (the tests' and
    benchmarks' tooling, which sets up environments for the processes it starts)."""
    return sorted(
        p
        for p in PACKAGE.rglob("*.py")
        if p != PACKAGE / "envs.py" and PACKAGE / "testing" not in p.parents
    )


def test_every_variable_is_documented_and_checked() -> None:
    assert set(envs.ENV_VARS) == set(BAD_VALUES) | FREE_TEXT
    for var in envs.ENV_VARS.values():
        assert len(var.doc) > 20, var.name


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_malformed_value_names_the_variable(monkeypatch, name) -> None:
    monkeypatch.setenv(name, BAD_VALUES[name])
    with pytest.raises(ValueError, match=name):
        getattr(envs, name)


@pytest.mark.parametrize("name", sorted(envs.ENV_VARS))
def test_unset_or_empty_is_the_default(monkeypatch, name) -> None:
    monkeypatch.delenv(name, raising=False)
    default = getattr(envs, name)
    assert default == envs.ENV_VARS[name].default
    monkeypatch.setenv(name, "  ")
    assert getattr(envs, name) == default


def test_values_are_read_on_access(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_PP_STEP_TIMEOUT_S", "7.5")
    assert envs.VLLM_PP_STEP_TIMEOUT_S == 7.5
    monkeypatch.setenv("VLLM_PP_STEP_TIMEOUT_S", "9")
    assert envs.VLLM_PP_STEP_TIMEOUT_S == 9.0
    monkeypatch.setenv("VLLM_FP8_DEQUANT", " Forward ")
    assert envs.VLLM_FP8_DEQUANT == "forward"
    with pytest.raises(AttributeError, match="VLLM_NOT_A_VARIABLE"):
        envs.VLLM_NOT_A_VARIABLE  # noqa: B018


def test_no_module_but_envs_reads_the_environment() -> None:
    readers = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("environ", "getenv", "environb", "putenv")
            ):
                readers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert readers == []


def test_every_variable_used_is_declared() -> None:
    used = set()
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "envs"
                and node.attr.isupper()
            ):
                used.add(node.attr)
    assert used and used <= set(envs.ENV_VARS)


def test_vllm_env_round_trip(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    saved = envs.vllm_env()
    assert saved["VLLM_PP_LAYER_PARTITION"] == "3,1"
    monkeypatch.setenv("VLLM_API_KEY", "leaked")
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,2")
    envs.apply_vllm_env(saved)
    assert envs.VLLM_API_KEY is None and envs.VLLM_PP_LAYER_PARTITION == "3,1"
