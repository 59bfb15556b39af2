# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The model zoo by name: bundled folders, the SmolLM2 converter behind `vllm zoo`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm.entrypoints.cli.main import main
from vllm.model_zoo import SMOLLM2_EAGLE3_DIR, smollm2_path, zoo_names, zoo_path


def test_zoo_lists_and_resolves_bundled_models(capsys):
    assert main(["zoo"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == zoo_names()
    assert {"tiny-deepseek-mtp", "smollm2-135m-eagle3", "smollm2-135m-instruct"} <= set(listed)
    assert main(["zoo", "smollm2-135m-eagle3"]) == 0
    assert capsys.readouterr().out.strip() == str(SMOLLM2_EAGLE3_DIR)
    cfg = json.loads((SMOLLM2_EAGLE3_DIR / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"


def test_unknown_zoo_name_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="unknown zoo model 'nope'"):
        zoo_path("nope")
    assert main(["zoo", "nope"]) == 2
    assert "unknown zoo model 'nope'" in capsys.readouterr().err


def test_smollm2_path_reuses_a_converted_folder(smollm2_dir):
    """An existing conversion is returned as is, not converted again."""
    weights = Path(smollm2_dir) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert smollm2_path(smollm2_dir) == smollm2_dir
    assert weights.stat().st_mtime_ns == before
