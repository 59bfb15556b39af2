# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The runner's multimodal state: each request's images and M-RoPE positions (every stage),
the encoder outputs (first stage: the encoder runs once per image, its output kept while a
request needing it lives), and the merge of those outputs into a step's input embeddings over
whatever part of an image's placeholder run the step's chunk covers. A runner feature: the
runner keeps one per multimodal model and calls nothing of it but its hooks (and the gather of
encoder outputs for a draft's first pass)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm.multimodal.inputs import MultiModalFeature, MultiModalInputs
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.gpu.features import RunnerFeature, StepInputs
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.states import RequestStates, StepResult


class MultiModalRunnerState(RunnerFeature):
    def __init__(self, model: Any, device: torch.device, first_stage: bool = True) -> None:
        self.model = model  # the target: its embedding and (first stage) its encoder
        self.device = device
        self.first_stage = first_stage
        self.inputs: dict[str, MultiModalInputs] = {}
        # Encoder outputs by image content hash, and the requests holding each.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self._holders: dict[str, set[str]] = {}
        # Pixel-value bytes this stage received (stages after the first receive none).
        self.pixel_bytes_received = 0

    # ---- runner hooks -----------------------------------------------------------------------
    def add_requests(
        self, new_reqs: list[NewRequestData], slots: list[int], states: RequestStates
    ) -> None:
        for d in new_reqs:
            self.add(d.req_id, d.mm_inputs)

    def remove_request(self, req_id: str, slot: int | None) -> None:
        self.remove(req_id)

    def prepare_step(self, step: StepInputs) -> None:
        """Steps with a multimodal request: M-RoPE positions, and on the first stage the input
        embeddings with the encoder outputs over the image placeholders."""
        batch = step.batch
        if not self.any_in(batch):
            return
        step.positions = self.mrope_positions(batch, batch.positions)
        if self.first_stage:
            embeds = self.model.embed_input_ids(batch.input_ids)
            self.merge_embeds(self.model, batch, embeds)
            step.inputs_embeds = embeds

    def after_step(self, batch: InputBatch, result: StepResult | None) -> None:
        # After the draft's gather (which may read the image right after a chunk).
        self.release_computed(batch)

    def draft_embeds(self, batch: InputBatch) -> tuple[np.ndarray, torch.Tensor] | None:
        """The encoder outputs a draft's first pass reads at image-placeholder inputs (row r
        reads the token at position r + 1): (rows, embeddings), or None."""
        if not self.any_in(batch):
            return None
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        qsl = batch.query_start_loc_np
        for i, rid in enumerate(batch.req_ids):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            for k, row in self.embeds_at(self.model, rid, batch.positions_np[lo:hi] + 1):
                rows.append(lo + k)
                embeds.append(row)
        if not rows:
            return None
        return np.array(rows, dtype=np.int64), torch.stack(embeds)

    # ---- state ------------------------------------------------------------------------------
    def add(self, req_id: str, mm: MultiModalInputs | None) -> None:
        if mm is not None:
            self.inputs[req_id] = mm
            self.pixel_bytes_received += mm.pixel_bytes

    def remove(self, req_id: str) -> None:
        mm = self.inputs.pop(req_id, None)
        if mm is None:
            return
        for f in mm.features:
            self._release(req_id, f.identifier)

    def _release(self, req_id: str, identifier: str) -> None:
        holders = self._holders.get(identifier)
        if holders is not None:
            holders.discard(req_id)
            if not holders:
                del self._holders[identifier]
                self.encoder_cache.pop(identifier, None)

    def release_computed(self, batch: InputBatch) -> None:
        """After a step: an image whose placeholder run the request has now computed in full
        is no longer needed by it (a preempted request that recomputes encodes it again)."""
        for i, rid in enumerate(batch.req_ids):
            mm = self.inputs.get(rid)
            if mm is None:
                continue
            done = int(batch.num_computed_tokens_np[i]) + int(batch.num_scheduled_tokens[i])
            for f in mm.features:
                if f.offset + f.length <= done:
                    self._release(rid, f.identifier)

    def any_in(self, batch: InputBatch) -> bool:
        return any(r in self.inputs for r in batch.req_ids)

    def mrope_positions(self, batch: InputBatch, positions: torch.Tensor) -> torch.Tensor:
        """[3, padded T] positions of the batch: every axis the plain position, except rows of
        multimodal requests, which take their prompt's M-RoPE positions (later tokens: shifted
        by the request's delta)."""
        pos = np.repeat(positions.cpu().numpy()[None, :], 3, axis=0)
        qsl = batch.query_start_loc_np
        for i, rid in enumerate(batch.req_ids):
            mm = self.inputs.get(rid)
            if mm is None:
                continue
            sl = slice(int(qsl[i]), int(qsl[i + 1]))
            pos[:, sl] = mm.mrope_of(batch.positions_np[sl])
        return torch.from_numpy(pos).to(self.device)

    def _encode(self, model: Any, req_id: str, wanted: list[int]) -> None:
        """Run the encoder on the request's images `wanted` (indices) not yet cached."""
        mm = self.inputs[req_id]
        todo: dict[str, MultiModalFeature] = {}
        for j in wanted:
            f = mm.features[j]
            self._holders.setdefault(f.identifier, set()).add(req_id)
            if f.identifier not in self.encoder_cache:
                todo.setdefault(f.identifier, f)
        if not todo:
            return
        feats = list(todo.values())
        if any(f.pixel_values is None for f in feats):
            raise RuntimeError("an image reached a stage without its pixel values")
        pixels = torch.from_numpy(
            np.concatenate([f.pixel_values for f in feats if f.pixel_values is not None])
        ).to(self.device)
        outs = model.embed_multimodal(pixels, [f.grid_thw for f in feats])
        for f, out in zip(feats, outs):
            if out.shape[0] != f.length:
                raise RuntimeError(
                    f"the encoder gave {out.shape[0]} rows for an image of {f.length} tokens"
                )
            self.encoder_cache[f.identifier] = out

    def embeds_at(self, model: Any, req_id: str, positions: np.ndarray) -> list[tuple[int, Any]]:
        """(index into positions, encoder output row) for every position inside one of the
        request's placeholder runs; encodes what is missing."""
        mm = self.inputs.get(req_id)
        if mm is None:
            return []
        hits = []
        need = []
        for j, f in enumerate(mm.features):
            inside = np.nonzero((positions >= f.offset) & (positions < f.offset + f.length))[0]
            if len(inside):
                need.append(j)
                hits.append((f, inside))
        self._encode(model, req_id, need)
        out = []
        for f, inside in hits:
            rows = self.encoder_cache[f.identifier]
            for k in inside.tolist():
                out.append((k, rows[int(positions[k]) - f.offset]))
        return out

    def merge_embeds(self, model: Any, batch: InputBatch, embeds: torch.Tensor) -> None:
        """Write the encoder outputs over the placeholder rows the batch's chunks cover."""
        qsl = batch.query_start_loc_np
        for i, rid in enumerate(batch.req_ids):
            mm = self.inputs.get(rid)
            if mm is None:
                continue
            c = int(batch.num_computed_tokens_np[i])
            n = int(batch.num_scheduled_tokens[i])
            need = [
                j
                for j, f in enumerate(mm.features)
                if max(c, f.offset) < min(c + n, f.offset + f.length)
            ]
            self._encode(model, rid, need)
            for j in need:
                f = mm.features[j]
                lo, hi = max(c, f.offset), min(c + n, f.offset + f.length)
                start = int(qsl[i]) + lo - c
                rows = self.encoder_cache[f.identifier][lo - f.offset : hi - f.offset]
                embeds[start : start + hi - lo] = rows.to(embeds.dtype)
