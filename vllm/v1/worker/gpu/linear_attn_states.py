# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Per-request states of a hybrid model's linear-attention layers on one pipeline stage.

The KV cache manager hands every running request a state slot (allocated, preempted and freed
with its KV blocks); here each MambaBase layer of this stage gets its state tensors
[num_state_slots, P, ...] with P = 1 + num_speculative_tokens positions per slot.

Speculative decoding: a verify pass of 1 + d tokens keeps the state after each of them at
positions 0..d, and the slot remembers the sequence position of position 0. The next step of the
request starts from the position that holds the state after its last computed token, i.e.
num_computed - 1 - base. Rejected drafts are rolled back exactly as num_computed is (the last
stage after sampling, every other stage from the num_rejected that PPHandler broadcasts), so the
rollback costs no copy and no collective of its own, and a stage never needs to know which
drafts were rejected beyond its own num_computed.

Prefix caching: `num_checkpoints` more copies of every state tensor (one position each) hold
states at block boundaries (v1/core/state_checkpoints.py decides which). A step copies the state
after a scheduled boundary out of its forward (the metadata's checkpoint writes); a request
starting after a cache hit gets its checkpoint copied into its slot before its first step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from vllm.attention.backends.gdn_attn import GDNAttentionMetadata, build_gdn_metadata
from vllm.model_executor.layers.mamba import MambaBase
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.gpu.features import RunnerFeature, StepInputs
from vllm.v1.worker.gpu.states import RequestStates


class LinearAttnStates(RunnerFeature):
    """A runner feature: its memory counts against the KV budget (bytes, allocate), a request
    resumed after a cache hit starts from a checkpoint (add_requests), and every step gets its
    metadata (prepare_step)."""

    def __init__(
        self,
        layers: dict[str, MambaBase],
        num_slots: int,
        num_speculative_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        num_checkpoints: int = 0,
    ) -> None:
        self.layers = layers
        self.num_checkpoints = num_checkpoints
        self.num_slots = num_slots
        self.num_positions = num_speculative_tokens + 1
        self.dtype = dtype
        self.device = device
        # Sequence position whose state sits at position 0 of each slot, and how many
        # consecutive positions hold valid states.
        self.base_pos = np.zeros(num_slots, dtype=np.int64)
        self.num_stored = np.zeros(num_slots, dtype=np.int64)
        self.states: dict[str, list[torch.Tensor]] = {}
        self.checkpoints: dict[str, list[torch.Tensor]] = {}
        # Seconds spent choosing each request's starting state (what a rollback amounts to),
        # over num_steps forwards.
        self.select_s = 0.0
        self.num_steps = 0

    @classmethod
    def from_modules(
        cls,
        named_modules: Iterable[tuple[str, nn.Module]],
        num_slots: int,
        num_speculative_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        num_checkpoints: int = 0,
    ) -> LinearAttnStates | None:
        layers = {n: m for n, m in named_modules if isinstance(m, MambaBase)}
        if not layers:
            return None
        return cls(layers, num_slots, num_speculative_tokens, dtype, device, num_checkpoints)

    def bytes(self) -> int:
        """Memory of all state tensors of this stage, checkpoints included (counted against
        the KV budget)."""
        return self.bytes_per_slot() * (self.num_slots * self.num_positions + self.num_checkpoints)

    def bytes_per_slot(self) -> int:
        """One request's (or one checkpoint's) states at one position, all layers."""
        return sum(m.state_bytes_per_slot(self.dtype) for m in self.layers.values())

    def allocate(self) -> None:
        for name, layer in self.layers.items():
            tensors = [
                torch.zeros(
                    (self.num_slots, self.num_positions, *shape), dtype=dt, device=self.device
                )
                for shape, dt in zip(layer.state_shapes(), layer.state_dtypes(self.dtype))
            ]
            layer.states = tensors
            self.states[name] = tensors
            ckpts = [
                torch.zeros((self.num_checkpoints, *shape), dtype=dt, device=self.device)
                for shape, dt in zip(layer.state_shapes(), layer.state_dtypes(self.dtype))
            ]
            layer.checkpoints = ckpts if self.num_checkpoints else None
            self.checkpoints[name] = ckpts

    # ---- runner hooks -----------------------------------------------------------------------
    def add_requests(
        self, new_reqs: list[NewRequestData], slots: list[int], states: RequestStates
    ) -> None:
        self.restore_hits(new_reqs, states)  # prefix-cache hits resume from checkpoints

    def prepare_step(self, step: StepInputs) -> None:
        batch = step.batch
        step.linear_attn_metadata = self.prepare(
            batch.query_start_loc_np,
            batch.num_computed_tokens_np,
            batch.num_draft_tokens_np,
            step.states.state_slot[batch.idx_mapping_np],
            short_query_len=self.num_positions,
            saves=[step.so.state_checkpoint_saves.get(r, []) for r in batch.req_ids],
        )

    def restore_hits(self, new_reqs: list[NewRequestData], states: RequestStates) -> None:
        """New requests starting after a prefix-cache hit: their states from its checkpoint."""
        for d in new_reqs:
            if d.state_checkpoint >= 0:
                slot = int(states.state_slot[states.slot(d.req_id)])
                self.restore(slot, d.state_checkpoint, d.num_computed_tokens)

    def restore(self, slot: int, checkpoint: int, num_computed: int) -> None:
        """A request starting after num_computed cached tokens: its slot's state is the
        checkpoint's (taken after exactly that many tokens)."""
        if not 0 <= checkpoint < self.num_checkpoints:
            raise RuntimeError(f"state checkpoint {checkpoint} out of range")
        for name, tensors in self.states.items():
            for t, ck in zip(tensors, self.checkpoints[name]):
                t[slot, 0] = ck[checkpoint]
        self.base_pos[slot] = num_computed - 1
        self.num_stored[slot] = 1

    def _save_passed(
        self, slots: np.ndarray, c: np.ndarray, saves: list[list[tuple[int, int]]] | None
    ) -> None:
        """Checkpoints at boundaries already computed (passed on drafts the last step verified):
        copied from the per-token states that step kept, before this step overwrites them."""
        for r, row in enumerate(saves or []):
            for p, ck in row:
                if p > c[r]:
                    continue
                s = int(slots[r])
                pos = p - 1 - int(self.base_pos[s])
                if not 0 <= pos < self.num_stored[s]:
                    raise RuntimeError(
                        f"no state after {p} tokens in slot {s} for checkpoint {ck} (it holds "
                        f"{self.base_pos[s] + 1}..{self.base_pos[s] + self.num_stored[s]})"
                    )
                for name, tensors in self.states.items():
                    for t, ckpts in zip(tensors, self.checkpoints[name]):
                        ckpts[ck] = t[s, pos]

    def prepare(
        self,
        query_start_loc: np.ndarray,
        num_computed: np.ndarray,
        num_draft_tokens: np.ndarray,
        state_slots: np.ndarray,
        short_query_len: int,
        saves: list[list[tuple[int, int]]] | None = None,
    ) -> GDNAttentionMetadata:
        """Metadata of one step (before num_computed advances); records where each request's
        states will sit after it."""
        t0 = time.perf_counter()
        slots = np.asarray(state_slots, dtype=np.int64)
        if (slots < 0).any() or (slots >= self.num_slots).any():
            raise RuntimeError(
                f"state slots {slots.tolist()} out of range for {self.num_slots} slots (does "
                "the scheduler allocate state slots for this hybrid model?)"
            )
        c = np.asarray(num_computed, dtype=np.int64)
        n = np.diff(np.asarray(query_start_loc, dtype=np.int64))
        has_init = c > 0
        init_index = np.where(has_init, c - 1 - self.base_pos[slots], 0)
        bad = has_init & ((init_index < 0) | (init_index >= self.num_stored[slots]))
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise RuntimeError(
                f"no linear-attention state for {c[i]} computed tokens in slot {slots[i]} "
                f"(it holds positions {self.base_pos[slots[i]]}.."
                f"{self.base_pos[slots[i]] + self.num_stored[slots[i]] - 1})"
            )
        self._save_passed(slots, c, saves)
        d = np.asarray(num_draft_tokens, dtype=np.int64)
        num_store = np.minimum(np.where(d > 0, d + 1, 1), self.num_positions)
        self.base_pos[slots] = c + n - num_store
        self.num_stored[slots] = num_store
        self.select_s += time.perf_counter() - t0
        self.num_steps += 1
        # Checkpoint writes as (row, tokens of the row's query before the state, id).
        writes = [
            (r, p - int(c[r]), ck) for r, row in enumerate(saves or []) for p, ck in row if p > c[r]
        ]
        if any(off > n[r] for r, off, _ in writes):
            raise RuntimeError(f"state checkpoints {writes} outside the step's queries {n}")
        return build_gdn_metadata(
            query_start_loc,
            slots,
            has_init,
            init_index,
            num_store,
            short_query_len,
            self.device,
            writes,
        )
