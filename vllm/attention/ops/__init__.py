# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Attention kernels the backends call (Triton, each with its torch reference)."""
