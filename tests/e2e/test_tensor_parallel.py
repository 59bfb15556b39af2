# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tensor parallelism end to end, on real worker processes (gloo on CPU): TP = 2 gives HF's
full-vocab logprobs and greedy tokens for Llama (untied; tied with one KV head shared by both
ranks) and Qwen2 (q/k/v biases); TP = 2 x PP = 2 with chunked prefill and preemption gives the
same tokens and top logprobs as one worker; the Ray backend gives mp's tokens; a killed TP rank
makes the engine raise and leaves no worker behind; impossible splits are refused naming the
field; `vllm serve -tp 2 -pp 2` with MTP answers like one worker; block-FP8 checkpoints
split with their scales."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading

import psutil
import pytest

from vllm import LLM, SamplingParams
from vllm.testing import checkpoints
from vllm.testing.engine_utils import assert_logprobs_match_hf, hf_greedy, make_prompts

COMMON = dict(dtype="float32", max_model_len=128)
FULL = SamplingParams(temperature=0, max_tokens=4, logprobs=-1, prompt_logprobs=-1, ignore_eos=True)
MAX_TOKENS = 10
TOP = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
LENGTHS = [3, 9, 17, 30, 41, 6]


@pytest.fixture(scope="module")
def llama_tied_kv1_dir(tmp_path_factory) -> str:
    """Tied embeddings (the vocab-parallel embedding is the LM head) and one KV head: at
    TP = 2 both ranks hold that head (replicated), each with 2 of the 4 query heads."""
    return checkpoints.make_llama(
        tmp_path_factory.mktemp("llama_tied_kv1"), tie_word_embeddings=True, num_key_value_heads=1
    )


@pytest.fixture(scope="module")
def deepseek_v3_fused_qlora_dir(tmp_path_factory) -> str:
    """DeepSeek-V3 with q LoRA (q_b_proj split by heads) and the experts stored fused
    (gate_up_proj [E, 2I, H]: each rank takes its gate rows and its up rows)."""
    return checkpoints.make_deepseek_v3(
        tmp_path_factory.mktemp("dsv3_fused_qlora"), q_lora_rank=24, per_expert_names=False
    )


@pytest.fixture(scope="module")
def deepseek_v32_dir(tmp_path_factory) -> str:
    """DeepSeek-V3.2 (DSA): MLA heads split, the indexer replicated on both ranks."""
    from vllm.testing.dsa_checkpoints import make_deepseek_v32

    return make_deepseek_v32(tmp_path_factory.mktemp("dsv32"))


@pytest.fixture(scope="module")
def glm_dsa_dir(tmp_path_factory) -> str:
    from vllm.testing.dsa_checkpoints import make_glm_moe_dsa

    return make_glm_moe_dsa(tmp_path_factory.mktemp("glm_dsa"))


@pytest.fixture(scope="module")
def qwen3_5_dense_dir(tmp_path_factory) -> str:
    """Qwen3.5 hybrid: Gated DeltaNet (2 key / 4 value heads: 1 / 2 per rank, the conv
    channels and states split with them) and gated attention (4 q / 2 kv heads)."""
    from vllm.testing.qwen3_5_checkpoints import make_qwen3_5

    return make_qwen3_5(tmp_path_factory.mktemp("q35"))


@pytest.fixture(scope="module")
def qwen3_5_moe_tp_dir(tmp_path_factory) -> str:
    from vllm.testing.qwen3_5_checkpoints import make_qwen3_5

    return make_qwen3_5(tmp_path_factory.mktemp("q35_moe"), moe=True, seed=1)


