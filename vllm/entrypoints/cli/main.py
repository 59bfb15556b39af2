# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The `vllm` console script."""

from __future__ import annotations

import argparse
import sys

from vllm.version import __version__


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM-compatible inference engine")
    parser.add_argument("-v", "--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command")
    from vllm.entrypoints.cli.serve import add_serve_parser

    add_serve_parser(sub)
    from vllm.entrypoints.cli.zoo import add_zoo_parser

    add_zoo_parser(sub)
    from vllm.entrypoints.cli.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from vllm.engine.arg_utils import JSONArgError, expand_dotted_config_flags

    parser = make_parser()
    try:
        argv = expand_dotted_config_flags(list(sys.argv[1:] if argv is None else argv))
    except JSONArgError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    if getattr(args, "dispatch", None) is None:
        parser.print_help()
        return 1
    return int(args.dispatch(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
