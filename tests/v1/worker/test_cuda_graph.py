# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""CUDA graphs of decode / verify steps, checked on CPU as far as CPU can: the capture sizes
kept, the buffers' shapes, the padding written into them (slot -1, empty requests), the same
buffers reused by every replay, and - with the Triton backend under the interpreter and the
graphs emulated (a replay re-runs the captured closure, which sees only the capture-time
metadata and the buffers, as a real graph does) - greedy output equal to HF's, with MTP's verify
rows replayed too.

What only a GPU can check (benchmarks/gpu_check.py runs it): that torch.cuda.graph captures the
forward (no host sync, no allocation outside the pool: the MoE and DSA forwards sync, so those
models stay eager), that a real replay equals the eager step, and the speed-up."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.attention.backends.torch_paged import build_attn_metadata
from vllm.testing.engine_utils import hf_greedy, make_prompts
from vllm.v1.worker.gpu import cuda_graph
from vllm.v1.worker.gpu.cuda_graph import CudaGraphRunner, GraphRecorder


def _runner(sizes=(1, 2, 4, 8, 16), max_reqs=3, short=2) -> CudaGraphRunner:
    return CudaGraphRunner(
        list(sizes), max_reqs, 5, short, 4, torch.device("cpu"), GraphRecorder("emulate")
    )


def test_capture_sizes_buffers_and_metadata() -> None:
    g = _runner()
    # At most 3 requests x 2 rows = 6 tokens: 8 is what such a step pads to, 16 is never one.
    assert g.sizes == [1, 2, 4, 8]
    shapes = {k: tuple(v.shape) for k, v in g.buffers().items()}
    assert shapes == {
        "input_ids": (8,),
        "positions": (8,),
        "slot_mapping": (8,),
        "block_table": (3, 5),
        "seq_lens": (3,),
        "query_start_loc": (4,),
    }
    seen: list[tuple] = []

    def forward(ids, pos, ctx):
        meta = ctx.attn_metadata
        bt, sl, qsl, max_q = meta.device_layout()
        seen.append((ids.shape[0], bt.shape[0], qsl.tolist(), max_q, meta.num_tokens))
        return ids * 10 + pos

    g.capture(forward)
    # Largest first; capacity min(n, max_reqs); dummy steps: one-or-two-token requests.
    assert seen == [
        (8, 3, [0, 3, 6, 8], 2, 8),
        (4, 3, [0, 2, 3, 4], 2, 4),
        (2, 2, [0, 1, 2], 2, 2),
        (1, 1, [0, 1], 2, 1),
    ]
    assert (g.slot_mapping == -1).all()  # capture writes no KV


def _batch(q_lens, seq_lens, n_pad, table):
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    T = int(qsl[-1])
    meta = build_attn_metadata(qsl, np.array(seq_lens), table, 4, "cpu")
    ids = torch.arange(100, 100 + n_pad)
    pos = torch.arange(n_pad) + 1
    batch = type(
        "B",
        (),
        dict(num_tokens_after_padding=n_pad, num_reqs=len(q_lens), input_ids=ids, positions=pos),
    )()
    return batch, meta, T


def test_replay_refills_the_same_buffers_with_padding() -> None:
    g = _runner()
    g.capture(lambda ids, pos, ctx: ids * 10 + pos)
    ptrs = {k: v.data_ptr() for k, v in g.buffers().items()}
    table = np.arange(10).reshape(2, 5)
    batch, meta, T = _batch([2, 1], [7, 5], 4, table)  # 3 real tokens padded to 4
    assert g.can_run(batch, meta)
    out = g.run(batch, meta)
    assert out.tolist() == [(100 + i) * 10 + i + 1 for i in range(4)]
    assert g.slot_mapping[:4].tolist() == [*meta.slot_mapping.tolist(), -1]
    assert g.seq_lens.tolist() == [7, 5, 0]  # capacity 3: one empty request
    assert g.query_start_loc.tolist() == [0, 2, 3, 3]
    assert g.block_table[:2].tolist() == table.tolist() and (g.block_table[2] == 0).all()
    # A later, smaller step: the same buffers, the stale tail overwritten.
    batch, meta, T = _batch([1, 1], [9, 3], 2, table)
    g.run(batch, meta)
    assert g.query_start_loc[:3].tolist() == [0, 1, 2] and g.seq_lens[:2].tolist() == [9, 3]
    assert {k: v.data_ptr() for k, v in g.buffers().items()} == ptrs
    assert g.num_replays == 2
    # Not replayed: a prefill row (3 > 2 query rows), a size without a graph, a tree mask.
    assert not g.can_run(*_batch([3], [3], 4, table[:1])[:2])
    assert not g.can_run(*_batch([1, 1, 1], [3, 3, 3], 3, table[:1].repeat(3, 0))[:2])
    assert not g.can_run(*_batch([2, 2, 2], [3, 3, 3], 16, table[:1].repeat(3, 0))[:2])
    batch, meta, _ = _batch([1], [4], 1, table[:1])
    meta.tree_mask = torch.ones(1, 1, 1, dtype=torch.bool)
    assert not g.can_run(batch, meta)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize(
    "family, spec",
    [("deepseek_v3_mtp1_dir", 2), ("llama_dir", None)],
    ids=["deepseek-mtp2", "llama"],
)
def test_engine_replays_emulated_graphs(request, monkeypatch, family, spec) -> None:
    """Decode and MTP verify steps (1 + 2 rows per request) replayed from emulated graphs of
    the Triton MLA path equal HF's greedy output (on CPU; a Llama / GQA run without graphs is
    in tests/e2e/test_triton_backend.py, the GQA kernel under a graph's padded layout in
    tests/kernels/test_triton_kernels.py). On a GPU: real CUDA graphs of the Llama (the MoE
    forward syncs on the host, so DeepSeek stays eager)."""
    gpu = torch.cuda.is_available()
    if gpu == (family != "llama_dir"):
        pytest.skip("CPU: the MLA + MTP case (emulated graphs); GPU: Llama (real graphs)")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    if not gpu:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(cuda_graph, "graph_kind", lambda device: "emulate")
    path = request.getfixturevalue(family)
    prompts = make_prompts(512, [6, 11], seed=5)
    spec_cfg = None
    if spec:
        spec_cfg = {
            "method": "mtp",
            "num_speculative_tokens": spec,
            "adaptive_num_speculative_tokens": False,
        }
    llm = LLM(
        model=path,
        dtype="float32",
        max_model_len=64,
        block_size=8,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        speculative_config=spec_cfg,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    try:
        graphs = llm.llm_engine.executor.worker.model_runner.cuda_graphs
        assert graphs is not None
        ptrs = {k: v.data_ptr() for k, v in graphs.buffers().items()}
        sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        replays = graphs.num_replays
        assert {k: v.data_ptr() for k, v in graphs.buffers().items()} == ptrs
    finally:
        llm.shutdown()
    assert replays >= 3
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(path, p, 5) for p in prompts]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_no_graphs_on_cpu_by_default(llama_dir) -> None:
    llm = LLM(
        model=llama_dir,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        compilation_config={"cudagraph_capture_sizes": [1, 2]},
    )
    try:
        assert llm.llm_engine.executor.worker.model_runner.cuda_graphs is None
    finally:
        llm.shutdown()
