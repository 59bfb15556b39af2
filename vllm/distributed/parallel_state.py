# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Pipeline-parallel group state of this process.

With P = 1 (no torch.distributed) the group is the trivial one. Worker processes of a P > 1 run
call init_pp_group(...) before building the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PPGroup:
    rank: int = 0
    world_size: int = 1
    device_group: Any = field(default=None, repr=False)  # torch.distributed group for p2p
    broadcast_group: Any = field(default=None, repr=False)  # separate group for last-stage results

    @property
    def rank_in_group(self) -> int:
        return self.rank

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    @property
    def last_rank(self) -> int:
        return self.world_size - 1


_PP: PPGroup = PPGroup()


def get_pp_group() -> PPGroup:
    return _PP


def set_pp_group(group: PPGroup) -> None:
    global _PP
    _PP = group


def model_parallel_is_initialized() -> bool:
    return _PP.world_size > 1
