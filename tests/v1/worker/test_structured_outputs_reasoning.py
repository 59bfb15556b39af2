# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The grammar waits for the end of the reasoning, losslessly under speculation: the masks a
verify step gives its rows (drafts inside the reasoning, the end marker, drafts after it) are
the masks the same tokens get one step at a time; rows inside the reasoning are open, and the
first row after the end marker already follows the grammar (the marker never reaches it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.testing.hf_init import build_tokenizer
from vllm.v1.worker.gpu.sample.structured_outputs import StructuredOutputStates

REGEX = r"[0-9]{2}x"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    from tokenizers import AddedToken

    path = tmp_path_factory.mktemp("think_tok")
    tok = build_tokenizer(path)
    tok.add_tokens([AddedToken(t, special=False) for t in ("<think>", "</think>")])
    tok.save_pretrained(str(path))
    return str(path)


def _ids(tok_dir: str) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    names = ["a", "b", "1", "2", "x", "<think>", "</think>"]
    ids = {n: tok.convert_tokens_to_ids(n) for n in names}
    assert all(isinstance(i, int) and i >= 0 for i in ids.values()), ids
    ids["V"] = len(tok)
    return ids


def _states(tok_dir: str, ids: dict[str, int], ended: bool = False) -> StructuredOutputStates:
    states = StructuredOutputStates(tok_dir, ids["V"])
    so = StructuredOutputsParams(regex=REGEX)
    so._reasoning_gate = (ids["<think>"], ids["</think>"], ended)
    states.add(0, SamplingParams(structured_outputs=so), [])
    return states


def _masks(states: StructuredOutputStates, row_inputs: list[int], V: int) -> np.ndarray:
    """Allowed tokens of each row of one step of slot 0 (row j's input: row_inputs[j])."""
    logits = torch.zeros(len(row_inputs), V)
    states.apply_bitmasks(logits, np.zeros(len(row_inputs), np.int64), np.array(row_inputs))
    return (logits > -1).numpy()


def _accept(states: StructuredOutputStates, tokens: list[int]) -> None:
    states.accept(np.zeros(1, np.int64), np.array([tokens]), np.array([len(tokens)]))


def test_verify_rows_equal_one_token_steps(tok_dir):
    ids = _ids(tok_dir)
    V = ids["V"]
    seq = [ids[t] for t in ["a", "b", "</think>", "1", "2", "x"]]
    # One token a step: the mask of every position.
    states = _states(tok_dir, ids)
    single = []
    for t in seq:
        single.append(_masks(states, [0], V)[0])
        _accept(states, [t])
    inside = single[:3]
    assert all(m.all() for m in inside)  # the reasoning (and the end marker) are free
    after = single[3]
    assert after[ids["1"]] and not after[ids["a"]] and not after[ids["</think>"]]
    # Verify steps starting anywhere, with the rest of the sequence as drafts.
    for start in range(len(seq)):
        states = _states(tok_dir, ids)
        if start:
            _accept(states, seq[:start])
        rows = _masks(states, [0, *seq[start:-1]], V)
        for j, row in enumerate(rows):
            np.testing.assert_array_equal(row, single[start + j], err_msg=f"{start=} {j=}")
        # The matcher is where it was (drafts rolled back): the next single step agrees.
        np.testing.assert_array_equal(_masks(states, [0], V)[0], single[start])


def test_forbidden_draft_after_the_end_leaves_later_rows_open(tok_dir):
    ids = _ids(tok_dir)
    states = _states(tok_dir, ids)
    rows = _masks(states, [0, ids["a"], ids["</think>"], ids["b"]], ids["V"])
    assert rows[0].all() and rows[1].all()
    assert not rows[2][ids["b"]]  # the grammar's first row: "b" is not a digit
    assert rows[3].all()  # after a forbidden draft: never emitted, left open


def test_reasoning_ended_in_the_prompt_constrains_from_the_start(tok_dir):
    ids = _ids(tok_dir)
    states = _states(tok_dir, ids, ended=True)
    row = _masks(states, [0], ids["V"])[0]
    assert row[ids["1"]] and not row[ids["a"]]
