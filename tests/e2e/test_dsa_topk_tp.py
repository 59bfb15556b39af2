# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The DSA indexer's top-k selection does not depend on the TP size (DeepSeek-V3.2 and
GLM-MoE-DSA, with MTP and top-k sharing across draft steps).

The fixtures are made so that a TP-dependent selection shows: layer 0's index scores are
nearly tied at the top-k boundary (vllm.testing.dsa_checkpoints.close_topk_boundary), and the
first test proves on HF transformers that summing the heads' scores in two halves - what an
indexer split over two TP ranks does before its all-reduce - picks differently there and changes
the greedy text. The engine's TP = 1, TP = 2 and TP 2 x PP 2 runs (MTP drafting, top-k shared
across draft steps) must then give the same tokens and spec-decode counts. Ordinary fixtures
(margins far above float noise) at TP 2 x PP 2 with MTP equal HF's greedy text."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.dsa_checkpoints import (
    close_topk_boundary,
    make_deepseek_v32,
    make_glm_moe_dsa,
)
from vllm.testing.engine_utils import hf_greedy, make_prompts, spec_decode_counts

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Longer than index_topk (8): every prompt row selects.
LENGTHS = [40, 60, 90, 33, 75]
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4, disable_log_stats=False)
MTP = {"method": "mtp", "num_speculative_tokens": 2, "adaptive_num_speculative_tokens": False}

pytestmark = pytest.mark.usefixtures("pp_forkserver")


def _make(family: str, out) -> str:
    if family == "v32":
        return make_deepseek_v32(
            out, num_nextn_predict_layers=2, index_share_for_mtp_iteration=True
        )
    # Layer 1 reuses layer 0's (close) selection; each pipeline stage starts at a "full" layer.
    return make_glm_moe_dsa(
        out,
        num_nextn_predict_layers=1,
        index_share_for_mtp_iteration=True,
        indexer_types=["full", "shared", "full", "full"],
    )


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    out: dict[str, str] = {}
    for family in ("v32", "glm"):
        plain = _make(family, tmp_path_factory.mktemp(family))
        out[family] = plain
        out[family + "_close"] = close_topk_boundary(
            tmp_path_factory.mktemp(family + "_close"), plain
        )
    return out


def _prompts() -> list[list[int]]:
    return make_prompts(512, LENGTHS, seed=2)


@torch.no_grad()
def _hf_greedy_split_heads(path: str, prompt: list[int]) -> list[int]:
    """HF's greedy text with layer 0's indexer summing its heads' weighted scores in two halves
    (heads [0, H/2) + heads [H/2, H)), as two TP ranks each summing their heads and then
    all-reducing would."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    indexer = model.model.layers[0].self_attn.indexer
    heads = int(model.config.index_n_heads)
    matmul = torch.matmul

    def split_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # The head sum is [.., 1, H] @ [.., H, T]; the q . k products pass through.
        if a.dim() >= 2 and a.shape[-2:] == (1, heads) and b.shape[-2] == heads:
            h = heads // 2
            return matmul(a[..., :h], b[..., :h, :]) + matmul(a[..., h:], b[..., h:, :])
        return matmul(a, b)

    forward = indexer.forward

    def split_forward(*args, **kwargs):
        torch.matmul = split_matmul
        try:
            return forward(*args, **kwargs)
        finally:
            torch.matmul = matmul

    indexer.forward = split_forward
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
    )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("family", ["v32", "glm"])
def test_close_fixture_catches_a_split_head_sum(dirs, family):
    """On the close fixture, the half-and-half head sum changes HF's greedy text for some
    prompt: a selection that depends on the TP size cannot pass the TP tests below. The plain
    fixture's margins are wide enough that the same change is invisible (why it hid there)."""
    close = dirs[family + "_close"]
    changed = [
        hf_greedy(close, p, MAX_TOKENS) != _hf_greedy_split_heads(close, p) for p in _prompts()
    ]
    assert any(changed), "the fixture's top-k boundary is not close enough to catch a swap"


class _Runs:
    def __init__(self, dirs: dict[str, str]) -> None:
        self.dirs = dirs
        self.cache: dict = {}

    def get(self, name: str, tp: int, pp: int, spec: bool):
        key = (name, tp, pp, spec)
        if key not in self.cache:
            llm = LLM(
                model=self.dirs[name],
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                speculative_config=dict(MTP) if spec else None,
                **COMMON,
            )
            try:
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False
                )
                self.cache[key] = (
                    [list(o.outputs[0].token_ids) for o in outs],
                    spec_decode_counts(llm),
                )
            finally:
                llm.shutdown()
        return self.cache[key]


@pytest.fixture(scope="module")
def runs(dirs) -> _Runs:
    return _Runs(dirs)


CASES = [("v32", 2, 1), ("v32", 2, 2), ("glm", 2, 1), ("glm", 2, 2)]


@pytest.mark.parametrize("family,tp,pp", CASES, ids=[f"{f}-tp{t}-pp{p}" for f, t, p in CASES])
def test_topk_selection_independent_of_tp(runs, family, tp, pp):
    """Close fixture, MTP with top-k sharing: the tokens of one worker without speculation,
    and the spec-decode counts of one worker with it."""
    name = family + "_close"
    ref_tokens, _ = runs.get(name, 1, 1, spec=False)
    one_tokens, one_counts = runs.get(name, 1, 1, spec=True)
    tokens, counts = runs.get(name, tp, pp, spec=True)
    assert one_tokens == ref_tokens
    assert tokens == ref_tokens
    assert counts[0] > 0, "the drafter never fired"
    assert counts == one_counts


@pytest.mark.parametrize("family", ["v32", "glm"])
def test_tp2_pp2_mtp_matches_hf(runs, dirs, family):
    """Plain fixture (ordinary margins), TP 2 x PP 2 with MTP and top-k sharing: HF's greedy
    text."""
    tokens, counts = runs.get(family, 2, 2, spec=True)
    assert counts[0] > 0
    assert tokens == [hf_greedy(dirs[family], p, MAX_TOKENS) for p in _prompts()]
