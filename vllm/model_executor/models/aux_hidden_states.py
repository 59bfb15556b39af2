# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EAGLE3 aux hidden states across pipeline stages, in one place.

Tap L is the residual stream entering decoder layer L (hidden + residual after layer L - 1; tap
0 is the embedding output, tap num_layers the stream before the final norm). Under pipeline
parallelism every stage sends its taps on in IntermediateTensors slots `aux_hidden_states_<i>`,
numbered globally in tap order. A stage's AuxSlotLayout says which slots it receives (what its
receive buffer reserves), and packs its own taps, relays the upstream slots (a middle stage) or
collects them before its own (the last stage). A slot that did not arrive is an error, never
zeros.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vllm.distributed.parallel_state import get_pp_group
from vllm.sequence import IntermediateTensors

AUX_HIDDEN_STATE_KEY = "aux_hidden_states_"


def aux_slot_key(i: int) -> str:
    return f"{AUX_HIDDEN_STATE_KEY}{i}"


@dataclass(frozen=True)
class AuxSlotLayout:
    """The aux slots of one pipeline stage of a decoder tapping `taps` (sorted)."""

    taps: tuple[int, ...] = ()
    base: int = 0
    """Slots produced by the stages before this one: this stage's taps fill base, base + 1..."""
    relays: bool = False
    """A middle stage: it forwards the upstream slots with its own."""
    collects: bool = False
    """The last of several stages: it returns the upstream taps before its own."""

    @classmethod
    def for_stage(cls, taps: Iterable[int], start_layer: int) -> AuxSlotLayout:
        """The layout of this process's stage, whose first layer is start_layer."""
        ordered = tuple(sorted({int(t) for t in taps}))
        pp = get_pp_group()
        if pp.world_size < 2 or pp.is_first_rank:
            return cls(ordered)
        # A tap equal to this stage's first layer is the stream the previous stage sends, so it
        # was taken upstream.
        base = bisect_right(ordered, start_layer)
        return cls(ordered, base, relays=not pp.is_last_rank, collects=pp.is_last_rank)

    def upstream_keys(self) -> tuple[str, ...]:
        """The slots this stage receives (its receive buffer must hold exactly these)."""
        return tuple(aux_slot_key(i) for i in range(self.base))

    def tap(
        self,
        aux: list[torch.Tensor],
        layer_idx: int,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> None:
        """Append the stream entering layer_idx to aux when it is a tap."""
        if layer_idx in self.taps:
            # A fresh tensor: later layers must not be able to change what was tapped.
            aux.append(hidden + residual if residual is not None else hidden.clone())

    def pack(self, local: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """This stage's taps in their global slots."""
        return {aux_slot_key(self.base + i): t for i, t in enumerate(local)}

    def _upstream(self, received: IntermediateTensors | None, what: str) -> list[torch.Tensor]:
        out = []
        for key in self.upstream_keys():
            if received is None or key not in received:
                raise RuntimeError(
                    f"Missing {key} in the intermediate tensors from the previous stage "
                    f"{what} (expected {self.base} upstream aux hidden states for taps "
                    f"{self.taps})"
                )
            out.append(received[key])
        return out

    def relay(self, received: IntermediateTensors | None) -> dict[str, torch.Tensor]:
        """A middle stage's upstream slots, to send on unchanged (the runner copies what it
        sends out of its receive buffers)."""
        if not self.relays:
            return {}
        slots = self._upstream(received, "to relay")
        return {aux_slot_key(i): t for i, t in enumerate(slots)}

    def collect(self, received: IntermediateTensors | None) -> list[torch.Tensor]:
        """The last stage's upstream taps, in tap order (they come before its own)."""
        if not self.collects:
            return []
        return self._upstream(received, "to collect")
