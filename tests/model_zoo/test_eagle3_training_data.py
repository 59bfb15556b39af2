# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The bundled EAGLE3 head's training prompts (tools/train_eagle3_smollm2.py): the held-out split
shipped with the head is what the tool builds, no training prompt mentions a held-out filler,
and the first head's prompts stay the prefix of the list (so its chunks are reproducible)."""

from __future__ import annotations

import json
import re

import pytest

from vllm.model_zoo import SMOLLM2_EAGLE3_DIR


def test_heldout_split_is_the_shipped_one(tool):
    train, heldout = tool.build_prompts()
    assert heldout == json.loads((SMOLLM2_EAGLE3_DIR / "heldout_prompts.json").read_text())
    assert not set(train) & set(heldout)
    assert len(train) == len(set(train)) > 8 * 1278


def test_no_training_prompt_mentions_a_heldout_filler(tool):
    train, heldout = tool.build_prompts()
    base, base_heldout, held_fillers = tool._base_prompts(tool.SEED, 48)
    assert base_heldout == heldout
    assert train[: len(base)] == base  # the first head's prompts, unchanged and first
    pattern = re.compile(
        "|".join(r"\b" + re.escape(f.lower()) + r"\b" for f in held_fillers), re.IGNORECASE
    )
    extra = train[len(base) :]
    assert not [p for p in extra if pattern.search(p)]


def test_chunk_ranges_select_the_asked_chunks(tool, tmp_path):
    """--first-chunk / --num-chunks: generate and train read the same chunks, and a missing
    one is named rather than silently skipped (a continued run trains on new chunks only)."""
    import torch

    assert tool._chunk_starts(1000, 128, 0, None) == [0, 128, 256, 384, 512, 640, 768, 896]
    assert tool._chunk_starts(1000, 128, 2, 3) == [256, 384, 512]
    assert tool._chunk_starts(1000, 128, 7, 5) == [896]
    (tmp_path / "feat").mkdir()
    for i in (0, 1, 2, 4):
        torch.save([{"chunk": i}], tmp_path / "feat" / f"{i * 128:05d}.pt")
    assert [s["chunk"] for s in tool.load_features(tmp_path, 2, 1)] == [1, 2]
    assert [s["chunk"] for s in tool.load_features(tmp_path, None, 2)] == [2, 4]
    assert [s["chunk"] for s in tool.load_features(tmp_path, 3)] == [0, 1, 2]
    with pytest.raises(SystemExit, match=r"no features for chunks \[3\]"):
        tool.load_features(tmp_path, 3, 2)
