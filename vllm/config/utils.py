# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Helpers for the config dataclasses."""

from __future__ import annotations

import ast
import inspect
import textwrap


def get_attr_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a class: field name -> the string literal right below it."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef), cls
    body = node.body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs
