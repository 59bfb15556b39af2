# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Compiling a request's StructuredOutputsParams with xgrammar.

The engine compiles every grammar when the request arrives (a grammar that does not compile is
a ValueError naming the problem, a 400 over HTTP); the last stage compiles it again from the
same inputs for its matcher (xgrammar's cache makes the second compile of the same spec free
when both run in one process)."""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams


class XgrammarBackend:
    """A GrammarCompiler for one tokenizer and the model's logits width."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1)
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The CompiledGrammar of so; ValueError naming the problem when it does not compile."""
        kind = so.kind
        try:
            with self._lock:
                ws = not so.disable_any_whitespace
                if kind == "json":
                    schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                    if so.disable_additional_properties:
                        schema = json.dumps(_no_additional_properties(json.loads(schema)))
                    return self.compiler.compile_json_schema(schema, any_whitespace=ws)
                if kind == "json_object":  # any JSON object (not any JSON value)
                    return self.compiler.compile_json_schema(
                        '{"type": "object"}', any_whitespace=ws
                    )
                if kind == "regex":
                    assert so.regex is not None
                    return self.compiler.compile_regex(so.regex)
                if kind == "choice":
                    assert so.choice is not None
                    alts = " | ".join(_ebnf_literal(c) for c in so.choice)
                    return self.compiler.compile_grammar(f"root ::= {alts}")
                assert so.grammar is not None
                if "::=" not in so.grammar:  # Lark syntax (rule: ...), as vLLM accepts
                    return self.compiler.compile_lark(so.grammar)
                return self.compiler.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            # Drop xgrammar's "[time] source.cc:line: " prefix.
            msg = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", " ".join(str(e).split()))
            raise VLLMValidationError(
                f"{so._source}: structured_outputs.{kind} does not compile: {msg[:500]}",
                parameter=so._source,
            ) from None

    def new_matcher(self, so: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(so))


def _no_additional_properties(schema: Any) -> Any:
    """The schema with "additionalProperties": false on every object schema that does not say
    (vLLM's disable_additional_properties)."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def _ebnf_literal(text: str) -> str:
    """text as a double-quoted EBNF string (xgrammar reads JSON-style escapes)."""
    if not text:
        return '""'
    return json.dumps(text, ensure_ascii=False)


_BACKENDS: dict[tuple[str, int], XgrammarBackend] = {}
_BACKENDS_LOCK = threading.Lock()


def get_backend(tokenizer_path: str, vocab_size: int, tokenizer: Any = None) -> XgrammarBackend:
    """The process's backend for a tokenizer (loaded from tokenizer_path unless given)."""
    key = (tokenizer_path, vocab_size)
    with _BACKENDS_LOCK:
        if key not in _BACKENDS:
            if tokenizer is None:
                tokenizer = _load_tokenizer(tokenizer_path)
            _BACKENDS[key] = XgrammarBackend(tokenizer, vocab_size)
        return _BACKENDS[key]


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
