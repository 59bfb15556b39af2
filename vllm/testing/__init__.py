# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What the tests and the benchmarks share: tiny checkpoint builders (HF transformers
save_pretrained of random tiny configs, MTP / EAGLE / FP8 variants), HF reference helpers and a
`vllm serve` subprocess. The engine itself never imports this package."""
