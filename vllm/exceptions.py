# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The exceptions a vLLM user catches: bad request values are a `VLLMValidationError` (a
ValueError), values of the wrong type a `VLLMTypeError` (both a TypeError and a
VLLMValidationError, so either `except` clause catches it)."""

from __future__ import annotations

from typing import Any

_UNSET: Any = object()


class VLLMValidationError(ValueError):
    """A request or parameter value the engine refuses; `parameter` names the field."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = _UNSET):
        super().__init__(message)
        self.parameter = parameter
        self.value = None if value is _UNSET else value
        self.has_value = value is not _UNSET

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class VLLMTypeError(VLLMValidationError, TypeError):
    """A value of the wrong type (a string where token ids belong, a bool where a count
    belongs); it is also a TypeError, as Python itself would raise."""
