# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Speculator base classes: the interface the model runner calls, and the part shared by every
speculator that runs a draft model (its config, buffers, loading and binding the draft to its
target, draft-token sampling)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from torch import nn

from vllm._custom_ops import cpu_kernels_available
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import (
    TPGroup,
    get_pp_group,
    get_tp_group,
)
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import AttentionLayerBase
from vllm.model_executor.layers.exact_bf16 import keep_exact_bf16_weights
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.interfaces import TargetShares, check_supports_pp
from vllm.model_executor.models.registry import resolve_model_cls
from vllm.v1.worker.gpu.sample.sampler import SamplingArrays

if TYPE_CHECKING:
    from vllm.model_executor.models.base import CausalLMBase
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.sample.structured_outputs import DraftGrammar
    from vllm.v1.worker.gpu.states import RequestStates, StepResult

logger = init_logger(__name__)


C = TypeVar("C")


@dataclass
class ProposeInputs:
    """What the model runner hands propose() after verifying a step (one row per request of
    input_batch): the step's batch, the request states, and what the verifier kept.

    states are the request-state slots as they were before this step's result (history
    token_ids / num_tokens without the tokens just sampled; apply_step_result runs after
    propose). step: what the verifier kept, sampled [R, K + 1] / num_sampled / num_rejected (its
    drafts are what propose() returns). last_hidden_states [num_tokens_after_padding, H] (and,
    EAGLE3-style, aux_hidden_states) are the target's for this step; new_req_mask the rows whose
    request entered its slot this step."""

    input_batch: InputBatch
    states: RequestStates
    step: StepResult
    last_hidden_states: torch.Tensor
    aux_hidden_states: list[torch.Tensor] | None
    new_req_mask: np.ndarray
    mm_embeds: tuple[np.ndarray, torch.Tensor] | None = None
    """Multimodal targets, where the draft's binding gathers encoder outputs: the first-pass
    rows (of the target's layout, shifted left: row r reads the token after row r's) whose
    input is an image placeholder, and that placeholder's encoder output [N, H]."""
    num_draft_steps: int | None = None
    req_draft_steps: np.ndarray | None = None
    """[R] the drafts each row's request verifies next step (None: num_draft_steps for all)."""
    draft_confidence_floor: tuple[float, float] | None = None
    """adaptive_draft_confidence: what the next draft pass must promise, per request and in all
    (SchedulerOutput.draft_confidence_floor)."""
    draft_grammar: DraftGrammar | None = None
    """Structured-output rows: forks of their grammar matchers; a draft model masks its
    choice at each draft position with them (grammar-aware drafting)."""

    def __post_init__(self) -> None:
        self.new_req_mask = np.asarray(self.new_req_mask, dtype=bool)

    @property
    def has_sample(self) -> np.ndarray:
        """[R] bool: the rows that sampled this step (not a non-final prefill chunk)."""
        return self.step.num_sampled > 0

    @cached_property
    def sampling(self) -> SamplingArrays:
        """The rows' sampling parameters (a draft sampling like the target)."""
        return SamplingArrays.of(self.states, self.input_batch.idx_mapping_np)

    def max_drafts(self, k: int) -> int:
        """The most drafts worth proposing per request for a proposer of k (num_draft_steps)."""
        return k if self.num_draft_steps is None else min(k, self.num_draft_steps)

    def follow_histories(
        self,
        corpora: list[C | None],
        new: Callable[[], C],
        size: Callable[[C], int],
        extend: Callable[[C, np.ndarray], None],
        k_max: int,
    ) -> Iterator[tuple[int, C]]:
        """For a draft-free proposer that keeps a token corpus per request-state slot
        (corpora[slot]): bring each row's corpus up to its request's history (new() where the
        request is new to the slot; size(c) tokens it holds, extend(c, tokens) appends), then,
        where the row sampled and k_max > 0, append the tokens just sampled and yield
        (row, corpus) to propose from (before the next row's corpus is touched)."""
        st, step = self.states, self.step
        for i, s in enumerate(self.input_batch.idx_mapping_np.tolist()):
            c = corpora[s]
            if c is None or self.new_req_mask[i]:
                c = corpora[s] = new()
            n_hist, have = int(st.num_tokens[s]), size(c)
            if have < n_hist:
                extend(c, st.token_ids[s, have:n_hist])
            n = int(step.num_sampled[i])
            if n and k_max:
                extend(c, step.sampled[i, :n])
                yield i, c

    def last_valid_indices(self) -> np.ndarray:
        """[R] each request's last token row still valid after rejection."""
        b = self.input_batch
        return b.query_start_loc_np[:-1] + b.num_scheduled_tokens - self.step.num_rejected - 1

    def next_tokens(self, width: int) -> np.ndarray:
        """[R, width] the known tokens after each request's last valid row: the one just
        sampled, then the prompt tokens after the chunk (all of them prompt tokens for a
        non-final prefill chunk)."""
        b, st, step = self.input_batch, self.states, self.step
        R = b.num_reqs
        chunk_end = b.num_computed_tokens_np + b.num_scheduled_tokens
        cols = np.minimum(chunk_end[:, None] + np.arange(width), st.token_ids.shape[1] - 1)
        nxt = st.token_ids[b.idx_mapping_np[:, None], cols]
        last = step.sampled[np.arange(R), np.maximum(step.num_sampled - 1, 0)]
        has = self.has_sample
        nxt[has, 0] = last[has]
        return nxt


