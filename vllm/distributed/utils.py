# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Layer partitioning across pipeline stages."""

from __future__ import annotations

from vllm import envs
from vllm.logger import init_logger

logger = init_logger(__name__)


def get_pp_partition(num_hidden_layers: int, pp_size: int) -> list[int]:
    """Layers per stage: VLLM_PP_LAYER_PARTITION if set, else an even split whose remainder
    goes to stages -2, -3, ... (never the last, which also runs the norm, head and drafter)."""
    if pp_size > num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} is larger than the model's "
            f"{num_hidden_layers} layers"
        )
    env = envs.VLLM_PP_LAYER_PARTITION
    if env:
        try:
            parts = [int(x) for x in env.split(",")]
        except ValueError as e:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={env!r} is not a comma list of ints") from e
        if len(parts) != pp_size:
            raise ValueError(
                f"VLLM_PP_LAYER_PARTITION={env!r} has {len(parts)} entries but "
                f"pipeline_parallel_size is {pp_size}"
            )
        if sum(parts) != num_hidden_layers:
            raise ValueError(
                f"VLLM_PP_LAYER_PARTITION={env!r} sums to {sum(parts)} but the model has "
                f"{num_hidden_layers} layers"
            )
        if any(p < 1 for p in parts):
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={env!r} gives a stage no layers")
        return parts
    parts = [num_hidden_layers // pp_size] * pp_size
    for i in range(num_hidden_layers % pp_size):
        parts[-2 - i] += 1
    return parts


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage pp_rank owns."""
    parts = get_pp_partition(num_hidden_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]
