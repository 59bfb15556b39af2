# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""ModelRunner: turns a SchedulerOutput into tensors, runs this stage's slice of the model, and
on the last stage samples (or verifies drafts) and proposes the next drafts. What multimodal
inputs, LoRA, linear-attention states, structured outputs, the logit controls and pipeline
parallelism add to a step are runner features (features.py), called through their hooks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.forward_context import ALL_SHORT, ForwardContext
from vllm.logger import init_logger
from vllm.lora.worker_manager import LoRAWorkerManager
from vllm.model_executor.layers.attention import AttentionLayerBase
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.interfaces import check_supports_pp
from vllm.model_executor.models.registry import resolve_model_cls
from vllm.sequence import IntermediateTensors
from vllm.v1.core.kv_cache_manager import cdiv
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.worker.cpu_memory import reserve_step_activations
from vllm.v1.worker.gpu import cuda_graph
from vllm.v1.worker.gpu.features import LogitRows, RunnerFeature, RunnerFeatures, StepInputs
from vllm.v1.worker.gpu.input_batch import InputBatch, prepare_inputs
from vllm.v1.worker.gpu.kv_block_copy import copy_kv_blocks
from vllm.v1.worker.gpu.linear_attn_states import LinearAttnStates
from vllm.v1.worker.gpu.mm_utils import MultiModalRunnerState
from vllm.v1.worker.gpu.pp_utils import PPHandler
from vllm.v1.worker.gpu.sample.logit_controls import LogitControls
from vllm.v1.worker.gpu.sample.sampler import SamplingArrays, compute_logprobs
from vllm.v1.worker.gpu.sample.structured_outputs import StructuredOutputStates
from vllm.v1.worker.gpu.spec_decode import init_speculator

if TYPE_CHECKING:
    from vllm.model_executor.models.base import CausalLMBase
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import configure_target_aux_taps
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator, ProposeInputs
from vllm.v1.worker.gpu.spec_decode.tree import TreeVerifier
from vllm.v1.worker.gpu.states import RequestStates, StepResult, apply_step_result

