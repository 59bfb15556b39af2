# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""SamplingParams: how one request is sampled and when it stops (vLLM's fields and defaults)."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all tokens so far
    DELTA = 1  # every output carries only the new tokens
    FINAL_ONLY = 2  # one output, when the request finishes


_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request. temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine: eos id of the tokenizer, and ids that stop besides stop_token_ids.
    _eos_token_id: int | None = field(default=None, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs do nothing.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, value: object, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", self.temperature, "must be a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be -1/0 (off) or a positive integer")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer or None")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < -1):
                raise bad(name, v, "must be None, -1 (whole vocab) or an integer >= 0")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "must be a RequestOutputKind")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def update_from_tokenizer(self, eos_token_id: int | None) -> None:
        """Record the tokenizer's EOS so the scheduler can stop on it."""
        self._eos_token_id = eos_token_id
        self._all_stop_token_ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            self._all_stop_token_ids.add(eos_token_id)

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id
