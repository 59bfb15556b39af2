# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""FP8 block-quantized checkpoints end to end (vllm/testing/fp8_checkpoints.py quantizes the tiny
models as DeepSeek / Qwen publish theirs, edge blocks partial): DeepSeek-V3 (MLA + MoE + an MTP
layer), DeepSeek-V3.2 (DSA indexer + MTP) and Qwen3.5-MoE (hybrid + MTP), each served with MTP
speculation at P = 1 and P = 2. Full-vocab logprobs of prompt and decode equal HF transformers
on the same weights dequantized by transformers' FP8 code, greedy tokens equal HF's greedy
(speculation lossless), and MTP acceptance is the same at P = 1 and P = 2. Where every side is
a block multiple, HF's own FineGrainedFP8Config(dequantize=True) loader reads the FP8 folder
itself; and the per-forward dequantization (FP8 kept resident: the CUDA fallback path) gives
the same logits as dequantizing at load."""

from __future__ import annotations

import functools

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing import checkpoints
from vllm.testing.dsa_checkpoints import make_deepseek_v32
from vllm.testing.engine_utils import hf_greedy, hf_logprobs, make_prompts
from vllm.testing.fp8_checkpoints import hf_dequantized_copy, load_hf_fp8, quantize_checkpoint
from vllm.testing.qwen3_5_checkpoints import make_qwen3_5, make_qwen3_5_mtp_self_draft
from vllm.testing.spec_checkpoints import make_mtp_self_draft

PROMPTS = make_prompts(512, [21, 6], seed=3)
MAX_TOKENS = 6
SP = SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, logprobs=-1, prompt_logprobs=-1, ignore_eos=True
)
# max_logprobs=-1: the HF parity checks read every token's logprob (vLLM caps them at 20).
COMMON = dict(dtype="float32", max_model_len=128, block_size=8, max_num_seqs=4, max_logprobs=-1)
ACCEPTANCE = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    mp.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    mp.delenv("VLLM_FP8_DEQUANT", raising=False)
    yield
    mp.undo()


def _v3(root) -> str:
    """MTP near self-draft (partial acceptance); [16, 24] blocks: kv_a_proj_with_mqa has 40
    rows, every hidden-side matrix 64 columns, so edge blocks are partial both ways."""
    src = checkpoints.make_deepseek_v3(root / "src", num_nextn_predict_layers=1)
    near = make_mtp_self_draft(root / "near", src, target_scale=0.2)
    return quantize_checkpoint(near, root / "fp8", block=(16, 24))


def _v32(root) -> str:
    """[16, 16] blocks: kv_a_proj_with_mqa (40 rows) and the indexer's wq_b (24 columns)."""
    src = make_deepseek_v32(
        root / "src", num_nextn_predict_layers=1, index_share_for_mtp_iteration=True
    )
    near = make_mtp_self_draft(root / "near", src, target_scale=0.2)
    return quantize_checkpoint(near, root / "fp8", block=(16, 16))


def _qwen3_5(root) -> str:
    """Qwen's FP8 release layout: [128, 128] blocks (every tiny matrix one partial block),
    bfloat16 scales, modules_to_not_convert listed."""
    src = make_qwen3_5(root / "src", moe=True, mtp_num_hidden_layers=1, seed=1)
    near = make_qwen3_5_mtp_self_draft(root / "near", src, target_scale=0.3)
    return quantize_checkpoint(
        near, root / "fp8", block=(128, 128), scale_dtype=torch.bfloat16, list_unconverted=True
    )


FAMILIES = {"deepseek_v3": _v3, "deepseek_v32": _v32, "qwen3_5_moe": _qwen3_5}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    @functools.cache
    def get(family: str) -> tuple[str, str]:
        root = tmp_path_factory.mktemp(f"fp8_{family}")
        fp8 = FAMILIES[family](root)
        return fp8, hf_dequantized_copy(fp8, root / "hf_reference")

    return get


def _dist(entry: dict) -> torch.Tensor:
    return torch.tensor([entry[i].logprob for i in sorted(entry)])


def _assert_matches(outs, logprobs_of, greedy_of) -> None:
    """Every prompt and decode position's full distribution equals the reference's; the greedy
    continuation equals the reference's own greedy loop."""
    for prompt, out in zip(PROMPTS, outs):
        gen = list(out.outputs[0].token_ids)
        ref = logprobs_of(prompt + gen)
        ours = [_dist(e) for e in out.prompt_logprobs[1:]] + [
            _dist(e) for e in out.outputs[0].logprobs
        ]
        torch.testing.assert_close(torch.stack(ours), ref[: len(ours)], atol=2e-4, rtol=1e-4)
        assert gen == greedy_of(prompt)


@pytest.fixture(scope="module")
def runs(folders):
    """(family, P) -> (outputs, acceptance counters) of an MTP (K=2) run on the FP8 folder."""

    @functools.cache
    def get(family: str, pp: int):
        fp8, _ = folders(family)
        llm = LLM(
            model=fp8,
            pipeline_parallel_size=pp,
            speculative_config={
                "method": "mtp",
                "adaptive_num_speculative_tokens": False,
                "num_speculative_tokens": 2,
            },
            disable_log_stats=False,
            **COMMON,
        )
        try:
            assert llm.llm_engine.model_config.quantization == "fp8"
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
            metrics = {m.name: m for m in llm.get_metrics()}
            counts = tuple(metrics[n].value for n in ACCEPTANCE)
            per_pos = list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values)
            return outs, counts + (per_pos,)
        finally:
            llm.shutdown()

    return get


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_mtp_matches_hf(runs, folders, family: str, pp: int) -> None:
    _, reference = folders(family)
    outs, _ = runs(family, pp)
    _assert_matches(
        outs,
        lambda ids: hf_logprobs(reference, ids),
        lambda prompt: hf_greedy(reference, prompt, MAX_TOKENS),
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_mtp_acceptance_equal_across_pp(runs, family: str) -> None:
    _, p1 = runs(family, 1)
    _, p2 = runs(family, 2)
    assert p1[2] > 0, "the near self-draft MTP head should have some drafts accepted"
    assert p1 == p2


@pytest.fixture(scope="module")
def aligned_v3(tmp_path_factory) -> str:
    """DeepSeek-V3 in [8, 8] blocks: every side of every matrix a block multiple, the only case
    transformers' FP8 loader handles."""
    root = tmp_path_factory.mktemp("fp8_v3_aligned")
    src = checkpoints.make_deepseek_v3(root / "src", num_nextn_predict_layers=1)
    return quantize_checkpoint(src, root / "fp8", block=(8, 8))


def _hf_fp8_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("mode", ["load", "forward"])
def test_fp8_matches_hf_finegrained_fp8_loader(aligned_v3, mode, monkeypatch) -> None:
    """`forward` keeps the FP8 weights resident and dequantizes each layer per call (what a GPU
    without an FP8 GEMM runs); `load` dequantizes once (the CPU default)."""
    monkeypatch.setenv("VLLM_FP8_DEQUANT", mode)
    hf = load_hf_fp8(aligned_v3)
    llm = LLM(model=aligned_v3, quantization="fp8", **COMMON)
    try:
        model = llm.llm_engine.executor.worker.model_runner.model
        kv_a = model.model.layers[0].self_attn.kv_a_proj_with_mqa
        assert kv_a.weight.dtype == (torch.float8_e4m3fn if mode == "forward" else torch.float32)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
    finally:
        llm.shutdown()

    def logprobs_of(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    _assert_matches(outs, logprobs_of, lambda prompt: _hf_fp8_greedy(hf, prompt))
