# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Engine behaviour on a tiny Llama: batch invariance (batching, chunked prefill, preemption),
seeded sampling, stop conditions, n > 1, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts

LENGTHS = [3, 9, 17, 30, 41, 6]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _gen(llm, prompts, sp, **kw):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, **kw)


@pytest.fixture(scope="module")
def llm(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32", max_model_len=256)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts(llm):
    return make_prompts(llm.llm_engine.model_config.vocab_size, LENGTHS, seed=3)


@pytest.fixture(scope="module")
def reference(llm, prompts):
    """Each prompt alone."""
    return [_ids(_gen(llm, [p], GREEDY))[0] for p in prompts]


def test_batched_equals_alone(llm, prompts, reference):
    assert _ids(_gen(llm, prompts, GREEDY)) == reference


def test_chunked_prefill_equals_alone(llama_dir, prompts, reference):
    llm = LLM(
        model=llama_dir,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    try:
        assert _ids(_gen(llm, prompts, GREEDY)) == reference
    finally:
        llm.shutdown()


def test_preemption_equals_alone(llama_dir, prompts, reference):
    probe = LLM(model=llama_dir, dtype="float32", max_model_len=256, block_size=4)
    per_block = probe.llm_engine.executor.worker.model_runner.kv_cache_bytes_per_block()
    probe.shutdown()
    # 16 blocks of 4 tokens: the longest request (41 + 16) fits alone, the batch does not.
    llm = LLM(
        model=llama_dir,
        dtype="float32",
        max_model_len=64,  # the pool's 16 x 4 tokens (a longer one is refused at start-up)
        block_size=4,
        kv_cache_memory_bytes=per_block * 16,
    )
    try:
        assert llm.llm_engine.scheduler.kv_cache_manager.num_blocks == 16
        assert _ids(_gen(llm, prompts, GREEDY)) == reference
        assert llm.llm_engine.scheduler.num_preemptions > 0
        names = {m.name: m for m in llm.get_metrics()}
        assert names["vllm:num_preemptions"].value > 0
    finally:
        llm.shutdown()


def test_seeded_sampling_reproducible(llm, prompts):
    sp = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, max_tokens=12, seed=1234, ignore_eos=True
    )
    alone = _ids(_gen(llm, [prompts[2]], sp))[0]
    again = _ids(_gen(llm, [prompts[2]], sp))[0]
    mixed = _gen(llm, prompts, [sp if i == 2 else GREEDY for i in range(len(prompts))])
    assert alone == again == mixed[2].outputs[0].token_ids
    other = _ids(
        _gen(
            llm,
            [prompts[2]],
            SamplingParams(temperature=0.9, max_tokens=12, seed=99, ignore_eos=True),
        )
    )[0]
    assert other != alone
    # Sampling actually samples: across seeds the outputs are not all the greedy one.
    greedy = _ids(
        _gen(llm, [prompts[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    )[0]
    seeds = [
        _ids(
            _gen(
                llm,
                [prompts[2]],
                SamplingParams(temperature=1.5, max_tokens=12, seed=s, ignore_eos=True),
            )
        )[0]
        for s in range(4)
    ]
    assert any(s != greedy for s in seeds)


def test_unseeded_sampling_reproducible_across_engines(llama_dir, prompts):
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(model=llama_dir, dtype="float32", max_model_len=256, seed=7)
        runs.append(_ids(_gen(llm, prompts[:3], sp)))
        llm.shutdown()
    assert runs[0] == runs[1]


def test_top_k_1_is_greedy(llm, prompts, reference):
    sp = SamplingParams(temperature=1.0, top_k=1, max_tokens=16, seed=5, ignore_eos=True)
    assert _ids(_gen(llm, prompts, sp)) == reference


def test_n_greater_than_one(llm, prompts):
    sp = SamplingParams(n=3, temperature=1.5, max_tokens=10, seed=11, ignore_eos=True)
    out = _gen(llm, [prompts[1]], sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = _gen(llm, [prompts[1]], sp)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]


def test_max_tokens_and_length(llm, prompts, reference):
    out = _gen(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    c = out[0].outputs[0]
    assert c.token_ids == reference[0][:5]
    assert c.finish_reason == "length" and c.stop_reason is None


def test_max_model_len_caps_output(llama_dir, prompts):
    llm = LLM(model=llama_dir, dtype="float32", max_model_len=40)
    try:
        out = _gen(
            llm, [prompts[3]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        )[0]
        assert len(prompts[3]) + len(out.outputs[0].token_ids) == 40
        assert out.outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


def test_stop_token_ids(llm, prompts, reference):
    stop = reference[1][4]
    first = reference[1].index(stop)
    out = _gen(
        llm,
        [prompts[1]],
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop], ignore_eos=True),
    )[0]
    c = out.outputs[0]
    assert c.token_ids == reference[1][: first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop


def test_eos_and_ignore_eos(llm, prompts, reference):
    engine = llm.llm_engine
    saved = engine.eos_token_id
    eos = reference[4][6]
    first = reference[4].index(eos)
    engine.eos_token_id = eos
    try:
        c = _gen(llm, [prompts[4]], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
        assert c.token_ids == reference[4][: first + 1]
        assert c.finish_reason == "stop" and c.stop_reason is None
        c = _gen(llm, [prompts[4]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[
            0
        ].outputs[0]
        assert c.token_ids == reference[4]
    finally:
        engine.eos_token_id = saved


def test_stop_strings(llm, prompts, reference):
    tok = llm.get_tokenizer()
    full = tok.decode(reference[5], skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = full.index(stop)
    sp = SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True)
    c = _gen(llm, [prompts[5]], sp)[0].outputs[0]
    assert c.text == full[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    sp = SamplingParams(
        temperature=0, max_tokens=16, stop=stop, ignore_eos=True, include_stop_str_in_output=True
    )
    assert _gen(llm, [prompts[5]], sp)[0].outputs[0].text == full[: cut + len(stop)]


def test_string_prompts_and_chat(llm):
    out = llm.generate(["def fib(n):", {"prompt": "hello"}], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
    assert out[0].prompt == "def fib(n):"
    tok = llm.get_tokenizer()
    assert out[0].prompt_token_ids == tok.encode("def fib(n):")
    chat = llm.chat([{"role": "user", "content": "hi there"}], GREEDY, use_tqdm=False)
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert chat[0].prompt_token_ids == tok.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 2, 10**6]}, "out of vocabulary"),
        ({"prompt_token_ids": [1] * 300}, "longer than the maximum model length"),
        (12, "unsupported prompt type"),
    ],
)
def test_bad_prompt_rejected_engine_keeps_working(llm, prompts, reference, prompt, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate([{"prompt_token_ids": prompts[0]}, prompt], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert _ids(_gen(llm, [prompts[0]], GREEDY)) == [reference[0]]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(n=0), "n"),
        (dict(min_p=2.0), "min_p"),
        (dict(logprobs=-5), "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_engine_args(llama_dir, tmp_path):
    with pytest.raises(TypeError, match="no_such_arg"):
        LLM(model=llama_dir, no_such_arg=1)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=llama_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=llama_dir, max_model_len=10**7)
    bad = tmp_path / "bad_arch"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["NoSuchForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="NoSuchForCausalLM.*LlamaForCausalLM"):
        LLM(model=str(bad))
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        LLM(model=str(bad))


def _edit_checkpoint(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    edit(tensors)
    save_file(tensors, files[0])
    return str(dst)


def test_missing_weight_is_named(llama_dir, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    path = _edit_checkpoint(llama_dir, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(model=path, dtype="float32")


def test_misshaped_weight_is_named(llama_dir, tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"

    def edit(t):
        t[name] = t[name][:, :-1].contiguous()

    path = _edit_checkpoint(llama_dir, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=r"q_proj\.weight.*shape"):
        LLM(model=path, dtype="float32")


def test_min_tokens_masks_stop_tokens(llm, prompts, reference):
    stop = reference[1][2]
    sp = SamplingParams(
        temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[stop], ignore_eos=True
    )
    c = _gen(llm, [prompts[1]], sp)[0].outputs[0]
    assert stop not in c.token_ids[:6]
    assert len(c.token_ids) >= 6
