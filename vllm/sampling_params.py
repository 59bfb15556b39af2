# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""SamplingParams: how one request is sampled and when it stops (vLLM's fields and defaults)."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm.exceptions import VLLMTypeError, VLLMValidationError


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all tokens so far
    DELTA = 1  # every output carries only the new tokens
    FINAL_ONLY = 2  # one output, when the request finishes


_GREEDY_EPS = 1e-5
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_FLOAT32_MAX = 3.4028234663852886e38  # the workers keep temperatures in float32


def _is_int(v: object) -> bool:
    # bool is an int subclass, but True is not a count or a token id.
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_)
    )


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's fields): exactly one of json (a JSON
    schema, as a dict or its text), regex, choice (one of these strings), grammar (EBNF, as
    xgrammar reads it) or json_object (any JSON object)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    """JSON without free whitespace between tokens (vLLM's option): by default a JSON schema or
    object allows whitespace where JSON does, as vLLM's xgrammar backend compiles it."""
    disable_fallback: bool = False
    """Accepted for vLLM compatibility (there is one backend, nothing to fall back to)."""
    disable_additional_properties: bool = False
    """JSON schemas without "additionalProperties" allow none (vLLM's option)."""
    # The request field these came from (errors name it): structured_outputs, response_format,
    # guided_json, ... or tool_choice.
    _source: str = field(default="structured_outputs", repr=False, compare=False)
    # With a reasoning parser (and enable_in_reasoning off): (start marker id, end marker id,
    # reasoning ended before the output) - the grammar constrains only the tokens after the
    # reasoning ends. Set by the engine (or the server, which knows the chat template kwargs).
    _reasoning_gate: tuple[int | None, int, bool] | None = field(
        default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise VLLMValidationError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {kinds or 'none'}",
                parameter="structured_outputs",
            )
        checks = {
            "json": (str, dict),
            "regex": (str,),
            "grammar": (str,),
        }
        for flag in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise VLLMTypeError(
                    f"structured_outputs.{flag} must be a bool, got {getattr(self, flag)!r:.80}",
                    parameter="structured_outputs",
                )
        k = kinds[0]
        if k in checks and not isinstance(getattr(self, k), checks[k]):
            raise VLLMTypeError(
                f"structured_outputs.{k} must be {' or '.join(t.__name__ for t in checks[k])}, "
                f"got {getattr(self, k)!r:.80}",
                parameter="structured_outputs",
            )
        if k == "choice" and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise VLLMTypeError(
                f"structured_outputs.choice must be a non-empty list of strings, "
                f"got {self.choice!r:.80}",
                parameter="structured_outputs",
            )

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"


