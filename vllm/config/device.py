# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeviceConfig: where the model runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DeviceConfig:
    """Where the model runs."""

    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""

    def __post_init__(self) -> None:
        import torch

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
