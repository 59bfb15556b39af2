# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What a multimodal request carries from the engine to the workers (plain data, no torch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass
class MultiModalFeature:
    """One image of a prompt: its placeholder run and what the encoder needs."""

    modality: str
    identifier: str
    """sha256 of the image content: what its placeholder tokens hash by in the prefix cache."""
    offset: int
    """Index in the prompt of the first placeholder token."""
    length: int
    """Placeholder tokens (= encoder output rows)."""
    pixel_values: np.ndarray | None
    """[patches, channels * temporal_patch * patch * patch] float32, from the image processor;
    None in what a later pipeline stage receives (only the first stage runs the encoder)."""
    grid_thw: tuple[int, int, int]


@dataclass
class MultiModalInputs:
    """A prompt's images (in prompt order) and its multimodal rotary positions."""

    features: list[MultiModalFeature]
    mrope_positions: np.ndarray
    """[3, prompt_len] int64: (temporal, height, width) position of every prompt token."""
    mrope_delta: int
    """Position offset of every token after the prompt: position p rotates at p + delta."""

    def without_pixel_values(self) -> MultiModalInputs:
        """A copy whose features carry no pixel values (what stages after the first need:
        the placeholder runs and the M-RoPE positions)."""
        return dataclasses.replace(
            self, features=[dataclasses.replace(f, pixel_values=None) for f in self.features]
        )

    @property
    def pixel_bytes(self) -> int:
        return sum(f.pixel_values.nbytes for f in self.features if f.pixel_values is not None)

    def mrope_of(self, positions: np.ndarray) -> np.ndarray:
        """[3, n] M-RoPE positions of sequence positions `positions` (prompt or later)."""
        plen = self.mrope_positions.shape[1]
        out = np.repeat((positions + self.mrope_delta)[None, :], 3, axis=0)
        inside = positions < plen
        out[:, inside] = self.mrope_positions[:, positions[inside]]
        return out
