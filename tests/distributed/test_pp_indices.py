# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Layer partitioning across pipeline stages (get_pp_indices, VLLM_PP_LAYER_PARTITION)."""

from __future__ import annotations

import pytest

from vllm.distributed.utils import get_pp_indices


def _parts(num_layers: int, pp: int) -> list[int]:
    bounds = [get_pp_indices(num_layers, r, pp) for r in range(pp)]
    assert bounds[0][0] == 0 and bounds[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), bounds  # contiguous
    return [end - start for start, end in bounds]


@pytest.mark.parametrize(
    "num_layers, pp, expected",
    [
        (10, 4, [2, 3, 3, 2]),
        (7, 2, [4, 3]),
        (45, 4, [11, 11, 12, 11]),
        (4, 4, [1, 1, 1, 1]),
        (5, 4, [1, 1, 2, 1]),
        (3, 2, [2, 1]),
        (8, 1, [8]),
    ],
)
def test_even_split_remainder_never_on_last(monkeypatch, num_layers, pp, expected):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert _parts(num_layers, pp) == expected


def test_env_partition(monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    assert _parts(4, 2) == [3, 1]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1, 5,2,2")
    assert _parts(10, 4) == [1, 5, 2, 2]


@pytest.mark.parametrize(
    "env, numbers",
    [
        ("3,2", ["sums to 5", "4 layers"]),
        ("1,1,2", ["3 entries", "is 2"]),
        ("a,b", ["'a,b'"]),
        ("4,0", ["no layers"]),
    ],
)
def test_bad_env_partition(monkeypatch, env, numbers):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", env)
    with pytest.raises(ValueError) as e:
        get_pp_indices(4, 0, 2)
    for s in numbers:
        assert s in str(e.value)


def test_more_stages_than_layers(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    with pytest.raises(ValueError, match="pipeline_parallel_size=5.*4 layers"):
        get_pp_indices(4, 0, 5)


def test_engine_config_refuses_more_stages_than_layers(llama_dir):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="pipeline_parallel_size=5.*4 layers"):
        EngineArgs.from_kwargs(model=llama_dir, pipeline_parallel_size=5).create_engine_config()


def test_engine_config_refuses_bad_env_partition(llama_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,2")
    args = EngineArgs.from_kwargs(model=llama_dir, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="sums to 5 but the model has 4 layers"):
        args.create_engine_config()
