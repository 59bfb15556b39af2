# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The engine flags are generated from EngineArgs and the config dataclasses: every field has a
flag with help text, defaults come from the configs, booleans get --[no-]flags, and every flag
spelling vLLM users type keeps working."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.main import make_parser

# Every flag `vllm serve` accepted before the flags were generated, aliases included.
OLD_FLAGS = [
    "--model", "--host", "--port", "--served-model-name", "--api-key", "--uvicorn-log-level",
    "--disable-uvicorn-access-log", "--trust-request-chat-template", "--timeout-graceful-shutdown",
    "--tokenizer", "--dtype", "--seed", "--max-model-len", "--max-num-seqs",
    "--max-num-batched-tokens", "--block-size", "--kv-cache-memory-bytes",
    "--gpu-memory-utilization", "--num-gpu-blocks-override", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "-pp", "--pipeline-parallel-size", "-tp",
    "--tensor-parallel-size", "--distributed-executor-backend", "--speculative-config",
    "--compilation-config", "--enforce-eager", "--disable-log-stats", "--trust-remote-code",
    "--device", "-q", "--quantization",
]  # fmt: skip
CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, DeviceConfig, VllmConfig)


def _engine_parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_engine_field_has_a_documented_flag() -> None:
    by_dest = {a.dest: a for a in _engine_parser()._actions}
    for f in dataclasses.fields(EngineArgs):
        action = by_dest.get(f.name)
        assert action is not None, f.name
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.help and len(action.help) > 10, f.name


def test_defaults_are_the_configs() -> None:
    config_defaults = {}
    for cls in reversed(CONFIGS):  # ModelConfig's max_model_len, not SchedulerConfig's copy
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                config_defaults[f.name] = f.default
    shared = [f for f in dataclasses.fields(EngineArgs) if f.name in config_defaults]
    assert len(shared) >= 20
    for f in shared:
        if f.name != "max_num_batched_tokens":  # derived from chunked prefill (next test)
            assert f.default == config_defaults[f.name], f.name
    # The parser's defaults are EngineArgs' own.
    assert EngineArgs.from_cli_args(_engine_parser().parse_args([])) == EngineArgs()


def test_batched_tokens_default(llama_dir) -> None:
    cfg = EngineArgs(model=llama_dir, max_model_len=128).create_engine_config()
    assert cfg.scheduler_config.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens
    args = EngineArgs(model=llama_dir, enable_chunked_prefill=False)
    cfg = args.create_engine_config()
    assert cfg.scheduler_config.max_num_batched_tokens == max(
        SchedulerConfig.max_num_batched_tokens, cfg.model_config.max_model_len
    )


def test_old_flag_spellings_still_parse() -> None:
    known = _serve_parser()._option_string_actions
    assert [f for f in OLD_FLAGS if f not in known] == []


def test_aliases_booleans_choices_and_json() -> None:
    p = _engine_parser()
    args = p.parse_args(["-pp", "2", "-tp", "1", "-q", "fp8", "--no-enable-chunked-prefill"])
    assert (args.pipeline_parallel_size, args.tensor_parallel_size) == (2, 1)
    assert args.quantization == "fp8" and args.enable_chunked_prefill is False
    assert p.parse_args([]).enable_chunked_prefill is True
    assert p.parse_args(["--enforce-eager"]).enforce_eager is True
    assert p.parse_args(["--no-enforce-eager"]).enforce_eager is False
    args = p.parse_args(["--speculative-config", '{"method": "mtp"}', "--max-num-seqs", "3"])
    assert args.speculative_config == {"method": "mtp"} and args.max_num_seqs == 3
    assert p.parse_args(["--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5
    assert p.parse_args(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
        (["--compilation-config", "[1]"], "--compilation-config must be a JSON object"),
        (["--distributed-executor-backend", "threads"], "invalid choice: 'threads'"),
        (["--max-num-seqs", "many"], "--max-num-seqs: invalid int value: 'many'"),
    ],
)
def test_bad_flag_values_exit_naming_the_flag(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as e:
        _engine_parser().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_logs_stats_unless_told_not_to() -> None:
    p = _serve_parser()
    assert p.parse_args([]).disable_log_stats is False
    assert p.parse_args(["--disable-log-stats"]).disable_log_stats is True
    assert EngineArgs().disable_log_stats is True  # offline engines: off, as before


def test_cli_and_kwargs_build_the_same_config(llama_dir) -> None:
    argv = [llama_dir, "--max-model-len", "64", "--max-num-seqs", "3", "--block-size", "8"]
    argv += ["--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--seed", "5"]
    args = _serve_parser().parse_args(argv)
    args.model = args.model_tag
    from_cli = EngineArgs.from_cli_args(args).create_engine_config()
    from_kwargs = EngineArgs(
        model=llama_dir,
        max_model_len=64,
        max_num_seqs=3,
        block_size=8,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        seed=5,
        disable_log_stats=False,
    ).create_engine_config()
    for name in ("cache_config", "scheduler_config", "parallel_config", "compilation_config"):
        assert getattr(from_cli, name) == getattr(from_kwargs, name), name
    assert from_cli.model_config.seed == 5 and from_cli.disable_log_stats is False
