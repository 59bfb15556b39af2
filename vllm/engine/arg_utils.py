# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EngineArgs: the one place where LLM(...) kwargs and `vllm serve` flags become a VllmConfig.

A field's default is its config dataclass's default, and its flag (with help text, type,
choices, `--[no-]` for booleans) is generated from the field, so each default and each doc is
written once, in vllm/config."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal

from vllm.config import (
    CacheConfig,
    CompilationConfig,
    DataParallelBackend,
    DeviceConfig,
    DistributedExecutorBackend,
    LoadFormat,
    LogprobsMode,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulerPolicy,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
    get_attr_docs,
)

# Where a field's help text comes from when EngineArgs does not document the field itself.
_DOC_SOURCES = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    DeviceConfig,
    LoRAConfig,
    VllmConfig,
)
# Short spellings vLLM also accepts.
_ALIASES = {
    "pipeline_parallel_size": ["-pp"],
    "tensor_parallel_size": ["-tp"],
    "data_parallel_size": ["-dp"],
    "data_parallel_size_local": ["-dpl"],
    "data_parallel_address": ["-dpa"],
    "data_parallel_rpc_port": ["-dpp"],
    "data_parallel_backend": ["-dpb"],
    "quantization": ["-q"],
}


@dataclass
class EngineArgs:
    """Engine arguments, spelled as vLLM spells them."""

    model: str = ModelConfig.model
    tokenizer: str | None = ModelConfig.tokenizer
    dtype: str = ModelConfig.dtype
    seed: int = ModelConfig.seed
    max_model_len: int | None = ModelConfig.max_model_len
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int | None = None
    """Token budget of one step; default: the scheduler's (2048), raised to max_model_len when
    chunked prefill is off."""
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    block_size: int = CacheConfig.block_size
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    enable_prefix_caching: bool | None = CacheConfig.enable_prefix_caching
    mamba_cache_mode: str = CacheConfig.mamba_cache_mode
    mamba_num_checkpoints: int | None = CacheConfig.mamba_num_checkpoints
    mamba_cache_prompt_tail: bool = CacheConfig.mamba_cache_prompt_tail
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    distributed_executor_backend: DistributedExecutorBackend | None = (
        ParallelConfig.distributed_executor_backend
    )
    data_parallel_size: int = ParallelConfig.data_parallel_size
    data_parallel_size_local: int | None = ParallelConfig.data_parallel_size_local
    data_parallel_address: str | None = ParallelConfig.data_parallel_address
    data_parallel_rpc_port: int | None = ParallelConfig.data_parallel_rpc_port
    data_parallel_backend: DataParallelBackend | None = ParallelConfig.data_parallel_backend
    speculative_config: dict[str, Any] | str | None = None
    """Speculative decoding as a dict (JSON on the command line), e.g.
    {"method": "mtp", "num_speculative_tokens": 2}; keys: method (mtp | eagle | eagle3 |
    dflash | dspark | ngram), num_speculative_tokens, model (the draft folder),
    draft_sample_method, prompt_lookup_min / prompt_lookup_max (ngram),
    num_speculative_tokens_per_batch_size, adaptive_num_speculative_tokens. None: off."""
    compilation_config: dict[str, Any] | str | None = None
    """The fixed shapes of a step's forward as a dict (JSON on the command line), e.g.
    {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}. None: no padding."""
    enforce_eager: bool = VllmConfig.enforce_eager
    disable_log_stats: bool = VllmConfig.disable_log_stats
    trust_remote_code: bool = ModelConfig.trust_remote_code
    device: str = DeviceConfig.device
    served_model_name: str | list[str] | None = ModelConfig.served_model_name
    quantization: str | None = ModelConfig.quantization
    max_logprobs: int = ModelConfig.max_logprobs
    generation_config: str = ModelConfig.generation_config
    limit_mm_per_prompt: dict[str, int] | str | None = None
    """Most multimodal items per prompt, per modality, as a dict (JSON on the command line),
    e.g. {"image": 2}; default 4 images."""
    allowed_media_domains: list[str] | None = ModelConfig.allowed_media_domains
    structured_outputs_config: dict[str, Any] | str | None = None
    """Engine-wide structured-output settings as a dict (JSON on the command line, or dotted
    flags: --structured-outputs-config.disable_any_whitespace true), e.g. {"backend":
    "xgrammar", "disable_any_whitespace": true}; keys: backend (auto | xgrammar),
    disable_any_whitespace, disable_additional_properties, disable_fallback."""
    reasoning_parser: str = ""
    """The reasoning parser (deepseek_r1, deepseek_v3, qwen3): chat answers carry the thinking
    as reasoning_content apart from content, and structured outputs constrain only what
    follows the reasoning (structured_outputs_config.enable_in_reasoning: also the reasoning).
    Empty: none."""
    logprobs_mode: LogprobsMode = ModelConfig.logprobs_mode
    load_format: LoadFormat = ModelConfig.load_format
    async_scheduling: bool = False
    """vLLM's overlap of scheduling with execution: accepted; outputs are the same either way
    (this engine core schedules each step before it runs, and overlaps pipeline stages)."""
    scheduling_policy: SchedulerPolicy = SchedulerConfig.policy
    """Order of waiting requests: 'fcfs' (arrival) or 'priority' (each request's priority,
    lower first, then arrival; preemption takes the lowest-priority running request)."""

    enable_lora: bool = False
    """Serve LoRA adapters (PEFT folders) chosen per request (LoRARequest / the model field)."""
    max_loras: int = LoRAConfig.max_loras
    max_lora_rank: int = LoRAConfig.max_lora_rank
    max_cpu_loras: int | None = LoRAConfig.max_cpu_loras

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(
                f"unknown engine argument(s): {sorted(unknown)}; "
                f"supported: {sorted(cls.field_names())}"
            )
        return cls(**kwargs)

    def create_engine_config(self) -> VllmConfig:
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            trust_remote_code=self.trust_remote_code,
            served_model_name=self.served_model_name,
            quantization=self.quantization,
            max_logprobs=self.max_logprobs,
            generation_config=self.generation_config,
            limit_mm_per_prompt=(
                parse_json_arg("limit_mm_per_prompt", self.limit_mm_per_prompt)
                if isinstance(self.limit_mm_per_prompt, str)
                else self.limit_mm_per_prompt
            ),
            allowed_media_domains=self.allowed_media_domains,
            logprobs_mode=self.logprobs_mode,
            load_format=self.load_format,
        )
        spec = self.speculative_config
        if isinstance(spec, str):
            spec = parse_json_arg("speculative_config", spec)
        speculative_config = SpeculativeConfig.from_dict(spec) if spec is not None else None
        comp = self.compilation_config
        if isinstance(comp, str):
            comp = parse_json_arg("compilation_config", comp)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = SchedulerConfig.max_num_batched_tokens
            if not self.enable_chunked_prefill:
                assert model_config.max_model_len is not None  # resolved by ModelConfig
                budget = max(budget, model_config.max_model_len)
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                mamba_cache_mode=self.mamba_cache_mode,
                mamba_num_checkpoints=self.mamba_num_checkpoints,
                mamba_cache_prompt_tail=self.mamba_cache_prompt_tail,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
            ),
            parallel_config=ParallelConfig(
                pipeline_parallel_size=self.pipeline_parallel_size,
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                data_parallel_size=self.data_parallel_size,
                data_parallel_size_local=self.data_parallel_size_local,
                data_parallel_address=self.data_parallel_address,
                data_parallel_rpc_port=self.data_parallel_rpc_port,
                data_parallel_backend=self.data_parallel_backend,
            ),
            speculative_config=speculative_config,
            device_config=DeviceConfig(device=self.device),
            compilation_config=CompilationConfig.from_dict(comp),
            structured_outputs_config=self._structured_outputs_config(),
            lora_config=(
                LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
                if self.enable_lora
                else None
            ),
            enforce_eager=self.enforce_eager,
            disable_log_stats=self.disable_log_stats,
        )

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        soc = StructuredOutputsConfig.from_dict(
            parse_json_arg("structured_outputs_config", self.structured_outputs_config)
            if isinstance(self.structured_outputs_config, str)
            else self.structured_outputs_config
        )
        if self.reasoning_parser:  # --reasoning-parser, as vLLM's shorthand for the config key
            soc = dataclasses.replace(soc, reasoning_parser=self.reasoning_parser)
        return soc

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add a flag for every engine argument (vLLM spellings) that the parser does not
        define already (`vllm serve` spells --model and --served-model-name its own way)."""
        for name, kwargs in engine_arg_kwargs().items():
            flag = "--" + name.replace("_", "-")
            if flag in parser._option_string_actions:
                continue
            parser.add_argument(*_ALIASES.get(name, []), flag, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        kwargs = {f: getattr(args, f) for f in cls.field_names() if hasattr(args, f)}
        kwargs["model"] = getattr(args, "model", None) or ""
        return cls(**kwargs)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


@functools.cache
def engine_arg_docs() -> dict[str, str]:
    """Each EngineArgs field's doc: its own, else that of the config field of the same name."""
    docs: dict[str, str] = {}
    for cls in reversed(_DOC_SOURCES):  # the first class naming a field wins
        docs.update(get_attr_docs(cls))
    docs.update(get_attr_docs(EngineArgs))
    return {f.name: docs[f.name] for f in fields(EngineArgs) if f.name in docs}


