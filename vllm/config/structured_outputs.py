# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""StructuredOutputsConfig: the engine-wide structured-output settings (vLLM's
structured_outputs_config)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    """How requests' grammars are compiled (the part of vLLM's StructuredOutputsConfig this
    engine has)."""

    backend: str = "auto"
    """The grammar backend: "auto" or "xgrammar" (the one this engine has)."""
    disable_any_whitespace: bool = False
    """JSON grammars without free whitespace, for every request (a request can also ask for
    it in its own structured_outputs)."""
    disable_additional_properties: bool = False
    """JSON schemas without "additionalProperties" allow none, for every request."""
    disable_fallback: bool = False
    """Accepted for vLLM compatibility: there is no other backend to fall back to."""
    reasoning_parser: str = ""
    """The reasoning parser (deepseek_r1, deepseek_v3, qwen3; --reasoning-parser): the server
    splits reasoning_content from content, and a grammar applies only after the reasoning."""
    enable_in_reasoning: bool = False
    """Constrain the reasoning too (by default the grammar starts after the end of reasoning,
    as vLLM's)."""

    @classmethod
    def from_dict(
        cls, d: dict[str, Any] | StructuredOutputsConfig | None
    ) -> StructuredOutputsConfig:
        if d is None:
            return cls()
        if isinstance(d, StructuredOutputsConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs_config must be a dict, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = set(d) - set(names)
        if unknown:
            raise ValueError(
                f"structured_outputs_config has unsupported key(s) {sorted(unknown)}; "
                f"supported: {names}"
            )
        return cls(**d)

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of {STRUCTURED_OUTPUT_BACKENDS}, "
                f"got {self.backend!r}"
            )
        if self.reasoning_parser:
            from vllm.reasoning import REASONING_PARSERS

            if self.reasoning_parser not in REASONING_PARSERS:
                raise ValueError(
                    f"unknown reasoning parser {self.reasoning_parser!r}; supported: "
                    f"{', '.join(REASONING_PARSERS)}"
                )
        for name in (
            "disable_any_whitespace",
            "disable_additional_properties",
            "disable_fallback",
            "enable_in_reasoning",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"structured_outputs_config.{name} must be a bool, got {getattr(self, name)!r}"
                )
