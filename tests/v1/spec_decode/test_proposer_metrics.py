# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Spec-decode counters per proposer (vllm:spec_decode_num_{drafts,draft_tokens,
accepted_tokens}_per_proposer, label `proposer`): a hybrid's two proposers and the grammar's
forced tokens (jump-forward) are told apart, and over the label they sum to the aggregate
counters, in LLM.get_metrics() and in the Prometheus text the server's /metrics serves."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm import LLM, SamplingParams
from vllm.config import default_model_path
from vllm.sampling_params import StructuredOutputsParams
from vllm.testing.engine_utils import SPEC_DECODE_METRICS, make_prompts

pytestmark = pytest.mark.usefixtures("pp_forkserver")

SCHEMA = {
    "type": "object",
    "properties": {
        "identifier_of_the_person": {"type": "string", "maxLength": 8},
        "age_in_years_since_birth": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["identifier_of_the_person", "age_in_years_since_birth"],
    "additionalProperties": False,
}
PER_PROPOSER = [n + "_per_proposer" for n in SPEC_DECODE_METRICS]


def _by_proposer(metrics) -> dict[str, dict[str, int]]:
    """metric name -> proposer -> value, from LLM.get_metrics()."""
    out: dict[str, dict[str, int]] = {n: {} for n in PER_PROPOSER}
    for m in metrics:
        if m.name in out:
            assert set(m.labels) == {"model_name", "engine", "proposer"}, m.labels
            out[m.name][m.labels["proposer"]] = m.value
    return out


@pytest.mark.parametrize("pp", [1, 2])
def test_counters_per_proposer_sum_to_the_aggregate(pp):
    """The bundled model's MTP head beside suffix decoding, grammar-aware drafting on: the
    same plain requests twice (the second round matches the first's outputs: suffix drafts)
    and a JSON-schema request with long fixed keys (the grammar forces them: jump-forward
    drafts); the MTP head drafts the rest."""
    spec = {
        "method": "mtp",
        "num_speculative_tokens": 6,
        "hybrid_method": "suffix",
        "hybrid_model_num_speculative_tokens": 2,
        "adaptive_num_speculative_tokens": False,
    }
    llm = LLM(
        model=str(default_model_path()),
        speculative_config=spec,
        pipeline_parallel_size=pp,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        disable_log_stats=False,
    )
    try:
        plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        batch = [{"prompt_token_ids": p} for p in make_prompts(512, [19, 27], seed=3)]
        for _ in range(2):
            llm.generate(batch, plain, use_tqdm=False)
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        llm.generate(
            ["person = "],
            SamplingParams(temperature=0, max_tokens=48, structured_outputs=so),
            use_tqdm=False,
        )
        metrics = llm.get_metrics()
        text = generate_latest(llm.llm_engine.prom.registry).decode()
        jumped = None
        if pp == 1:
            jumped = llm.llm_engine.executor.worker.model_runner.structured.num_jump_forward_tokens
    finally:
        llm.shutdown()
    total = {m.name: m.value for m in metrics if m.name in SPEC_DECODE_METRICS}
    by = _by_proposer(metrics)
    for name in SPEC_DECODE_METRICS:
        per = by[name + "_per_proposer"]
        assert set(per) == {"mtp", "suffix", "jump_forward"}, per
        assert sum(per.values()) == total[name] > 0, (name, per, total)
    for proposer in ("mtp", "suffix", "jump_forward"):
        drafts = by["vllm:spec_decode_num_drafts_per_proposer"][proposer]
        tokens = by["vllm:spec_decode_num_draft_tokens_per_proposer"][proposer]
        accepted = by["vllm:spec_decode_num_accepted_tokens_per_proposer"][proposer]
        assert drafts > 0 and drafts <= tokens and accepted <= tokens, (proposer, by)
    # The MTP head drafts at most its own K; a suffix match may draft more.
    assert (
        by["vllm:spec_decode_num_draft_tokens_per_proposer"]["mtp"]
        <= 2 * (by["vllm:spec_decode_num_drafts_per_proposer"]["mtp"])
    )
    if jumped is not None:  # forced tokens verified are forced tokens proposed (or fewer)
        assert 0 < by["vllm:spec_decode_num_draft_tokens_per_proposer"]["jump_forward"] <= jumped
    # The same values in the Prometheus text (/metrics serves this registry).
    scraped: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_per_proposer_total"):
                scraped.setdefault(s.name[: -len("_total")], {})[s.labels["proposer"]] = s.value
    assert scraped == {n: {p: float(v) for p, v in d.items()} for n, d in by.items()}


def test_proposers_are_exported_at_zero_before_any_draft():
    """Labels exist from start-up (as the aggregate counters do), one per possible proposer."""
    llm = LLM(
        model=str(default_model_path()),
        speculative_config={"method": "suffix", "num_speculative_tokens": 4},
        dtype="float32",
        max_model_len=128,
    )
    try:
        by = _by_proposer(llm.get_metrics())
    finally:
        llm.shutdown()
    for name in PER_PROPOSER:
        assert by[name] == {"suffix": 0, "jump_forward": 0}, by
