# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm bench throughput|latency|serve ...`: the offline benchmarks and the online one against
a running server (vllm/benchmarks)."""

from __future__ import annotations

import argparse
import sys

from vllm.benchmarks.args import add_latency_args, add_throughput_args
from vllm.benchmarks.serve import add_serve_args
from vllm.entrypoints.cli.serve import _make_error, _one_line

_SUBCOMMANDS = {
    "throughput": ("vllm.benchmarks.throughput", add_throughput_args, "Offline throughput"),
    "latency": ("vllm.benchmarks.latency", add_latency_args, "Latency of one batch"),
    "serve": ("vllm.benchmarks.serve", add_serve_args, "Load a running server (online)"),
}


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="Run a benchmark",
        description="Offline benchmarks (optionally vs HF) and the online serving benchmark.",
    )
    parser.error = _make_error(parser.prog)
    sub = parser.add_subparsers(dest="bench_type")
    for name, (module, add_args, help_text) in _SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.error = _make_error(p.prog)
        add_args(p)
        p.set_defaults(dispatch=_dispatch(module))
    parser.set_defaults(dispatch=lambda args: _no_subcommand(parser))
    return parser


def _no_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 1


def _dispatch(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib  # the benchmark modules import torch: only when one runs

        try:
            return importlib.import_module(module).main(args)
        except (ValueError, TypeError, OSError) as e:
            # Bad configuration: one line, no traceback.
            print(f"vllm bench {args.bench_type}: error: {_one_line(e)}", file=sys.stderr)
            return 1

    return run