class BaseSpeculator(ABC):
    """What the model runner needs from a speculator (built on the last pipeline stage only)."""

    model: nn.Module | None = None

    @property
    def gathers_mm_embeds(self) -> bool:
        """Whether propose() takes the target's encoder outputs (the draft's binding decided
        so: a draft taking them, on a stage holding them)."""
        return False

    @abstractmethod
    def load_model(self, target_model: CausalLMBase) -> None:
        """Build the drafter next to the (already loaded) target model."""

    @abstractmethod
    def capture(self) -> None:
        """Warm-up (and, where graphs are used, capture) at max_num_reqs, once the KV caches
        exist and before serving."""

    @property
    def num_lookahead_tokens(self) -> int:
        """Known tokens after each request's last position that propose() reads (the width of
        its ProposeInputs.next_tokens)."""
        return 1

    @abstractmethod
    def propose(self, inputs: ProposeInputs) -> np.ndarray:
        """Draft tokens [num_reqs, K] int64 for the rows of inputs.input_batch."""

    def draft_confidences(
        self, num_valid: list[int], proposers: list[str] | None
    ) -> list[list[float]] | None:
        """adaptive_draft_confidence: per batch row of the last propose(), the running product
        of the draft's confidence in each of its valid drafts; None: not reported."""
        rec = getattr(self, "confidence", None)
        return None if rec is None else rec.report(num_valid, proposers)

    def row_proposers(self, method: str, num_rows: int) -> list[str]:
        """The proposer of each row's drafts from the last propose() (the metrics' label):
        the configured method, unless a hybrid chose per row."""
        return [method] * num_rows

    def end_warm_up(self) -> None:  # noqa: B027 - optional hook: nothing learned by default
        """Forget what the start-up's dummy requests taught (suffix decoding's global cache).
        Default: nothing."""

    def on_request_removed(self, slot: int, output_token_ids: np.ndarray) -> None:  # noqa: B027
        """A request left request-state slot `slot` (finished, aborted or preempted) having
        written output_token_ids (suffix decoding learns from them). Default: nothing."""

    def after_requests_removed(self) -> None:  # noqa: B027 - optional hook
        """After the on_request_removed calls of one step, before the slots are reused (a
        draft writes what it owes the removed requests' KV blocks). Default: nothing."""


class DraftFreeSpeculator(BaseSpeculator):
    """A speculator without a draft model (prompt lookup, suffix decoding, jump-forward): its
    drafts come from tokens already known, so there is nothing to build or warm up."""

    model = None

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        spec = vllm_config.speculative_config
        if spec is None:
            raise ValueError("a speculator needs speculative_config")
        self.speculative_config = spec
        self.num_speculative_steps = spec.num_speculative_tokens
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        # The match each row of the last propose() drafted from (0: none), for a hybrid.
        self.last_match_lengths = np.zeros(0, dtype=np.int64)

    def load_model(self, target_model: CausalLMBase) -> None:
        """Nothing to build."""

    def capture(self) -> None:
        """Nothing to warm up."""


