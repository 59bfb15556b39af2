# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Errors the engine front ends raise (shared by AsyncLLM and the data-parallel front end)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop stopped (it crashed or was shut down); no request can be served."""
