# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The InputProcessor on its own, without an engine or a worker: a prompt becomes checked token
ids, and a checked request becomes one Request per completion, each with its own params and
seed."""

from __future__ import annotations

import pytest

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.input_processor import InputProcessor, child_seed


@pytest.fixture(scope="module")
def processor(llama_dir) -> InputProcessor:
    return InputProcessor(EngineArgs(model=llama_dir, max_model_len=64).create_engine_config())


def test_prompt_to_requests(processor):
    text, ids, mm = processor.process_prompt_mm("hello world")
    assert text == "hello world" and ids == processor.encode("hello world") and mm is None
    params = SamplingParams(n=3, seed=2**63 - 2, max_tokens=4)
    reqs = processor.make_requests("r", ids, params, arrival_time=1.0, priority=0)
    assert [r.request_id for r in reqs] == ["0_r", "1_r", "2_r"]
    # Each completion: its own params (n = 1), its seed derived from the request's (wrapped).
    assert [r.seed for r in reqs] == [child_seed(2**63 - 2, i) for i in range(3)]
    assert reqs[2].seed == -(2**63)
    assert len({id(r.sampling_params) for r in reqs}) == 3
    assert all(r.sampling_params.n == 1 and r.prompt_token_ids == ids for r in reqs)
    assert params.n == 3  # the caller's params are left as they were
    # Unseeded: seeds drawn from the processor's seeded generator, or the ones handed in.
    drawn = processor.make_requests("u", ids, SamplingParams(n=2), arrival_time=1.0)
    assert len({r.seed for r in drawn}) == 2
    given = processor.make_requests("g", ids, SamplingParams(n=2), 1.0, seeds=[7, 9])
    assert [r.seed for r in given] == [7, 9]


def test_prompt_checks_use_the_engines_fit(llama_dir):
    cfg = EngineArgs(model=llama_dir, max_model_len=64).create_engine_config()
    seen: list[int] = []

    def fits(n: int) -> None:
        seen.append(n)
        if n > 3:
            raise ValueError("never fits")

    p = InputProcessor(cfg, fits)
    assert p.process_prompt_mm([1, 2, 3])[1] == [1, 2, 3]
    with pytest.raises(ValueError, match="never fits"):
        p.process_prompt_mm([1, 2, 3, 4])
    assert seen == [3, 4]
    with pytest.raises(ValueError, match="maximum model length"):
        p.process_prompt_mm(list(range(1, 65)))
