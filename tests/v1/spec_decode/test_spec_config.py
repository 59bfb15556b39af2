# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""speculative_config validation: bad configs fail at LLM construction naming the key."""

from __future__ import annotations

import logging

import pytest

from vllm import LLM
from vllm.config import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs


def _config(model: str, spec: dict):
    return EngineArgs(
        model=model, max_model_len=128, speculative_config=spec
    ).create_engine_config()


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 1.5}, "num_speculative_tokens"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "mtp", "draft_sample_method": "nucleus"}, "draft_sample_method"),
        ({"method": "mtp", "num_speculative_tokenz": 2}, "unknown key"),
    ],
)
def test_bad_config_raises_naming_the_key(deepseek_v3_mtp1_dir, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=deepseek_v3_mtp1_dir, speculative_config=spec)


@pytest.mark.parametrize("target", ["llama_dir", "deepseek_v3_dir"])
def test_mtp_needs_mtp_layers(request, target):
    with pytest.raises(
        ValueError, match=r"speculative_config\.method='mtp' needs a target with MTP"
    ):
        LLM(
            model=request.getfixturevalue(target),
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        )


def test_old_mtp_spellings_map_to_mtp(deepseek_v3_mtp1_dir):
    for alias in ("deepseek_mtp", "qwen3_5_mtp"):
        assert SpeculativeConfig(method=alias).method == "mtp"
    cfg = _config(deepseek_v3_mtp1_dir, {"method": "deepseek_mtp", "num_speculative_tokens": 1})
    assert cfg.speculative_config.method == "mtp"
    assert cfg.speculative_config.draft_model_config.architecture == "DeepSeekMTPModel"
    assert cfg.model_config.architecture == "DeepseekV3ForCausalLM"


def test_more_steps_than_mtp_layers_warns(deepseek_v3_mtp1_dir, caplog):
    with caplog.at_level(logging.WARNING):
        _config(deepseek_v3_mtp1_dir, {"method": "mtp", "num_speculative_tokens": 3})
    assert "acceptance decays" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _config(deepseek_v3_mtp1_dir, {"method": "mtp", "num_speculative_tokens": 1})
    assert "acceptance decays" not in caplog.text


def _eagle_variant(src: str, dst, **cfg) -> str:
    from vllm.testing.checkpoints import copy_checkpoint

    return copy_checkpoint(src, dst, cfg)


def test_eagle1_config_maps_to_the_eagle_llama_draft(llama_dir, tmp_path):
    from vllm.testing.spec_checkpoints import make_eagle_draft

    draft = make_eagle_draft(tmp_path / "d", llama_dir)
    cfg = _config(llama_dir, {"method": "eagle", "model": draft, "num_speculative_tokens": 2})
    assert cfg.speculative_config.draft_model_config.architecture == "EagleLlamaForCausalLM"


@pytest.mark.parametrize(
    "case, match",
    [
        ("eagle3_layout", r"method='eagle' \(EAGLE-1\) needs a draft whose config.json names"),
        ("deepseek_target", r"supports targets \['LlamaForCausalLM', 'Qwen2ForCausalLM'\]"),
        ("hidden_mismatch", "has hidden_size=32 but the target's is 64"),
        ("no_layers", "num_hidden_layers must be an integer >= 1"),
    ],
)
def test_eagle1_bad_configs_raise_at_construction(
    llama_dir, deepseek_v3_dir, tmp_path, case, match
):
    from vllm.testing.spec_checkpoints import make_eagle3_draft, make_eagle_draft

    target = llama_dir
    if case == "eagle3_layout":
        draft = make_eagle3_draft(tmp_path / "d", llama_dir)
    else:
        draft = make_eagle_draft(tmp_path / "base", llama_dir)
        if case == "deepseek_target":
            target = deepseek_v3_dir
        elif case == "hidden_mismatch":
            draft = _eagle_variant(draft, tmp_path / "d", hidden_size=32)
        else:
            draft = _eagle_variant(draft, tmp_path / "d", num_hidden_layers=0)
    with pytest.raises(ValueError, match=match):
        LLM(
            model=target,
            max_model_len=128,
            speculative_config={"method": "eagle", "model": draft, "num_speculative_tokens": 1},
        )