def engine_arg_kwargs() -> dict[str, dict[str, Any]]:
    """add_argument keyword arguments (type, default, help, ...) for every EngineArgs field."""
    hints = typing.get_type_hints(EngineArgs)
    docs = engine_arg_docs()
    out = {}
    for f in fields(EngineArgs):
        kwargs = _argparse_kwargs("--" + f.name.replace("_", "-"), hints[f.name], f.default)
        help_text = docs.get(f.name, "").replace("%", "%%")
        if f.default is not None:
            help_text += " (default: %(default)s)"  # formatted from the parser's own default
        out[f.name] = kwargs | {"help": help_text}
    return out


def _argparse_kwargs(flag: str, hint: Any, default: Any) -> dict[str, Any]:
    """What argparse needs to parse a value of type `hint` (its None allowed by the default)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
    else:
        options = [hint]
    kwargs: dict[str, Any] = {"default": default}
    if options == [bool]:
        return kwargs | {"action": argparse.BooleanOptionalAction}
    if any(typing.get_origin(o) is dict for o in options):
        return kwargs | {"type": functools.partial(parse_json_arg, flag), "metavar": "JSON"}
    if any(typing.get_origin(o) is list for o in options):
        return kwargs | {"type": str, "nargs": "+"}
    (only,) = options
    if typing.get_origin(only) is Literal:
        choices = list(typing.get_args(only))
        return kwargs | {"type": type(choices[0]), "choices": choices}
    if only not in (int, float, str):
        raise TypeError(f"no command-line form for {flag} of type {hint!r}")
    return kwargs | {"type": only}


def dict_arg_names() -> list[str]:
    """The EngineArgs fields given as a JSON object (speculative_config, ...)."""
    hints = typing.get_type_hints(EngineArgs)
    out = []
    for f in fields(EngineArgs):
        hint = hints[f.name]
        options = (
            typing.get_args(hint)
            if typing.get_origin(hint)
            in (
                typing.Union,
                types.UnionType,
            )
            else (hint,)
        )
        if any(typing.get_origin(o) is dict for o in options):
            out.append(f.name)
    return out


def expand_dotted_config_flags(argv: list[str]) -> list[str]:
    """vLLM's dotted spelling of a JSON-object flag's keys: `--speculative-config.method mtp
    --speculative-config.num_speculative_tokens=2` becomes `--speculative-config
    '{"method": "mtp", "num_speculative_tokens": 2}'` (values read as JSON when they parse,
    else as strings; a.b keys nest; keys given with both spellings: the dotted one wins)."""
    flags = {"--" + n.replace("_", "-"): n for n in dict_arg_names()}
    merged: dict[str, dict[str, Any]] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        head, dot, key = arg.partition(".")
        if not dot or head not in flags or not arg.startswith("--"):
            rest.append(arg)
            i += 1
            continue
        if "=" in key:
            key, _, value = key.partition("=")
        elif i + 1 < len(argv):
            value = argv[i + 1]
            i += 1
        else:
            raise JSONArgError(f"{arg} needs a value")
        i += 1
        if not key:
            raise JSONArgError(f"{arg}: no key after the dot")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        target = merged.setdefault(head, {})
        *path, last = key.replace("-", "_").split(".")
        for part in path:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise JSONArgError(f"{arg}: {part} is both a value and a group")
        target[last] = parsed
    for head, keys in merged.items():
        # A JSON value of the same flag (anywhere in argv) is the base the dotted keys update.
        base: dict[str, Any] = {}
        for j, arg in enumerate(list(rest)):
            given: str | None = None
            if arg == head and j + 1 < len(rest):
                given = rest[j + 1]
                del rest[j : j + 2]
            elif arg.startswith(head + "="):
                given = arg.split("=", 1)[1]
                del rest[j]
            if given is not None:
                base = parse_json_arg(flags[head], given)
                break
        rest += [head, json.dumps(_deep_update(base, keys))]
    return rest


def _deep_update(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in new.items():
        out[k] = (
            _deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


class JSONArgError(argparse.ArgumentTypeError, ValueError):
    """A JSON-valued argument that does not parse (argparse prints it as one line)."""


def parse_json_arg(name: str, value: str) -> dict[str, Any]:
    """Parse a JSON flag value; a bad value names the flag."""
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise JSONArgError(f"{name} is not valid JSON: {e.msg} ({value!r})") from e
    if not isinstance(out, dict):
        raise JSONArgError(f"{name} must be a JSON object, got {value!r}")
    return out
