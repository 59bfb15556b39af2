# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Gated DeltaNet (linear attention) over per-request state slots: the step metadata its varlen
kernels (layers/mamba/ops) run on.

Every linear-attention layer owns a conv state [S, P, C, k - 1] and a recurrent state
[S, P, H, dk, dv]: S state slots (one per running request, owned by the KV cache manager) and P
positions per slot. A request reads its initial state from (slot, init_index) and writes the
states after its last `num_store` tokens to positions 0..num_store-1 of its slot; a verify pass
of 1 + d tokens keeps all 1 + d, so whichever prefix the sampler accepts, the next step starts
from the state right after it without recomputation.

Prefix caching adds checkpoint writes: the state after a given token of a request's query is
also copied to a checkpoint id of the layer's checkpoint tensors [C, ...].

Short queries (decode, draft verification, tiny prefills) run together, padded, through the
per-token recurrence; longer ones (prefill chunks) run one by one through the chunked form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class GDNShortGroup:
    """Requests run together, padded to the longest query of the group."""

    rows: torch.Tensor  # [Rg] batch rows
    token_index: torch.Tensor  # [Rg, L] flat token index, or T (a zero row) for padding
    valid: torch.Tensor  # [n] indices into the flattened [Rg * L] that are real tokens
    token_flat: torch.Tensor  # [n] flat token index of each valid entry
    store_rows: torch.Tensor  # [N] group row of each kept state
    store_steps: torch.Tensor  # [N] the step (0..L-1) after which it is taken
    store_slots: torch.Tensor  # [N] state slot it is written to
    store_pos: torch.Tensor  # [N] position within that slot
    ckpt_rows: torch.Tensor | None = None  # [W] group row of each checkpoint write
    ckpt_steps: torch.Tensor | None = None  # [W] the step after which it is taken
    ckpt_ids: torch.Tensor | None = None  # [W] checkpoint id it is written to

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """Flat per-token x [T, ...] -> [Rg, L, ...] with zeros in the padding."""
        x_pad = torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)
        return x_pad[self.token_index]


@dataclass
class GDNAttentionMetadata:
    """What a linear-attention layer needs for one forward over a flattened token batch."""

    num_tokens: int
    query_start_loc_np: np.ndarray  # [R + 1]
    state_slots: torch.Tensor  # [R] state slot of each request
    init_index: torch.Tensor  # [R] position (within the slot) of its initial state
    has_initial_state: torch.Tensor  # [R, 1] bool: False for a request's first tokens
    short: GDNShortGroup | None
    long_rows: list[int]  # rows run one by one; their final state goes to position 0
    state_slots_np: np.ndarray  # [R]
    # Long rows' checkpoint writes: row -> [(tokens of the row before the state, id)].
    long_ckpts: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def initial_states(self, states: torch.Tensor) -> torch.Tensor:
        """[R, ...] initial state of every request in states [S, P, ...] (zeros where it has
        none); a copy, so writing the new states afterwards cannot disturb it."""
        init = states[self.state_slots, self.init_index]
        mask = self.has_initial_state.view(-1, *([1] * (init.dim() - 1)))
        return torch.where(mask, init, torch.zeros((), dtype=init.dtype, device=init.device))


def build_gdn_metadata(
    query_start_loc: np.ndarray,
    state_slots: np.ndarray,
    has_initial_state: np.ndarray,
    init_index: np.ndarray,
    num_store: np.ndarray,
    short_query_len: int,
    device: torch.device,
    checkpoint_writes: list[tuple[int, int, int]] | None = None,
) -> GDNAttentionMetadata:
    """query_start_loc [R + 1]; per request: its state slot, whether it continues a state, the
    position of that state, and how many trailing per-token states to keep (1: the final one).
    A request keeping more than one state always runs in the padded group. checkpoint_writes:
    (row, tokens of its query before the state, checkpoint id)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    T = int(qsl[-1])
    num_store = np.asarray(num_store, dtype=np.int64)
    if (num_store < 1).any() or (num_store > np.maximum(q_lens, 1)).any():
        raise ValueError(f"num_store {num_store.tolist()} out of range for queries {q_lens}")
    is_short = (q_lens <= short_query_len) | (num_store > 1)
    short_rows = np.nonzero(is_short & (q_lens > 0))[0]
    long_rows = np.nonzero(~is_short)[0].tolist()
    short = None
    slots = np.asarray(state_slots, dtype=np.int64)
    if len(short_rows):
        ql = q_lens[short_rows]
        L = int(ql.max())
        i = np.arange(L)[None, :]
        valid = i < ql[:, None]
        token_index = np.where(valid, qsl[short_rows][:, None] + i, T)
        flat_valid = np.nonzero(valid.reshape(-1))[0]
        ns = num_store[short_rows]
        store_rows = np.repeat(np.arange(len(short_rows)), ns)
        within = np.arange(int(ns.sum())) - np.repeat(np.cumsum(ns) - ns, ns)
        store_steps = np.repeat(ql - ns, ns) + within
        short = GDNShortGroup(
            rows=torch.from_numpy(short_rows).to(device),
            token_index=torch.from_numpy(token_index).to(device),
            valid=torch.from_numpy(flat_valid).to(device),
            token_flat=torch.from_numpy(token_index.reshape(-1)[flat_valid]).to(device),
            store_rows=torch.from_numpy(store_rows).to(device),
            store_steps=torch.from_numpy(store_steps).to(device),
            store_slots=torch.from_numpy(slots[short_rows][store_rows]).to(device),
            store_pos=torch.from_numpy(within).to(device),
        )
    writes = checkpoint_writes or []
    long_ckpts: dict[int, list[tuple[int, int]]] = {}
    for r, off, ck in writes:
        if not is_short[r]:
            long_ckpts.setdefault(r, []).append((off, ck))
    short_writes = [(r, off, ck) for r, off, ck in writes if is_short[r]]
    if short_writes and short is not None:
        group_row = {int(r): g for g, r in enumerate(short_rows)}

        def tensor(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        short.ckpt_rows = tensor([group_row[r] for r, _, _ in short_writes])
        short.ckpt_steps = tensor([off - 1 for _, off, _ in short_writes])
        short.ckpt_ids = tensor([ck for _, _, ck in short_writes])
    return GDNAttentionMetadata(
        num_tokens=T,
        query_start_loc_np=qsl,
        state_slots=torch.from_numpy(slots).to(device),
        init_index=torch.from_numpy(np.asarray(init_index, dtype=np.int64)).to(device),
        has_initial_state=torch.from_numpy(np.asarray(has_initial_state, dtype=bool)[:, None]).to(
            device
        ),
        short=short,
        long_rows=long_rows,
        state_slots_np=slots,
        long_ckpts=long_ckpts,
    )
