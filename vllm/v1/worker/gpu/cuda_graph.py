# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""CUDA graphs of the target's forward for decode / verify steps.

At start-up (after the KV cache exists) the runner captures one graph per padded step size N
of compilation_config.cudagraph_capture_sizes that a decode / verify step can have (the sizes
below max_num_seqs * (1 + K), and the first at or above it). A graph reads everything that
changes per step from persistent buffers this class owns - token ids, positions, slot mapping,
block table, sequence lengths, query_start_loc - and the step's metadata points the attention
backend at them (AttentionMetadata.static_layout). Each captured step has a fixed request capacity
R = min(N, max_num_seqs): entries past the step's real requests are empty (query_start_loc
repeating the token count, sequence length 0), token rows past the real ones have slot -1 (no KV
write) and position 0, so the Triton kernels' grids, which depend only on N and R, fit every
step of that size. A step runs from a graph when its padded size has one, every request is a
decode / verify request (at most 1 + K query rows) and no tree mask is set; otherwise eager.

Capture needs every attention impl to read only device tensors (supports_cuda_graphs: the
Triton impls) and a forward without host synchronisation: a model whose forward syncs (the
MoE's per-expert row counts, the V3.2 indexer) fails to capture, and the runner then logs why
and stays eager. Only P = 1, TP = 1, non-hybrid, text-only targets are captured; the drafts run
eagerly.

`GraphRecorder` is the one device-specific part. On CPU there are no CUDA graphs: tests use an
emulation (`EagerReplay`) whose "replay" runs the captured closure again - the closure sees
only what it captured (the capture-time metadata, the buffers), as a real graph does - so the
shapes, the padding, the buffer refills and the reuse of the same buffers on every step are
checked on CPU. What only a GPU checks: that capture succeeds (no host sync, no allocation
outside the graph pool), that replay is bit-identical to eager, and its speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vllm.attention.backends.torch_paged import AttentionMetadata, build_attn_metadata
from vllm.forward_context import ForwardContext
from vllm.logger import init_logger

logger = init_logger(__name__)


class EagerReplay:
    """CPU emulation of a captured graph: replay() runs the captured closure again."""

    def __init__(self) -> None:
        self.fn: Callable[[], Any] | None = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        return fn()

    def replay(self) -> Any:
        assert self.fn is not None
        return self.fn()


class CudaGraph:
    """A torch.cuda.CUDAGraph: capture() records fn's launches once, replay() re-launches
    them; every graph of a runner shares one memory pool."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.out: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        fn()  # warm-up on a side stream: Triton compiles, allocator caches fill
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.out = fn()
        return self.out

    def replay(self) -> Any:
        self.graph.replay()
        return self.out


class GraphRecorder:
    """Makes the graph objects for one device kind: CUDA graphs on "cuda"; the CPU emulation
    on "emulate" (tests)."""

    def __init__(self, kind: str) -> None:
        if kind not in ("cuda", "emulate"):
            raise ValueError(f"graph kind must be 'cuda' or 'emulate', got {kind!r}")
        self.kind = kind
        self.pool = torch.cuda.graph_pool_handle() if kind == "cuda" else None

    def new(self) -> CudaGraph | EagerReplay:
        return CudaGraph(self.pool) if self.kind == "cuda" else EagerReplay()


def graph_kind(device: torch.device) -> str | None:
    """Which graphs the runner captures on this device (None: none). Tests on CPU patch it to
    'emulate'."""
    return "cuda" if device.type == "cuda" else None


class CudaGraphRunner:
    """Captured forwards of decode / verify steps, one per size, and their buffers."""

    def __init__(
        self,
        sizes: list[int],
        max_num_reqs: int,
        max_blocks_per_req: int,
        short_query_len: int,
        block_size: int,
        device: torch.device,
        recorder: GraphRecorder,
    ) -> None:
        # Decode / verify steps have at most this many tokens; a size above it is captured
        # only as the one such a step pads up to.
        most = max_num_reqs * short_query_len
        ordered = sorted(set(sizes))
        above = [n for n in ordered if n >= most][:1]
        self.sizes = [n for n in ordered if n < most] + above
        self.max_num_reqs = max_num_reqs
        self.short_query_len = short_query_len
        self.block_size = block_size
        self.device = device
        self.recorder = recorder
        n_max = max(self.sizes, default=0)
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(n_max, dtype=i64, device=device)
        self.positions = torch.zeros(n_max, dtype=i64, device=device)
        self.slot_mapping = torch.full((n_max,), -1, dtype=i64, device=device)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=i32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=i32, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=i32, device=device)
        self.graphs: dict[int, CudaGraph | EagerReplay] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.num_replays = 0

    def capacity(self, n: int) -> int:
        """Requests a step of n tokens can hold (each has at least one)."""
        return min(n, self.max_num_reqs)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "slot_mapping": self.slot_mapping,
            "block_table": self.block_table,
            "seq_lens": self.seq_lens,
            "query_start_loc": self.query_start_loc,
        }

    def graph_metadata(self, n: int) -> AttentionMetadata:
        """The metadata a graph of n tokens is captured with: the buffers' device tensors, and
        host arrays of a decode-only layout of its capacity (what the linear layers' row
        routing reads: every row a short-query row, as in every step the graph replays)."""
        r = self.capacity(n)
        q_lens = np.full(r, n // r, dtype=np.int64)
        q_lens[: n % r] += 1
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        meta = build_attn_metadata(
            qsl,
            q_lens.copy(),
            np.zeros((r, 1), dtype=np.int64),
            self.block_size,
            self.device,
            slot_mapping=self.slot_mapping[:n],
            positions=np.zeros(n, dtype=np.int64),
            # Every row a short-query row, whatever this dummy split (the kernels take
            # max_query_len from static_layout).
            short_query_len=n,
        )
        meta.static_layout = (
            self.block_table[:r],
            self.seq_lens[:r],
            self.query_start_loc[: r + 1],
            self.short_query_len,
        )
        return meta

    def capture(self, forward: Callable[[torch.Tensor, torch.Tensor, ForwardContext], Any]) -> None:
        """Capture forward(input_ids, positions, ctx) at every size, largest first (the graph
        pool then serves the smaller ones); ctx is the ForwardContext of the size's graph
        metadata (its rows all decode rows). The buffers hold a valid dummy step meanwhile: one
        token per request, no KV writes (slot -1)."""
        for n in sorted(self.sizes, reverse=True):
            r = self.capacity(n)
            self._fill_dummy(n)
            meta = self.graph_metadata(n)
            ids, pos = self.input_ids[:n], self.positions[:n]

            def run(ctx=ForwardContext(meta), ids=ids, pos=pos):
                return forward(ids, pos, ctx)

            graph = self.recorder.new()
            graph.capture(run)
            self.graphs[n] = graph
            self.metas[n] = meta
            logger.debug("captured the forward of %d tokens (%d requests)", n, r)

    def _fill_dummy(self, n: int) -> None:
        r = self.capacity(n)
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.block_table.zero_()
        q_lens = torch.full((r,), n // r, dtype=torch.int32)
        q_lens[: n % r] += 1
        self.seq_lens.zero_()
        self.seq_lens[:r].copy_(q_lens)
        self.query_start_loc.zero_()
        self.query_start_loc[1 : r + 1].copy_(torch.cumsum(q_lens, 0))

    def can_run(self, batch: Any, meta: AttentionMetadata) -> bool:
        """Whether this step replays a graph: a captured padded size, short-query requests
        only, within the size's request capacity, no tree mask."""
        n = batch.num_tokens_after_padding
        if n not in self.graphs or meta.tree_mask is not None:
            return False
        if batch.num_reqs > self.capacity(n):
            return False
        return meta.max_query_len <= self.short_query_len

    def run(self, batch: Any, meta: AttentionMetadata) -> Any:
        """Refill the buffers with this step and replay its size's graph. The output tensors
        are the graph's own: valid until the next replay."""
        n, t, r = batch.num_tokens_after_padding, meta.num_tokens, batch.num_reqs
        self.input_ids[:n].copy_(batch.input_ids[:n], non_blocking=True)
        self.positions[:n].copy_(batch.positions[:n], non_blocking=True)
        self.slot_mapping[:t].copy_(meta.slot_mapping[:t], non_blocking=True)
        self.slot_mapping[t:n].fill_(-1)
        cap = self.capacity(n)
        table = np.zeros((cap, self.block_table.shape[1]), dtype=np.int32)
        width = min(meta.block_table_np.shape[1], table.shape[1])
        table[:r, :width] = meta.block_table_np[:, :width]
        seq = np.zeros(cap, dtype=np.int32)
        seq[:r] = meta.seq_lens_np
        qsl = np.full(cap + 1, t, dtype=np.int32)
        qsl[: r + 1] = meta.query_start_loc_np
        host = torch.from_numpy(np.concatenate([table.reshape(-1), seq, qsl]))
        dev = host.to(self.device, non_blocking=True)
        k = table.size
        self.block_table[:cap].copy_(dev[:k].view(cap, -1))
        self.seq_lens[:cap].copy_(dev[k : k + cap])
        self.query_start_loc[: cap + 1].copy_(dev[k + cap :])
        self.num_replays += 1
        return self.graphs[n].replay()


def graphs_unsupported(
    vllm_config: Any,
    model: Any,
    attn_layers: dict[str, Any],
    parallel: bool,
    hybrid: bool,
    lora: bool = False,
) -> str | None:
    """Why a stage's forward is not captured (None: it is)."""
    if vllm_config.enforce_eager or not vllm_config.compilation_config.cudagraph_capture_sizes:
        return "no capture sizes (or enforce_eager)"
    if parallel:
        return "pipeline / tensor parallelism"
    if lora:
        return "LoRA adapters (enable_lora)"
    if hybrid:
        return "a hybrid model (linear-attention states)"
    if model.supports_multimodal:
        return "a multimodal model"
    target = [layer for name, layer in attn_layers.items() if not name.startswith("drafter.")]
    slow = sorted(
        {
            type(layer.impl).__name__
            for layer in target
            if not getattr(layer.impl, "supports_cuda_graphs", False)
        }
    )
    if slow:
        return f"attention impls that build their layout on the host: {slow}"
    return None


def capture_step_graphs(
    vllm_config: Any,
    model: Any,
    attn_layers: dict[str, Any],
    *,
    parallel: bool,
    hybrid: bool,
    lora: bool = False,
    max_num_reqs: int,
    max_blocks_per_req: int,
    rows_per_req: int,
    block_size: int,
    device: torch.device,
) -> CudaGraphRunner | None:
    """Capture the target's decode / verify forwards at the padded step sizes at start-up; None
    where the device has no graphs, the stage cannot be captured (the reason logged) or the
    capture failed (steps then run eagerly)."""
    kind = graph_kind(device)
    if kind is None:
        return None
    why = graphs_unsupported(vllm_config, model, attn_layers, parallel, hybrid, lora)
    if why is not None:
        logger.info("CUDA graphs off: %s", why)
        return None
    sizes = vllm_config.compilation_config.cudagraph_capture_sizes or []
    graphs = CudaGraphRunner(
        sizes,
        max_num_reqs,
        max_blocks_per_req,
        rows_per_req,
        block_size,
        device,
        GraphRecorder(kind),
    )
    try:
        with torch.inference_mode():
            graphs.capture(lambda ids, pos, ctx: model(ids, pos, None, None, ctx=ctx))
    except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
        logger.warning(
            "CUDA graph capture failed (%s: %s); decode steps run eagerly",
            type(e).__name__,
            " ".join(str(e).split())[:300],
        )
        return None
    logger.info("CUDA graphs (%s) captured for step sizes %s", kind, graphs.sizes)
    return graphs


def capture_for_runner(runner: Any) -> CudaGraphRunner | None:
    """capture_step_graphs for a ModelRunner's target model, with the runner's sizes."""
    assert runner.model is not None
    return capture_step_graphs(
        runner.vllm_config,
        runner.model,
        runner.attn_layers,
        parallel=runner.pp.world_size > 1 or runner.tp.world_size > 1,
        hybrid=runner.linear_attn_states is not None,
        lora=runner.lora is not None,
        max_num_reqs=runner.max_num_reqs,
        max_blocks_per_req=runner.max_blocks_per_req,
        rows_per_req=runner.num_spec + 1,
        block_size=runner.block_size,
        device=runner.device,
    )
