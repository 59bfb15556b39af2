# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The EAGLE3 training tool (tools/train_eagle3_smollm2.py), loaded as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "train_eagle3_smollm2.py"


@pytest.fixture(scope="session")
def tool():
    spec = importlib.util.spec_from_file_location("train_eagle3_smollm2", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