class DraftModelSpeculator(BaseSpeculator):
    """A speculator with a draft nn.Module of its own (MTP head, EAGLE head)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        spec = vllm_config.speculative_config
        if spec is None:
            raise ValueError("a speculator needs speculative_config")
        self.vllm_config = vllm_config
        self.speculative_config = spec
        self.device = torch.device(device)
        self.method = spec.method
        self.num_speculative_steps = spec.num_speculative_tokens
        self.draft_model_config = spec.draft_model_config
        sc = vllm_config.scheduler_config
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        max_model_len = vllm_config.model_config.max_model_len
        assert max_model_len is not None  # ModelConfig.__post_init__ resolves it
        self.max_model_len = max_model_len
        self.block_size = vllm_config.cache_config.block_size
        self.vocab_size = vllm_config.model_config.vocab_size
        self.dtype = vllm_config.model_config.torch_dtype(self.device.type)
        self.draft_sample_method = spec.draft_sample_method
        self.model: DraftModel | None = None
        self.target_hidden_size = 0
        K = self.num_speculative_steps
        # Draft tokens of the current batch, one row per batch row.
        self.draft_tokens = np.zeros((self.max_num_reqs, K), dtype=np.int64)
        self.target_attn_layer_names: set[str] = set()
        self.draft_attn_layer_names: set[str] = set()

    @property
    def draft(self) -> DraftModel:
        assert self.model is not None, "load_model() must run first"
        return self.model

    @property
    def gathers_mm_embeds(self) -> bool:
        return self.model is not None and bool(self.model.gather_mm_embeds)

    def on_draft_bound(self, draft: DraftModel, shares: TargetShares) -> None:
        """After the draft is bound to its target: take up the draft's optional capabilities
        (subclasses)."""

    def load_model(self, target_model: CausalLMBase) -> None:
        """Build and load the draft, then bind it to the target (see DraftModel.bind_target).
        The target's aux taps are set before (the runner sets them on every stage)."""
        self.target_attn_layer_names = _attn_layer_names(target_model)
        target_ids = {id(m) for m in target_model.modules()}
        shares = target_model.draft_shares()
        self.target_hidden_size = shares.hidden_size
        draft = load_draft_model(self.vllm_config, self.device)
        draft.bind_target(shares)
        self.model = draft
        self.on_draft_bound(draft, shares)
        self.draft_attn_layer_names = {
            n
            for n, m in draft.named_modules()
            if isinstance(m, AttentionLayerBase) and id(m) not in target_ids
        }
        # The hidden states the draft's first pass reads, in a persistent buffer (the fixed
        # input a captured graph or compiled forward needs), shaped by the draft itself: its
        # SupportsPP make_empty_intermediate_tensors gives rows of the hidden size it consumes.
        rows = max(self.max_num_tokens, self.max_num_reqs)
        self.hidden_states = draft.make_empty_intermediate_tensors(rows, self.dtype, self.device)[
            "hidden_states"
        ]

    def stage_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """Copy the first pass's hidden states [T, H] into the persistent buffer; returns the
        [T, H] view the draft runs on."""
        n = hidden.shape[0]
        if n > self.hidden_states.shape[0] or hidden.shape[1:] != self.hidden_states.shape[1:]:
            raise RuntimeError(
                f"the draft's hidden-state buffer {tuple(self.hidden_states.shape)} (from its "
                f"make_empty_intermediate_tensors) cannot take {tuple(hidden.shape)}"
            )
        out = self.hidden_states[:n]
        out.copy_(hidden)
        return out

    def agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """TP rank 0's draft tokens on every TP rank (the ranks drafted from the same
        gathered logits, but the tokens every rank feeds its next draft pass and reports are
        decided once, never by trusting identical floating point)."""
        tp = get_tp_group()
        if tp.world_size == 1:
            return tokens
        t = tokens.to(device="cpu", dtype=torch.int64).contiguous()
        return tp.broadcast(t, src=0).to(tokens.device)

    def sample_draft(
        self, logits: torch.Tensor, positions: np.ndarray, sampling: SamplingArrays
    ) -> torch.Tensor:
        """One draft token per row of logits [R, V] (one row per request of `sampling`).

        Greedy unless draft_sample_method is "probabilistic": then each request's token is the
        target sampler's own draw (its temperature and filters, noise keyed by (seed,
        position)) over the draft's logits, which is what makes it match the target's token
        whenever the two distributions agree (see the rejection sampler). positions = true
        sequence position of the token being drafted."""
        if self.draft_sample_method != "probabilistic":
            return logits.argmax(-1)
        return sampling.sample(logits, positions)


def load_draft_model(vllm_config: VllmConfig, device: torch.device) -> DraftModel:
    """Build the draft of speculative_config and load its own weights (not yet bound to its
    target). Under pipeline parallelism it lives on the last stage next to its target, so it
    must be buildable there (SupportsPP with a working factory)."""
    spec = vllm_config.speculative_config
    assert spec is not None  # only speculators call this
    multi_stage = get_pp_group().world_size > 1
    if multi_stage:
        check_supports_pp(resolve_model_cls(spec.draft_model_config.architecture))
    if spec.draft_tensor_parallel_size == 1 and get_tp_group().world_size > 1:
        # Whole on every TP rank (each computes the same; agree() keeps their tokens one).
        draft = get_model(
            vllm_config, model_config=spec.draft_model_config, device=device, tp_group=TPGroup()
        )
    else:
        draft = get_model(vllm_config, model_config=spec.draft_model_config, device=device)
    if multi_stage:
        check_supports_pp(draft)
    if not isinstance(draft, DraftModel):
        raise TypeError(
            f"{type(draft).__name__} ({spec.draft_model_config.architecture}) is not a draft "
            f"model; speculative_config.method {spec.method!r} needs one"
        )
    if (
        draft.keeps_exact_bf16_weights
        and device.type == "cpu"
        and spec.draft_model_config.torch_dtype(device.type) == torch.float32
        and cpu_kernels_available()
    ):
        # A bf16 head under an fp32 target: the same drafts from half the weight bytes.
        saved = keep_exact_bf16_weights(draft)
        if saved:
            logger.info("draft: %.1f MiB of its fp32 weights kept in bf16 (exact)", saved / 2**20)
    return draft


def _attn_layer_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, AttentionLayerBase)}
