# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The per-request logit controls applied before temperature / top-k / top-p / min-p:
allowed_token_ids, bad_words, logit_bias, min_tokens (stop tokens masked), then the repetition,
frequency and presence penalties (vLLM's order and definitions).

Every control reads the output-token history of the position it samples. Under speculation a
request has one logits row per verify position; row j's history is the request's tokens so far
followed by the drafts of rows 0 .. j - 1 (its inputs). A row's token is emitted only when all
drafts before it were accepted, i.e. equal to the tokens emitted there, so each emitted token saw
exactly the history a one-token step would have given it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.v1.worker.gpu.features import LogitRows, RunnerFeature

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.states import RequestStates


class LogitControls(RunnerFeature):
    """The logit controls as a runner feature (last stage, after the grammar's bitmasks)."""

    def adjust_logits(self, logits: torch.Tensor, rows: LogitRows) -> torch.Tensor:
        return apply_logit_controls(logits, rows.states, rows.slots, rows.positions, rows.inputs)


def needs_controls(p: SamplingParams | None) -> bool:
    return p is not None and (p.has_logit_controls or p.min_tokens > 0)


def apply_logit_controls(
    logits: torch.Tensor,
    states: RequestStates,
    row_slots: np.ndarray,
    positions: np.ndarray,
    row_inputs: np.ndarray,
) -> torch.Tensor:
    """logits [N, V] with every row's controls applied (a new tensor when any applies).

    row_slots [N]: the request-state slot of each row; a request's rows are consecutive.
    positions [N]: the position of the token each row samples. row_inputs [N]: each row's
    input token (the token at positions - 1): for a request's rows after its first, a draft."""
    N = len(row_slots)
    if N == 0:
        return logits
    params = states.params
    if not any(needs_controls(params[s]) for s in np.unique(row_slots).tolist()):
        return logits
    logits = logits.clone()
    V = logits.shape[-1]
    neg_inf = float("-inf")
    starts = np.flatnonzero(np.r_[True, row_slots[1:] != row_slots[:-1]])
    ends = np.r_[starts[1:], N]
    for a, b in zip(starts.tolist(), ends.tolist()):
        s = int(row_slots[a])
        p = params[s]
        if p is None or not needs_controls(p):
            continue
        n_known = int(positions[a])  # tokens before the first row's position: all known
        n_prompt = int(states.num_prompt[s])
        known = states.token_ids[s, :n_known]
        drafts = row_inputs[a + 1 : b]
        rows = slice(a, b)
        if p.allowed_token_ids is not None:
            allowed = torch.zeros(V, dtype=torch.bool, device=logits.device)
            allowed[torch.tensor(p.allowed_token_ids, device=logits.device)] = True
            logits[rows] = logits[rows].masked_fill(~allowed, neg_inf)
        for j in range(b - a):
            output = np.concatenate([known[n_prompt:], drafts[:j]])
            row = a + j
            for ids in p.bad_words_token_ids:
                prefix = ids[:-1]
                if len(output) >= len(prefix) and (
                    not prefix or output[len(output) - len(prefix) :].tolist() == prefix
                ):
                    logits[row, ids[-1]] = neg_inf
            if len(output) < p.min_tokens and p.all_stop_token_ids:
                logits[row, sorted(p.all_stop_token_ids)] = neg_inf
        if p.logit_bias:
            bias_ids = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            logits[rows, bias_ids] += bias.to(logits.device)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            _apply_penalties(logits, rows, p, known, n_prompt, drafts)
    return logits


def _apply_penalties(
    logits: torch.Tensor,
    rows: slice,
    p: SamplingParams,
    known: np.ndarray,
    n_prompt: int,
    drafts: np.ndarray,
) -> None:
    """Repetition (prompt and output tokens), then frequency and presence (output tokens)."""
    V = logits.shape[-1]
    n = rows.stop - rows.start
    counts = np.zeros((n, V), dtype=np.float32)
    counts[:] = np.bincount(known[n_prompt:], minlength=V)[:V]
    for j in range(1, n):  # row j also counts the drafts of the rows before it
        counts[j:, drafts[j - 1]] += 1
    c = torch.from_numpy(counts).to(logits.device)
    seen_out = c > 0
    x = logits[rows]
    if p.repetition_penalty != 1.0:
        in_prompt = torch.from_numpy(np.bincount(known[:n_prompt], minlength=V)[:V] > 0)
        seen = seen_out | in_prompt.to(logits.device)[None, :]
        rp = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    x = x - p.frequency_penalty * c - p.presence_penalty * seen_out.to(x.dtype)
    logits[rows] = x
