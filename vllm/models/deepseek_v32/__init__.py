# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeepSeek-V3.2 / GLM-MoE-DSA: MLA + MoE with the DSA lightning indexer and sparse MLA."""
