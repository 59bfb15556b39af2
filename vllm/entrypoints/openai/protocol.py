# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Pydantic models of the OpenAI-compatible API: the shared request fields and value types, errors,
the model list and the completions endpoint (chat completions: chat_protocol.py)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from vllm.entrypoints.openai.field_rules import refuse_unsupported, warn_unknown
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_N = 16
"""Most completions one request may ask for (`n`)."""


def _not_bool(v: Any) -> Any:
    # JSON true/false would otherwise pass as the integers 1/0.
    if isinstance(v, bool):
        raise ValueError("must be an integer, not a boolean")
    return v


# Every integer a request carries ends up in a 64-bit slot of a worker: bound it here, where the
# error can name the field, never inside a stage.
Int64 = Annotated[int, BeforeValidator(_not_bool), Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt64 = Annotated[int, BeforeValidator(_not_bool), Field(ge=0, le=INT64_MAX)]
TopK = Annotated[int, BeforeValidator(_not_bool), Field(ge=-1, le=INT64_MAX)]
# -1 = the whole vocabulary; the engine refuses more than its max_logprobs (--max-logprobs).
NumLogprobs = Annotated[int, BeforeValidator(_not_bool), Field(ge=-1, le=INT64_MAX)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]

_PROMPT_SHAPES = (
    "must be a string, a list of strings, a list of token ids (integers) "
    "or a list of token-id lists"
)


def _check_token_ids(ids: list, where: str) -> None:
    for j, t in enumerate(ids):
        if type(t) is not int:
            kind = "a boolean" if isinstance(t, bool) else type(t).__name__
            raise ValueError(f"{where}[{j}] must be a token id (an integer), got {kind}")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Clients send fields nobody models (metadata, ...); ignore them with a warning, as vLLM.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="wrap")
    @classmethod
    def _warn_unknown_fields(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if cls.model_config.get("extra") == "ignore":
            warn_unknown(cls.__name__, data, set(cls.model_fields))
        return result


# ---- errors ---------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- models ---------------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---- shared request pieces ------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


# Clients send `null` for options they leave at the default; for these that means the default.
_NULL_MEANS_DEFAULT = (
    "n",
    "stream",
    "ignore_eos",
    "echo",
    "logprobs",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "add_generation_prompt",
    "continue_final_message",
    "spaces_between_special_tokens",
    "priority",
    "use_beam_search",
    "length_penalty",
    "early_stopping",
    "add_special_tokens",
    "include_reasoning",
)


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        refuse_unsupported(data, cls.model_fields)
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULL_MEANS_DEFAULT}
        return data

    model: str | None = None
    n: Annotated[int, BeforeValidator(_not_bool), Field(ge=1, le=MAX_N)] = 1
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: TopK | None = None
    min_p: FiniteFloat | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt64] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: FiniteFloat | None = 0.0
    frequency_penalty: FiniteFloat | None = 0.0
    repetition_penalty: FiniteFloat | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    allowed_token_ids: list[NonNegInt64] | None = None
    bad_words: list[str] | None = None
    best_of: Int64 | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # ---- vLLM's extra request fields, implemented here --------------------------------------
    spaces_between_special_tokens: bool = True
    prompt_logprobs: NumLogprobs | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    priority: Int64 = 0
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    session_id: str | None = None  # an identity for routing / tracing; it changes no output
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    use_beam_search: bool = False
    length_penalty: FiniteFloat = 1.0
    early_stopping: bool = False
    # Only the /render endpoints read these; vLLM ignores them on generation too.
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool = True

    def _check_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of != n is not supported (best_of={self.best_of}, n={self.n})")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs != 0:
            raise VLLMValidationError(
                "prompt_logprobs are not available when stream is true",
                parameter="prompt_logprobs",
            )
        if not self.use_beam_search and (self.length_penalty != 1.0 or self.early_stopping):
            name = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
            raise VLLMValidationError(
                f"{name} only applies to beam search (use_beam_search=true)", parameter=name
            )

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The request's grammar: vLLM's structured_outputs, its older guided_* fields, or
        OpenAI's response_format (json_object / json_schema); at most one of them."""
        found: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs:
            found.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        rf = self.response_format
        if rf:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise VLLMValidationError(
                        "response_format json_schema needs json_schema.schema (an object)",
                        parameter="response_format",
                    )
                found.append(("response_format", {"json": schema}))
            elif kind not in (None, "text"):
                raise VLLMValidationError(
                    f"response_format type {kind!r} is not supported "
                    "(text, json_object, json_schema)",
                    parameter="response_format",
                )
        if not found:
            return None
        if len(found) > 1:
            names = [n for n, _ in found]
            raise VLLMValidationError(
                f"only one of {names} may constrain the output", parameter=names[0]
            )
        name, fields = found[0]
        known = {
            "json",
            "regex",
            "choice",
            "grammar",
            "json_object",
            "disable_fallback",
            "disable_any_whitespace",
            "disable_additional_properties",
        }
        extra = set(fields) - known
        if extra:
            raise VLLMValidationError(
                f"{name}: unsupported keys {sorted(extra)} (supported: {sorted(known)})",
                parameter=name,
            )
        try:
            kw = {k: v for k, v in fields.items() if k in known}
            return StructuredOutputsParams(**kw, _source=name)
        except ValueError as e:  # TypeError is a ValueError subclass here (VLLMTypeError)
            raise VLLMValidationError(f"{name}: {e}", parameter=name) from None

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        self._check_unsupported()
        if structured_outputs is None:
            structured_outputs = self._structured_outputs()
        kwargs: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                kwargs[name] = v
        logit_bias = None
        if self.logit_bias:
            # As vLLM / OpenAI: token id strings, biases clamped to [-100, 100].
            logit_bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except ValueError:
                    raise VLLMValidationError(
                        f"logit_bias keys must be token ids, got {k!r}", parameter="logit_bias"
                    ) from None
                logit_bias[tid] = min(100.0, max(-100.0, v))
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=structured_outputs,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            **kwargs,
        )


# ---- completions ----------------------------------------------------------------------------
class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int64 | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError(_PROMPT_SHAPES)
        if not v:
            raise ValueError("must not be empty")
        if all(isinstance(p, str) for p in v):
            return v
        if all(isinstance(p, list) for p in v):
            for i, ids in enumerate(v):
                _check_token_ids(ids, f"prompt[{i}]")
            return v
        if any(isinstance(p, (str, list)) for p in v):
            raise ValueError(_PROMPT_SHAPES)
        _check_token_ids(v, "prompt")
        return v

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise VLLMValidationError("suffix is not supported", parameter="suffix")
        # As vLLM: echo returns the prompt's logprobs too, and with max_tokens=0 only the
        # prompt (the engine still runs one step).
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        max_tokens = 1 if self.echo and self.max_tokens == 0 else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class PromptLogprob(OpenAIBaseModel):
    """One entry of `prompt_logprobs` (vLLM's Logprob, as JSON)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # in the choice's first chunk
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
