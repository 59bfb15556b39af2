# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EngineArgs: the one place where LLM(...) kwargs and `vllm serve` flags become a VllmConfig."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any

from vllm.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)


@dataclass
class EngineArgs:
    """Engine arguments, spelled as vLLM spells them."""

    model: str = ""
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool | None = None  # None: on unless the model is hybrid
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    speculative_config: dict[str, Any] | str | None = None
    compilation_config: dict[str, Any] | str | None = None
    enforce_eager: bool = False
    disable_log_stats: bool = True
    trust_remote_code: bool = False
    device: str = "auto"
    served_model_name: str | list[str] | None = None
    quantization: str | None = None

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
            budget = 2048 if self.enable_chunked_prefill else max(2048, model_config.max_model_len)
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            parallel_config=ParallelConfig(
                pipeline_parallel_size=self.pipeline_parallel_size,
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            speculative_config=speculative_config,
            device_config=DeviceConfig(device=self.device),
            compilation_config=CompilationConfig.from_dict(comp),
            enforce_eager=self.enforce_eager,
            disable_log_stats=self.disable_log_stats,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags (vLLM spellings) to a parser."""
        d = EngineArgs()
        parser.add_argument("--tokenizer", type=str, default=None)
        parser.add_argument("--dtype", type=str, default=d.dtype)
        parser.add_argument("--seed", type=int, default=d.seed)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        parser.add_argument("--max-num-batched-tokens", type=int, default=None)
        parser.add_argument("--block-size", type=int, default=d.block_size)
        parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
        parser.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="Reuse the KV cache of shared prompt prefixes (default: on, except for hybrid "
            "models).",
        )
        parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
        parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
        parser.add_argument(
            "--distributed-executor-backend", type=str, choices=["mp", "ray", "uni"], default=None
        )
        parser.add_argument(
            "--speculative-config",
            type=lambda s: parse_json_arg("--speculative-config", s),
            default=None,
            help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\'',
        )
        parser.add_argument(
            "--compilation-config",
            type=lambda s: parse_json_arg("--compilation-config", s),
            default=None,
            help="JSON, e.g. '{\"cudagraph_capture_sizes\": [1, 2, 4, 8, 16, 32]}'",
        )
        parser.add_argument("--enforce-eager", action="store_true")
        parser.add_argument("--disable-log-stats", action="store_true")
        parser.add_argument("--trust-remote-code", action="store_true")
        parser.add_argument("--device", type=str, default="auto")
        parser.add_argument(
            "-q",
            "--quantization",
            type=str,
            default=None,
            help="Weight quantization; default: the checkpoint's quantization_config (fp8)",
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        kwargs = {f: getattr(args, f) for f in cls.field_names() if hasattr(args, f)}
        kwargs["model"] = getattr(args, "model", None) or ""
        return cls(**kwargs)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


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