def _token_key(k: Any) -> Any:
    """A logit_bias key as a token id (JSON objects have string keys)."""
    if isinstance(k, str):
        try:
            return int(k)
        except ValueError:
            raise VLLMTypeError(
                f"SamplingParams.logit_bias keys must be token ids, got {k!r}",
                parameter="logit_bias",
                value=k,
            ) from None
    return k


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request. temperature 0 means greedy."""

    n: int = 1
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it occurs in the output (OpenAI's)."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens in the prompt or the output
    (HF's / vLLM's); 1 is off."""
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
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids can be sampled."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (xgrammar)."""
    bad_words: list[str] | None = None
    """Words never generated: a one-token word is banned outright, a longer one's last token
    is banned after its other tokens (the engine tokenizes them)."""
    logits_processors: Any = None
    """Per-request logits processor callables: not supported (as vLLM V1, which refuses them
    with a ValueError); None or an empty list only."""
    # Filled by the engine: eos id of the tokenizer, and ids that stop besides stop_token_ids.
    _eos_token_id: int | None = field(default=None, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.logits_processors:
            raise VLLMValidationError(
                "logits_processors: per-request logits processors are not supported (vLLM V1 "
                "does not support them either); use logit_bias, allowed_token_ids, bad_words "
                "or structured_outputs",
                parameter="logits_processors",
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise VLLMTypeError(
                f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}",
                parameter="stop",
                value=self.stop,
            )
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
            self.stop_token_ids or [], (list, tuple)
        ):
            raise VLLMTypeError(
                f"SamplingParams.stop_token_ids must be a list of token ids, "
                f"got {self.stop_token_ids!r}",
                parameter="stop_token_ids",
                value=self.stop_token_ids,
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k is None or (_is_int(self.top_k) and self.top_k == -1):
            self.top_k = 0
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs do nothing.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        """Check every field's type and range. Every number ends up in a 64-bit slot of a
        worker's per-request arrays, so nothing out of range may get past here."""

        def bad(name: str, value: object, why: str, kind: type = VLLMValidationError):
            # A value of the wrong type is also a TypeError, as Python would raise.
            return kind(f"SamplingParams.{name} {why}, got {value!r}", parameter=name, value=value)

        def integer(name: str, lo: int, hi: int = INT64_MAX, why: str = "") -> None:
            v = getattr(self, name)
            why = why or f"must be an integer in [{lo}, {hi}]"
            if not _is_int(v):
                raise bad(name, v, why, VLLMTypeError)
            if not lo <= v <= hi:
                raise bad(name, v, why)

        def real(name: str, lo: float, hi: float, why: str, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if not _is_real(v):
                raise bad(name, v, why, VLLMTypeError)
            if not math.isfinite(v) or not (lo < v if lo_open else lo <= v) or not v <= hi:
                raise bad(name, v, why)

        integer("n", 1)
        for name in ("presence_penalty", "frequency_penalty"):
            real(name, -2.0, 2.0, "must be in [-2, 2]")
        real("repetition_penalty", 0.0, _FLOAT32_MAX, "must be greater than zero", lo_open=True)
        real("temperature", 0.0, _FLOAT32_MAX, "must be a finite number >= 0")
        real("top_p", 0.0, 1.0, "must be in (0, 1]", lo_open=True)
        integer("top_k", -1, why="must be -1/0 (off) or a positive 64-bit integer")
        real("min_p", 0.0, 1.0, "must be in [0, 1]")
        if self.seed is not None:
            integer("seed", INT64_MIN, why="must be None or a 64-bit signed integer")
        if self.max_tokens is not None:
            integer("max_tokens", 1, why="must be None or a 64-bit integer >= 1")
        integer("min_tokens", 0, why="must be a 64-bit integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, -1, why="must be None, -1 (whole vocab) or a 64-bit integer >= 0")
        if not all(isinstance(s, str) for s in self.stop or ()):
            raise bad("stop", self.stop, "must be non-empty strings", VLLMTypeError)
        if not all(self.stop or ()):
            raise bad("stop", self.stop, "must be non-empty strings")
        ids_why = "must be non-negative 64-bit integers"
        if not all(_is_int(t) for t in self.stop_token_ids or ()):
            raise bad("stop_token_ids", self.stop_token_ids, ids_why, VLLMTypeError)
        if not all(0 <= t <= INT64_MAX for t in self.stop_token_ids or ()):
            raise bad("stop_token_ids", self.stop_token_ids, ids_why)
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "must be a bool", VLLMTypeError)
        if self.logit_bias is not None:
            lb = self.logit_bias
            if not isinstance(lb, dict) or not all(_is_int(k) for k in lb):
                raise bad("logit_bias", lb, "must be a dict of token id -> bias", VLLMTypeError)
            if not all(_is_real(v) for v in lb.values()):
                raise bad("logit_bias", lb, "must map token ids to numbers", VLLMTypeError)
            if not all(0 <= k <= INT64_MAX for k in lb) or not all(
                math.isfinite(v) for v in lb.values()
            ):
                raise bad("logit_bias", lb, "must map non-negative token ids to finite numbers")
        if self.allowed_token_ids is not None:
            a = self.allowed_token_ids
            if not isinstance(a, list) or not all(_is_int(t) for t in a):
                raise bad("allowed_token_ids", a, "must be a list of token ids", VLLMTypeError)
            if not a:
                raise bad("allowed_token_ids", a, "must not be empty")
            if not all(0 <= t <= INT64_MAX for t in a):
                raise bad("allowed_token_ids", a, ids_why)
        if self.bad_words is not None:
            bw = self.bad_words
            if not isinstance(bw, list) or not all(isinstance(w, str) for w in bw):
                raise bad("bad_words", bw, "must be a list of strings", VLLMTypeError)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", so, "must be a StructuredOutputsParams", VLLMTypeError)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "must be a RequestOutputKind", VLLMTypeError)

    def verify(self) -> None:
        """Re-check every field (the engine calls this: fields may be set after construction)."""
        if not isinstance(self.stop, list) or not isinstance(self.stop_token_ids, list):
            raise VLLMTypeError(
                "SamplingParams.stop and stop_token_ids must be lists when set after construction"
            )
        self._verify()

    @property
    def has_logit_controls(self) -> bool:
        """Whether sampling adjusts this request's logits beyond temperature / top-k / top-p /
        min-p / min_tokens (penalties, bias, allowed ids, bad words)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self._bad_words_token_ids
        )

    def update_bad_words(self, encode: Any) -> None:
        """Tokenize bad_words as vLLM does: each word as written (leading spaces stripped) and
        with one leading space, the latter only when it tokenizes to a different first token
        and the same length."""
        self._bad_words_token_ids = []
        for word in self.bad_words or ():
            for prefix_space in (False, True):
                ids = list(encode((" " if prefix_space else "") + word.lstrip()))
                if not ids:
                    continue
                if prefix_space:
                    prev = self._bad_words_token_ids[-1] if self._bad_words_token_ids else None
                    if prev is None or ids[0] == prev[0] or len(ids) != len(prev):
                        continue
                self._bad_words_token_ids.append(ids)

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def update_from_tokenizer(self, eos_token_id: int | None) -> None:
        """Record the tokenizer's EOS so the scheduler can stop on it."""
        self._eos_token_id = eos_token_id
        self._all_stop_token_ids = set(self.stop_token_ids or ())
        if eos_token_id is not None and not self.ignore_eos:
            self._all_stop_token_ids.add(eos_token_id)

    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | None = None
    ) -> None:
        """Stop on every EOS id of the model's generation_config.json besides the tokenizer's
        (models such as Llama 3 end turns with several), as vLLM does; ignore_eos keeps going."""
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        extra = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        extra.discard(eos_token_id)  # the tokenizer's own EOS is handled on its own
        if extra and not self.ignore_eos:
            self.stop_token_ids = list(dict.fromkeys([*(self.stop_token_ids or ()), *extra]))
            self._all_stop_token_ids.update(extra)

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id


@dataclass
class BeamSearchParams:
    """Beam search (`LLM.beam_search`, `use_beam_search` in requests), as vLLM's."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool = False
    """Stop a prompt once beam_width beams have finished (HF's early_stopping=True); by
    default every beam runs to max_tokens or EOS, as vLLM does."""

    def __post_init__(self) -> None:
        for name, lo in (("beam_width", 1), ("max_tokens", 1)):
            v = getattr(self, name)
            if not _is_int(v):
                raise VLLMTypeError(
                    f"BeamSearchParams.{name} must be an integer, got {v!r}", parameter=name
                )
            if not lo <= v <= INT64_MAX:
                raise VLLMValidationError(
                    f"BeamSearchParams.{name} must be >= {lo}, got {v}", parameter=name
                )
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if not _is_real(v):
                raise VLLMTypeError(
                    f"BeamSearchParams.{name} must be a number, got {v!r}", parameter=name
                )
            if not math.isfinite(v) or (name == "temperature" and v < 0):
                raise VLLMValidationError(
                    f"BeamSearchParams.{name} must be finite"
                    + (" and >= 0" if name == "temperature" else "")
                    + f", got {v}",
                    parameter=name,
                )