def _gen(llm: LLM, prompts: list[list[int]], sp: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def tp2_llama(llama_dir, pp_forkserver):
    """One TP = 2 engine on the Llama checkpoint, shared by the tests that only read it."""
    llm = LLM(model=llama_dir, tensor_parallel_size=2, max_logprobs=-1, **COMMON)
    yield llm
    llm.shutdown()


def _check_hf(llm: LLM, model_dir: str) -> None:
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = make_prompts(vocab, [21], seed=1)[0]
    out = _gen(llm, [prompt], FULL)[0]
    assert_logprobs_match_hf(model_dir, out, prompt)
    prompts = make_prompts(vocab, [5, 17, 33], seed=2)
    for p, o in zip(
        prompts, _gen(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ):
        assert list(o.outputs[0].token_ids) == hf_greedy(model_dir, p, 12)


def test_tp2_llama_matches_hf(tp2_llama, llama_dir):
    executor = tp2_llama.llm_engine.executor
    assert len(executor.worker_pids) == 2 and os.getpid() not in executor.worker_pids
    assert [s["rank"] for s in executor.comm_stats()] == [0, 1]
    _check_hf(tp2_llama, llama_dir)


@pytest.mark.parametrize(
    "model",
    [
        "qwen2_dir",
        "llama_tied_kv1_dir",
        "deepseek_v3_dir",
        "deepseek_v3_fused_qlora_dir",
        "deepseek_v32_dir",
        "glm_dsa_dir",
        "qwen3_5_dense_dir",
        "qwen3_5_moe_tp_dir",
    ],
)
def test_tp2_matches_hf(request, model, pp_forkserver):
    model_dir = str(request.getfixturevalue(model))
    llm = LLM(model=model_dir, tensor_parallel_size=2, max_logprobs=-1, **COMMON)
    try:
        _check_hf(llm, model_dir)
    finally:
        llm.shutdown()


def test_tp2_pp2_equals_one_worker(qwen2_dir, pp_forkserver):
    """4 workers (TP inner: ranks 0, 1 = stage 0; 2, 3 = stage 1) with chunked prefill and
    preemption: the greedy tokens and top logprobs of one worker, and HF's tokens."""
    ref_llm = LLM(model=qwen2_dir, **COMMON)
    try:
        prompts = make_prompts(ref_llm.llm_engine.model_config.vocab_size, LENGTHS, seed=3)
        ref = _gen(ref_llm, prompts)
        per_block = ref_llm.llm_engine.executor.worker.model_runner.kv_cache_bytes_per_block()
    finally:
        ref_llm.shutdown()
    blocks = 7  # fewer than the prompts need together: forces preemption
    # A stage holds half the layers and, per rank, half the KV heads.
    kv_bytes = blocks * per_block // 4
    llm = LLM(
        model=qwen2_dir,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=kv_bytes,
        **{**COMMON, "max_model_len": blocks * 16},  # the pool's tokens (16-token blocks)
    )
    try:
        engine = llm.llm_engine
        assert engine.vllm_config.cache_config.num_gpu_blocks == blocks
        assert len(engine.executor.worker_pids) == 4
        outs = _gen(llm, prompts)
        assert engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    for out, want in zip(outs, ref, strict=True):
        got, exp = out.outputs[0], want.outputs[0]
        assert got.token_ids == exp.token_ids
        for lp, lp_ref in zip(got.logprobs, exp.logprobs, strict=True):
            top = {t for t, v in lp.items() if v.rank <= TOP}
            assert top == {t for t, v in lp_ref.items() if v.rank <= TOP}
            for t in top:
                assert lp[t].logprob == pytest.approx(lp_ref[t].logprob, abs=1e-4)
    assert list(outs[0].outputs[0].token_ids) == hf_greedy(qwen2_dir, prompts[0], MAX_TOKENS)


def test_tp2_seeded_sampling_prefix_cache_padding(llama_dir, pp_forkserver):
    """Seeded random sampling (TP rank 0's draws, broadcast), prefix-cache hits (a shared
    prompt prefix) and padded step sizes: the same tokens as one worker."""
    extra = dict(compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]})
    vocab = 512
    base = make_prompts(vocab, [33], seed=9)[0]
    prompts = [base + p for p in make_prompts(vocab, [3, 7, 11], seed=10)]
    sps = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True)
        for s in (1, 2, 3)
    ]
    results = []
    for tp in (1, 2):
        llm = LLM(model=llama_dir, tensor_parallel_size=tp, **extra, **COMMON)
        try:
            _gen(llm, prompts[:1], sps[0])  # fills the prefix cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
            results.append(_tokens(outs))
            metrics = {m.name: m for m in llm.get_metrics()}
            assert metrics["vllm:prefix_cache_hits"].value > 0
        finally:
            llm.shutdown()
    assert results[0] == results[1]


