# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Multimodal inputs: images parsed and checked at the edge, the checkpoint's own image
processor, placeholder expansion, content hashes and M-RoPE positions (processing.py)."""

from vllm.multimodal.inputs import MultiModalFeature, MultiModalInputs

__all__ = ["MultiModalFeature", "MultiModalInputs"]
