# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The reasoning parsers' split and switches, as vLLM's parsers answer (deepseek_r1: the output
starts inside the thinking; qwen3: enable_thinking false turns it off; deepseek_v3: on only with
thinking true); reasoning ends in the prompt when its last think marker is </think>."""

from __future__ import annotations

import pytest

from vllm.reasoning import REASONING_PARSERS, get_reasoning_parser

START, END = 7, 8


class _Tok:
    def get_vocab(self) -> dict[str, int]:
        return {"<think>": START, "</think>": END, "a": 1}


def parser(name: str, **kwargs):
    return get_reasoning_parser(name)(_Tok(), kwargs or None)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_split(name):
    p = parser(name)
    assert p.split("abc</think>def") == ("abc", "def")
    assert p.split("<think>abc</think>def") == ("abc", "def")  # a generated <think> is dropped
    assert p.split("abc") == ("abc", None)  # not ended (yet): all reasoning
    assert p.split("abc</think>") == ("abc", "")
    assert p.split("a</think>b</think>c") == ("a", "b</think>c")


def test_switches_and_prompt_end():
    assert parser("deepseek_r1").ended_at_start([1, START]) is False
    assert parser("deepseek_r1").ended_at_start([1, START, 1, END, 1]) is True
    assert parser("deepseek_r1").ended_at_start([END, START]) is False
    assert parser("qwen3").ended_at_start([1]) is False
    assert parser("qwen3", enable_thinking=False).ended_at_start([1]) is True
    assert parser("qwen3", enable_thinking=True).ended_at_start([1]) is False
    assert parser("deepseek_v3").ended_at_start([1]) is True  # thinking off by default
    assert parser("deepseek_v3", thinking=False).ended_at_start([1, START]) is True
    assert parser("deepseek_v3", thinking=True).ended_at_start([1, START]) is False


def test_names_and_missing_tokens():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "deepseek_v3", "qwen3"}
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("granite")

    class NoThink:
        def get_vocab(self):
            return {"a": 1}

    with pytest.raises(ValueError, match="no </think> token"):
        get_reasoning_parser("qwen3")(NoThink())