logger = init_logger(__name__)


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        mc = vllm_config.model_config
        self.dtype = mc.torch_dtype(self.device.type)
        self.block_size = vllm_config.cache_config.block_size
        assert mc.max_model_len is not None  # ModelConfig.__post_init__ resolves it
        self.max_model_len = mc.max_model_len
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.num_spec = vllm_config.num_speculative_tokens
        spec = vllm_config.speculative_config
        # A dynamic draft tree: its per-request shape travels with the drafts (StepResult).
        self.dynamic_tree = spec is not None and spec.num_tree_nodes is not None
        self.pp = get_pp_group()
        self.tp = get_tp_group()
        self.max_blocks_per_req = cdiv(self.max_model_len + self.num_spec + 1, self.block_size) + 1
        self.states = RequestStates(
            self.max_num_reqs, self.max_model_len, self.max_blocks_per_req, self.num_spec
        )
        self.model: CausalLMBase | None = None
        self.attn_layers: dict[str, AttentionLayerBase] = {}
        self.speculator: BaseSpeculator | None = None
        # Non-first stages: what the previous stage's tensors are received into (load_model).
        self.recv_buffers: dict[str, torch.Tensor] | None = None
        # Verifies drafts (or, without any, takes each request's one sampled token).
        self.rejection_sampler = TreeVerifier.make(self) or RejectionSampler(self.num_spec)
        self.kv_caches: dict[str, torch.Tensor] = {}
        # The runner's features (features.py), each also kept by name; set by load_model.
        # P > 1: the last stage broadcasts each batch's StepResult; the others apply it.
        self.pp_handler: PPHandler | None = None
        # Multimodal models: images, M-RoPE positions, encoder outputs (first stage).
        self.mm: MultiModalRunnerState | None = None
        # enable_lora: the adapters of this stage's layers, each row's slot set per step.
        self.lora: LoRAWorkerManager | None = None
        # Hybrid models: per-request linear-attention states in the KV manager's state slots.
        self.linear_attn_states: LinearAttnStates | None = None
        # Last stage: the grammar matchers of requests with structured outputs.
        self.structured: StructuredOutputStates | None = None
        self.features = RunnerFeatures({})
        # Slots whose request entered this step (the speculator keeps nothing from before).
        self._new_slots = np.zeros(0, dtype=np.int64)
        # Captured forwards of decode / verify steps (CUDA graphs), set up after the KV cache.
        self.cuda_graphs: cuda_graph.CudaGraphRunner | None = None

    # ---- setup --------------------------------------------------------------------------
    def load_model(self) -> None:
        if self.pp.world_size > 1:
            check_supports_pp(resolve_model_cls(self.vllm_config.model_config.architecture))
        # Every registered target is a CausalLMBase (the decoder plus its LM head).
        self.model = cast("CausalLMBase", get_model(self.vllm_config, device=self.device))
        if self.vllm_config.speculative_config is not None:
            # EAGLE3: every stage taps the layers the draft reads (and relays them on).
            configure_target_aux_taps(self.model, self.vllm_config)
            if self.pp.is_last_rank:
                self.speculator = init_speculator(self.vllm_config, self.device)
                self.speculator.load_model(self.model)
        if self.pp.world_size > 1:
            check_supports_pp(self.model)
            if not self.pp.is_first_rank:
                # Made once by the model's own factory, with the aux slots its stage expects
                # (so after the taps are set), and before the KV cache is sized.
                rows = self.vllm_config.scheduler_config.max_num_batched_tokens
                made = self.model.make_empty_intermediate_tensors(rows, self.dtype, self.device)
                self.recv_buffers = dict(made.tensors)
        self.attn_layers = {
            name: m for name, m in self._all_modules() if isinstance(m, AttentionLayerBase)
        }
        self.features = self._build_features()

    def _build_features(self) -> RunnerFeatures:
        """The features this stage's model and configuration need (once, at load)."""
        assert self.model is not None
        cfg, mc = self.vllm_config, self.vllm_config.model_config
        found: dict[str, RunnerFeature | None] = {}
        if self.pp.world_size > 1:
            found["pp"] = self.pp_handler = PPHandler(
                self.max_num_reqs, self.num_spec, self.device, draft_parents=self.dynamic_tree
            )
        if self.model.supports_multimodal:
            self.mm = MultiModalRunnerState(self.model, self.device, self.pp.is_first_rank)
            found["multimodal"] = self.mm
        if cfg.lora_config is not None:
            found["lora"] = self.lora = LoRAWorkerManager(self.model, cfg.lora_config, self.dtype)
        found["linear_attn"] = self.linear_attn_states = LinearAttnStates.from_modules(
            self._all_modules(),
            self.max_num_reqs,
            self.num_spec,
            self.dtype,
            self.device,
            cfg.num_state_checkpoints(),
        )
        if self.pp.is_last_rank:
            assert mc.tokenizer is not None  # ModelConfig resolves it
            self.structured = StructuredOutputStates(mc.tokenizer, mc.vocab_size)
            found["structured_outputs"] = self.structured
            found["logit_controls"] = LogitControls()
        return RunnerFeatures({k: f for k, f in found.items() if f is not None})

    def _all_modules(self) -> Iterator[tuple[str, torch.nn.Module]]:
        assert self.model is not None
        yield from self.model.named_modules()
        if self.speculator is not None and self.speculator.model is not None:
            for name, m in self.speculator.model.named_modules():
                yield "drafter." + name, m

    def kv_cache_bytes_per_block(self) -> int:
        return sum(
            layer.kv_cache_bytes_per_token(self.dtype) * self.block_size
            for layer in self.attn_layers.values()
        )

    def state_cache_bytes(self) -> int:
        """Memory of this stage's features (linear-attention states; taken from the KV budget)."""
        return self.features.bytes()

    def max_useful_blocks(self) -> int:
        return self.max_num_reqs * self.max_blocks_per_req

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for name, layer in self.attn_layers.items():
            cache = torch.zeros(
                layer.kv_cache_shape(num_blocks, self.block_size),
                dtype=self.dtype,
                device=self.device,
            )
            layer.kv_cache = cache
            self.kv_caches[name] = cache
        self.num_blocks = num_blocks
        for f in self.features.allocate:
            f.allocate()
        # torch.zeros writes every page: the pools are resident from here on.
        kv_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches.values())
        logger.info(
            "stage %d: KV cache pool %.1f MiB (%d blocks, %d layers), linear-attention states "
            "%.1f MiB, request-state tables %.1f MiB",
            self.pp.rank,
            kv_bytes / 2**20,
            num_blocks,
            len(self.kv_caches),
            self.state_cache_bytes() / 2**20,
            self.states.nbytes() / 2**20,
        )
        if self.device.type == "cpu":
            reserve_step_activations(
                self.vllm_config, [m for _, m in self._all_modules()], self.pp.rank
            )
        self.cuda_graphs = cuda_graph.capture_for_runner(self)
        if self.speculator is not None:
            self.speculator.capture()

    # ---- per step -----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        st = self.states
        for rid in so.finished_req_ids:
            if self.speculator is not None and rid in st.req_id_to_slot:
                slot = st.slot(rid)
                self.speculator.on_request_removed(
                    slot, st.token_ids[slot, st.num_prompt[slot] : st.num_tokens[slot]].copy()
                )
            s = st.remove(rid)
            for f in self.features.remove_request:
                f.remove_request(rid, s)
        if self.speculator is not None and so.finished_req_ids:
            self.speculator.after_requests_removed()
        self._new_slots = np.array([st.add(d) for d in so.scheduled_new_reqs], dtype=np.int64)
        copy_kv_blocks(self.kv_caches, so.kv_block_copies, self.block_size, self.num_blocks)
        slots = self._new_slots.tolist()
        for f in self.features.add_requests:
            f.add_requests(so.scheduled_new_reqs, slots, st)
        cr = so.scheduled_cached_reqs
        for rid, blocks, nc in zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens):
            s = st.slot(rid)
            if blocks:
                st.append_blocks(s, blocks)
            if int(st.num_computed[s]) != nc:
                raise RuntimeError(
                    f"request {rid}: worker has {int(st.num_computed[s])} computed tokens, "
                    f"the scheduler {nc} (stage {self.pp.rank})"
                )

    def prepare(self, so: SchedulerOutput) -> InputBatch:
        num_sched = np.array(list(so.num_scheduled_tokens.values()), dtype=np.int64)
        return prepare_inputs(
            self.states,
            so.req_ids,
            num_sched,
            self.block_size,
            self.device,
            short_query_len=self.num_spec + 1 if self.num_spec else 1,
            num_tokens_padded=self.vllm_config.padded_num_tokens(int(num_sched.sum())),
            scheduled_drafts=so.num_draft_tokens,
        )

    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, intermediate_tensors: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        for f in self.features.begin_step:
            f.begin_step(so, self.states)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, []) if self.pp.is_last_rank else None
        batch = self.rejection_sampler.layout(self.prepare(so))  # draft trees: positions, mask
        assert self.model is not None, "load_model() must run first"
        if intermediate_tensors is not None:
            rows = intermediate_tensors["hidden_states"].shape[0]
            if rows != batch.num_tokens_after_padding:
                raise RuntimeError(
                    f"stage {self.pp.rank} received {rows} rows of hidden states for a step of "
                    f"{batch.num_tokens_after_padding} (padded) tokens"
                )
        step = StepInputs(so, batch, self.states, batch.positions)
        for f in self.features.prepare_step:
            f.prepare_step(step)
        graphs = self.cuda_graphs
        if (
            graphs is not None
            and step.inputs_embeds is None
            and step.positions.dim() == 1
            and graphs.can_run(batch, batch.attn_metadata)
        ):
            out = graphs.run(batch, batch.attn_metadata)
        else:
            out = self.model(
                batch.input_ids if self.pp.is_first_rank else None,
                step.positions,
                intermediate_tensors,
                step.inputs_embeds,
                ctx=ForwardContext(batch.attn_metadata, step.linear_attn_metadata),
            )
        # Optimistic advance; the last stage's accept/reject result rolls it back.
        self.states.num_computed[batch.idx_mapping_np] += batch.num_scheduled_tokens
        if not self.pp.is_last_rank:
            for f in self.features.after_step:
                f.after_step(batch, None)
            return self._not_in_recv_buffers(out)
        req_steps = None
        if so.req_draft_steps is not None:
            req_steps = np.array([so.req_draft_steps.get(r, 0) for r in batch.req_ids], np.int64)
        return self._sample_and_propose(
            batch, out, so.num_draft_steps, req_steps, so.draft_confidence_floor
        )

    def _not_in_recv_buffers(self, out: IntermediateTensors) -> IntermediateTensors:
        """What a middle stage sends on, none of it a view of its receive buffers: the send
        may still be posted when the next batch is received into them."""
        buffers = self.recv_buffers
        if not buffers:
            return out
        held = {b.untyped_storage().data_ptr() for b in buffers.values()}
        for key, t in list(out.items()):
            if t.untyped_storage().data_ptr() in held:
                out[key] = t.clone()
        return out

    def _sample_and_propose(
        self,
        batch: InputBatch,
        out: torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]],
        num_draft_steps: int | None = None,
        req_draft_steps: np.ndarray | None = None,
        confidence_floor: tuple[float, float] | None = None,
    ) -> ModelRunnerOutput:
        """Last stage: sample (verifying drafts), propose the next drafts (num_draft_steps: the
        most the scheduler verifies next step, None: K; req_draft_steps: per row), apply the
        step's result to the request states and send it to the other stages."""
        assert self.model is not None
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        st = self.states
        slots = batch.idx_mapping_np
        prompt_lp = self._prompt_logprobs(batch, hidden)
        logits: torch.Tensor | None = None
        lp_logits: torch.Tensor | None = None  # what logprobs report (logprobs_mode)
        tokens = np.zeros(0, dtype=np.int64)
        if len(batch.logits_indices_np):
            # The rows being sampled: all decode rows (the small-M kernel).
            logits = self.model.compute_logits(hidden[batch.logits_indices], ALL_SHORT)
            rslots = slots[batch.logits_req_np]
            mode = self.vllm_config.model_config.logprobs_mode
            want_lp = bool((st.num_logprobs[rslots] >= -1).any())
            if want_lp and mode.startswith("raw"):
                lp_logits = logits.clone()  # before the grammar and the controls
            # Position of the token each logits row predicts.
            positions = batch.positions_np[batch.logits_indices_np] + 1
            row_inputs = batch.input_ids_np[batch.logits_indices_np]
            # The grammar's bitmask, then penalties, bias, allowed ids, bad words, min_tokens:
            # per verify position, each seeing the drafts before it as accepted.
            rows = LogitRows(st, rslots, positions, row_inputs)
            for f in self.features.adjust_logits:
                logits = f.adjust_logits(logits, rows)
            sampling = SamplingArrays.of(st, rslots)
            if want_lp and mode.startswith("processed"):
                lp_logits = sampling.processed(logits)
            tokens = sampling.sample(logits, positions).cpu().numpy()
            if self.tp.world_size > 1:
                tokens = self._tp_agree(tokens)
        sampled, num_sampled = self.rejection_sampler(batch, tokens)
        tree_nodes = getattr(self.rejection_sampler, "accepted_nodes", None)
        vb, hidden, aux, lp_logits = self.rejection_sampler.draft_view(
            batch, hidden, aux, lp_logits
        )
        num_rejected = np.where(num_sampled > 0, batch.num_draft_tokens_np + 1 - num_sampled, 0)
        result = StepResult(sampled, num_sampled, num_rejected, None)  # drafts: proposed below
        proposers = confidences = None
        for f in self.features.after_accept:
            # Before drafting: the drafts follow the step's tokens in the grammar too.
            f.after_accept(slots, sampled, num_sampled)
        spec_cfg = self.vllm_config.speculative_config
        grammar = self.structured if spec_cfg and spec_cfg.grammar_aware_drafting else None
        forks = grammar.draft_grammar(slots) if grammar is not None else None
        if self.speculator is not None:
            result.drafts = drafts = self.speculator.propose(
                ProposeInputs(
                    input_batch=vb,
                    states=st,
                    step=result,
                    last_hidden_states=hidden,
                    aux_hidden_states=aux,
                    new_req_mask=np.isin(slots, self._new_slots),
                    mm_embeds=self._draft_mm_embeds(batch),
                    num_draft_steps=num_draft_steps,
                    req_draft_steps=req_draft_steps,
                    draft_confidence_floor=confidence_floor,
                    draft_grammar=forks,
                )
            )
            if self.dynamic_tree:
                result.draft_parents = getattr(self.speculator, "tree_parents", None)
            proposers = self.speculator.row_proposers(getattr(spec_cfg, "method", ""), len(drafts))
            if grammar is not None:
                grammar.constrain_drafts(drafts, slots, jump_forward=True, proposers=proposers)
                grammar.num_masked_draft_rows += forks.num_masked_rows if forks else 0
            valid = result.num_valid_drafts() or []
            confidences = self.speculator.draft_confidences(valid, proposers)
        apply_step_result(st, result, np.where(batch.need_sample_np, slots, -1))
        for f in self.features.after_step:  # PP's broadcast, multimodal's release
            f.after_step(batch, result)
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=result.sampled_token_lists(),
            logprobs=self._logprobs(batch, lp_logits, result),
            prompt_logprobs=prompt_lp,
            num_draft_tokens=result.num_valid_drafts(),
            draft_proposers=proposers,
            draft_confidences=confidences,
            accepted_tree_nodes=tree_nodes,
        )

    def _draft_mm_embeds(self, batch: InputBatch) -> tuple[np.ndarray, torch.Tensor] | None:
        """The encoder outputs the draft's first pass reads at image-placeholder inputs, or
        None. Only where the draft's binding decided to gather them: a draft on a stage without
        the encoder's outputs (the last of several stages) embeds the placeholders as they are."""
        assert self.speculator is not None
        if self.mm is None or not self.speculator.gathers_mm_embeds:
            return None
        return self.mm.draft_embeds(batch)

    def _tp_agree(self, tokens: np.ndarray) -> np.ndarray:
        """TP rank 0's sampled tokens on every TP rank of this stage: the ranks sampled from
        the same gathered logits, but what is verified, applied and broadcast down the
        pipeline is decided once, never by trusting identical floating point."""
        t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)).clone()
        return self.tp.broadcast(t, src=0).numpy()

    def _logprobs(
        self, batch: InputBatch, logits: torch.Tensor | None, result: StepResult
    ) -> list[list[LogprobsLists | None]] | None:
        """Logprobs of every sampled token (per request), when any request asked for them."""
        st = self.states
        if logits is None:
            return None
        rslots = batch.idx_mapping_np[batch.logits_req_np]
        if not (st.num_logprobs[rslots] >= -1).any():
            return None
        n = result.num_sampled
        # A request's sampled tokens came from its first num_sampled logits rows.
        req = np.repeat(np.arange(batch.num_reqs), n)
        kept = (
            batch.cu_num_logits_np[:-1][req] + np.arange(len(req)) - np.repeat(np.cumsum(n) - n, n)
        )
        mask = np.arange(result.sampled.shape[1]) < n[:, None]
        sampled_flat = torch.from_numpy(result.sampled[mask]).to(logits.device)
        lps = compute_logprobs(
            logits[torch.from_numpy(kept).to(logits.device)],
            sampled_flat,
            st.num_logprobs[rslots[kept]],
            as_logits=self.vllm_config.model_config.logprobs_mode.endswith("logits"),
        )
        out: list[list[LogprobsLists | None]] = [[] for _ in range(batch.num_reqs)]
        for r, lp in zip(req.tolist(), lps):
            out[r].append(lp)
        return out

    def _prompt_logprobs(
        self, batch: InputBatch, hidden: torch.Tensor
    ) -> dict[str, list[LogprobsLists | None]]:
        st = self.states
        want = st.num_prompt_logprobs[batch.idx_mapping_np] >= -1
        out: dict[str, list[LogprobsLists | None]] = {}
        if not want.any():
            return out
        for i in np.nonzero(want)[0].tolist():
            s = int(batch.idx_mapping_np[i])
            c = int(batch.num_computed_tokens_np[i])
            n_prompt = int(st.num_prompt[s])
            if c >= n_prompt:
                continue
            start = int(batch.query_start_loc_np[i])
            end_pos = min(c + int(batch.num_scheduled_tokens[i]), n_prompt)
            # Logits at position p predict prompt token p + 1.
            pos = np.arange(c, min(end_pos, n_prompt - 1))
            entries: list[LogprobsLists | None] = [None] if c == 0 else []
            if len(pos):
                rows = torch.from_numpy(start + pos - c).to(hidden.device)
                assert self.model is not None  # load_model ran before any step
                logits = self.model.compute_logits(hidden[rows], None)  # prefill rows: BLAS
                targets = torch.from_numpy(st.token_ids[s, pos + 1].copy()).to(hidden.device)
                k = np.full(len(pos), st.num_prompt_logprobs[s])
                entries += compute_logprobs(logits, targets, k)
            rid = st.slot_req_id[s]
            assert rid is not None  # the slot belongs to a request of this batch
            out[rid] = entries
        return out
