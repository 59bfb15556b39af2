# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm bench throughput` and `vllm bench latency`: offline benchmarks with an optional HF
transformers baseline run in the same process."""