# ---- refused splits ----------------------------------------------------------------------------
def _edited(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_impossible_splits_are_refused(llama_dir, deepseek_v3_dir, tmp_path):
    """Refused in the engine, before any worker starts, naming the field."""
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"):
        LLM(model=llama_dir, tensor_parallel_size=3, **COMMON)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(8\)"):
        LLM(model=llama_dir, tensor_parallel_size=8, **COMMON)
    odd_mlp = _edited(llama_dir, tmp_path / "mlp", intermediate_size=130)
    with pytest.raises(ValueError, match="intermediate_size \\(130\\)"):
        LLM(model=odd_mlp, tensor_parallel_size=4, **COMMON)
    odd_vocab = _edited(llama_dir, tmp_path / "vocab", vocab_size=511)
    with pytest.raises(ValueError, match="vocab_size \\(511\\)"):
        LLM(model=odd_vocab, tensor_parallel_size=2, **COMMON)
    odd_kv = _edited(llama_dir, tmp_path / "kv", num_attention_heads=16, num_key_value_heads=6)
    with pytest.raises(ValueError, match="num_key_value_heads \\(6\\)"):
        LLM(model=odd_kv, tensor_parallel_size=4, **COMMON)
    with pytest.raises(ValueError, match="tensor_parallel_size x pipeline_parallel_size"):
        LLM(model=llama_dir, tensor_parallel_size=32, pipeline_parallel_size=4, **COMMON)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(model=llama_dir, tensor_parallel_size=0, **COMMON)
    with pytest.raises(ValueError, match="distributed_executor_backend='uni'"):
        LLM(model=llama_dir, tensor_parallel_size=2, distributed_executor_backend="uni")
    odd_experts = _edited(deepseek_v3_dir, tmp_path / "moe", moe_intermediate_size=30)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(30\)"):
        LLM(model=odd_experts, tensor_parallel_size=4, **COMMON)


# ---- Ray ---------------------------------------------------------------------------------------
def test_ray_tp2_equals_mp(llama_dir, tp2_llama):
    import ray

    prompts = make_prompts(tp2_llama.llm_engine.model_config.vocab_size, [4, 19], seed=5)
    mp_tokens = _tokens(_gen(tp2_llama, prompts))
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(
            model=llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **COMMON
        )
        try:
            pids = llm.llm_engine.executor.worker_pids
            assert len(set(pids)) == 2 and os.getpid() not in pids
            assert _tokens(_gen(llm, prompts)) == mp_tokens
        finally:
            llm.shutdown()
        procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
        _, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"Ray worker actors still running: {alive}"
    finally:
        if own_ray:
            ray.shutdown()


# ---- failure -----------------------------------------------------------------------------------
def test_killed_tp_rank_raises_and_leaves_no_process(llama_dir, pp_forkserver):
    """kill -9 of TP rank 1 (not the rank that answers): its peer is stuck in an all-reduce
    with it; the engine names the dead rank, raises, and stops every worker."""
    llm = LLM(model=llama_dir, tensor_parallel_size=2, **COMMON)
    engine = llm.llm_engine
    executor = engine.executor
    procs = [psutil.Process(p) for p in executor.worker_pids]
    try:
        prompts = make_prompts(engine.model_config.vocab_size, [5, 7, 9], seed=1)
        sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        outcome: dict = {}

        def drive() -> None:
            produced = 0
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        produced += len(out.outputs[0].token_ids)
                    if produced >= 6 and "killed" not in outcome:
                        os.kill(procs[1].pid, signal.SIGKILL)  # mid-generation
                        outcome["killed"] = True
                outcome["finished"] = True
            except BaseException as e:  # noqa: BLE001 - inspected below
                outcome["error"] = e

        t = threading.Thread(target=drive, daemon=True)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), "the engine hung after a TP rank was killed"
        assert outcome.get("killed"), outcome
        err = outcome.get("error")
        assert isinstance(err, RuntimeError), outcome
        assert "TP rank 1" in str(err) and "died" in str(err), str(err)
        _, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"worker processes left behind: {alive}"
    finally:
        llm.shutdown()
        for p in procs:
            if p.is_running():
                p.kill()


