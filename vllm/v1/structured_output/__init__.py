# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Structured outputs through xgrammar: grammars compiled once per (kind, spec) and tokenizer,
one matcher per request where sampling happens (the last pipeline stage)."""

from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend, get_backend

__all__ = ["XgrammarBackend", "get_backend"]
