# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""ParallelConfig: Ray is an optional extra, refused with a clear message when it is missing."""

from __future__ import annotations

import sys

import pytest

from vllm.config import ParallelConfig


def test_ray_backend_without_ray_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(
        ValueError, match=r"distributed_executor_backend='ray' needs Ray.*vllm\[ray\]"
    ):
        ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="ray")
    # The other backends never need it.
    assert ParallelConfig(pipeline_parallel_size=2).distributed_executor_backend == "mp"


def test_ray_backend_with_ray() -> None:
    pytest.importorskip("ray")
    cfg = ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert cfg.distributed_executor_backend == "ray"


def test_bad_backend_names_the_field() -> None:
    with pytest.raises(ValueError, match="distributed_executor_backend must be"):
        ParallelConfig(distributed_executor_backend="threads")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"data_parallel_size": True}, "data_parallel_size"),
        ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "data_parallel_size_local"),
        ({"data_parallel_address": " "}, "data_parallel_address"),
        ({"data_parallel_rpc_port": 70000}, "data_parallel_rpc_port"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank"),
        ({"data_parallel_size": 2, "data_parallel_backend": "threads"}, "data_parallel_backend"),
        # Ray places a replica's workers: they cannot be mp processes, nor the reverse.
        (
            {
                "data_parallel_size": 2,
                "data_parallel_backend": "ray",
                "pipeline_parallel_size": 2,
                "distributed_executor_backend": "mp",
            },
            "distributed_executor_backend",
        ),  # fmt: skip
    ],
)
def test_bad_data_parallel_fields_name_the_field(kwargs, field) -> None:
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**kwargs)


def test_data_parallel_backend_follows_the_executor() -> None:
    assert ParallelConfig(data_parallel_size=2).data_parallel_backend == "mp"
    assert not ParallelConfig().uses_dp_front_end
    assert ParallelConfig(data_parallel_size=2).uses_dp_front_end
    pytest.importorskip("ray")
    cfg = ParallelConfig(
        data_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray"
    )
    assert cfg.data_parallel_backend == "ray"
    # A Ray replica's workers default to Ray actors in the replica's placement group.
    cfg = ParallelConfig(
        data_parallel_size=2, pipeline_parallel_size=2, data_parallel_backend="ray"
    )
    assert cfg.distributed_executor_backend == "ray"