# ---- server ------------------------------------------------------------------------------------
def test_serve_tp2_pp2_mtp_equals_one_worker(tmp_path_factory, tmp_path):
    """`vllm serve -tp 2 -pp 2 --speculative-config '{"method": "mtp", ...}'` (the command
    DeepSeek users run) behind the openai client: the same text and logprobs as one worker
    with the same MTP draft, and every worker gone after SIGTERM."""
    import openai

    from vllm.testing.remote_server import RemoteServer
    from vllm.testing.spec_checkpoints import make_mtp_self_draft

    src = checkpoints.make_deepseek_v3(
        tmp_path_factory.mktemp("serve_dsv3"), num_hidden_layers=4, num_nextn_predict_layers=1
    )
    model = make_mtp_self_draft(tmp_path_factory.mktemp("serve_near"), src, target_scale=0.2)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive_num_speculative_tokens": False}
    ref_llm = LLM(model=model, speculative_config=spec, **COMMON)
    try:
        prompts = make_prompts(ref_llm.llm_engine.model_config.vocab_size, [6, 23], seed=7)
        ref = _gen(ref_llm, prompts)
    finally:
        ref_llm.shutdown()
    args = ["-tp", "2", "-pp", "2", "--dtype", "float32", "--max-model-len", "128"]
    args += ["--speculative-config", json.dumps(spec)]
    with RemoteServer(model, args, tmp_path / "serve.log") as server:
        server.wait_ready()
        workers = server.children()
        assert len(workers) >= 4
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)
        for r in ref:
            res = client.completions.create(
                model=model,
                prompt=r.prompt_token_ids,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=TOP,
                extra_body={"ignore_eos": True},
            )
            choice = res.choices[0]
            assert choice.text == r.outputs[0].text
            want = [lp[t].logprob for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]
            assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
        assert server.stop(timeout=60) == 0, server.log_tail()
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"processes left behind by the server: {alive}"


# ---- FP8 ---------------------------------------------------------------------------------------
def test_tp2_fp8_matches_hf_fp8_loader(tmp_path_factory, pp_forkserver):
    """A block-FP8 DeepSeek-V3 ([8, 8] blocks) at TP = 2: each rank reads its rows / columns
    of every FP8 weight and the matching rows / columns of its block scales (experts too);
    full-vocab logprobs and greedy tokens equal HF's own FP8 loader's."""
    import torch

    from vllm.testing.fp8_checkpoints import load_hf_fp8, quantize_checkpoint

    root = tmp_path_factory.mktemp("tp_fp8")
    src = checkpoints.make_deepseek_v3(root / "src")
    fp8 = quantize_checkpoint(src, root / "fp8", block=(8, 8))
    hf = load_hf_fp8(fp8)
    llm = LLM(model=fp8, tensor_parallel_size=2, max_logprobs=-1, **COMMON)
    try:
        prompts = make_prompts(512, [21, 6], seed=3)
        outs = _gen(llm, prompts, FULL)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        gen = list(out.outputs[0].token_ids)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + gen])).logits[0].float().log_softmax(-1)
        dists = [out.prompt_logprobs[1:], out.outputs[0].logprobs]
        ours = torch.stack(
            [torch.tensor([e[i].logprob for i in sorted(e)]) for d in dists for e in d]
        )
        torch.testing.assert_close(ours, ref[: len(ours)], atol=2e-4, rtol=1e-4)
        assert gen == ref[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_fp8_block_misaligned_split_is_refused(tmp_path_factory, pp_forkserver):
    """[16, 24] blocks: a rank's half of a matrix would start inside a block."""
    from vllm.testing.fp8_checkpoints import quantize_checkpoint

    root = tmp_path_factory.mktemp("tp_fp8_bad")
    src = checkpoints.make_deepseek_v3(root / "src")
    fp8 = quantize_checkpoint(src, root / "fp8", block=(16, 24))
    with pytest.raises(RuntimeError, match="weight_block_size"):
        LLM(model=fp8, tensor_parallel_size=2, **COMMON)
