# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""IntermediateTensors: the named tensors one pipeline stage hands to the next."""

from __future__ import annotations

from collections.abc import Iterator
from typing import overload

import torch


class IntermediateTensors:
    """A dict of named tensors (hidden_states, residual, aux_hidden_states_<i>, ...)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    @overload
    def __getitem__(self, key: str) -> torch.Tensor: ...

    @overload
    def __getitem__(self, key: slice) -> IntermediateTensors: ...

    def __getitem__(self, key: str | slice) -> torch.Tensor | IntermediateTensors:
        if isinstance(key, str):
            return self.tensors[key]
        return IntermediateTensors({k: v[key] for k, v in self.tensors.items()})

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IntermediateTensors) or self.keys() != other.keys():
            return False
        return all(torch.equal(v, other.tensors[k]) for k, v in self.tensors.items())

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"IntermediateTensors({shapes})"
