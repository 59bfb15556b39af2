# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft models against independent references, and how they load next to their target.

The references recompute, for the exact contexts the engine drafted from, what the draft should
propose: HF transformers runs the target (final hidden states / aux hidden states) and the MTP
block (HF's DeepseekV3DecoderLayer), the EAGLE-1 layers (HF's LlamaDecoderLayer); the EAGLE3
layer is written out in plain torch. Draft step s
queries position last + s over the draft's KV of every earlier position, so a match also checks
the draft's KV cache bookkeeping across steps, rejections and requests.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.fused_moe import fuse_experts
from vllm.testing.engine_utils import hf_model, make_prompts
from vllm.testing.spec_checkpoints import make_eagle3_draft, make_eagle_draft, make_mtp_self_draft

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=256, max_num_seqs=4)


def _weights(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def _runner(llm: LLM):
    return llm.llm_engine.executor.worker.model_runner


def _record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(context, drafts) of every proposal for a request that sampled this step; the context
    is the request's tokens including the ones sampled this step."""
    runner = _runner(llm)
    spec = runner.speculator
    orig = spec.propose
    records: list[tuple[list[int], list[int]]] = []

    def propose(inputs):
        drafts = orig(inputs)
        batch, num_sampled = inputs.input_batch, inputs.step.num_sampled
        sampled = inputs.step.sampled
        st = runner.states
        for i, s in enumerate(batch.idx_mapping_np.tolist()):
            if num_sampled[i]:
                history = st.token_ids[s, : st.num_tokens[s]].tolist()
                records.append((history + sampled[i, : num_sampled[i]].tolist(), list(drafts[i])))
        return drafts

    spec.propose = propose
    return records


def _drafted(model: str, prompts, spec: dict, **kw) -> list[tuple[list[int], list[int]]]:
    llm = LLM(model=model, **{**COMMON, **kw}, speculative_config=spec)
    try:
        records = _record_drafts(llm)
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    return records


def _sample(records, n: int = 6):
    step = max(1, len(records) // n)
    return records[::step][:n]


# ---- MTP -----------------------------------------------------------------------------------


class _MTPReference:
    """Draft chain of DeepSeek MTP layers (the DeepSeek-V3 report's MTP forward), from HF's
    target and block: layer s at target position t combines layer s-1's output at t (the
    target's for s = 0) with the embedding of token t + s + 1 (zeroed at position 0), attending
    causally over its own rows, as the layers are trained. Draft step s uses layer s mod n:
    steps s < n are layer s over the whole sequence (the draft after the last position is its
    last row); a later step of layer l appends n rows (the previous step's last n outputs and
    the next tokens) after l's rows so far, at the positions after them."""

    def __init__(self, model_dir: str) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

        self.hf = hf_model(model_dir)
        cfg = self.hf.config
        w = _weights(model_dir)
        block_cfg = copy.deepcopy(cfg)
        block_cfg.first_k_dense_replace = 0  # MTP blocks are MoE
        parts = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
        self.layers = []
        for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
            prefix = f"model.layers.{i}."
            mine = {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}
            lw = {k: v for k, v in mine.items() if k.startswith(parts)}
            block = DeepseekV3DecoderLayer(block_cfg, layer_idx=i).eval()
            bw = fuse_experts({k: v for k, v in mine.items() if not k.startswith(parts)})
            block.load_state_dict(bw, strict=True)
            lw.setdefault("embed_tokens.weight", w["model.embed_tokens.weight"])
            self.layers.append((lw, block))

    def _x(self, lw: dict, tokens: torch.Tensor, h: torch.Tensor, first_pos: int) -> torch.Tensor:
        e = lw["embed_tokens.weight"][tokens].clone()
        if first_pos == 0:
            e[0] = 0  # position 0
        cat = torch.cat([_rms(e, lw["enorm.weight"]), _rms(h, lw["hnorm.weight"])], -1)
        return cat @ lw["eh_proj.weight"].T

    def _block(self, block, xs: torch.Tensor) -> torch.Tensor:
        n = xs.shape[0]
        pos = torch.arange(n)[None]
        cos_sin = self.hf.model.rotary_emb(xs[None], pos)
        out = block(
            xs[None], attention_mask=_causal(n), position_ids=pos, position_embeddings=cos_sin
        )
        return out[0]

    @torch.no_grad()
    def drafts(self, context: list[int], k: int) -> list[int]:
        """K greedy drafts after context (its last token is the one just sampled)."""
        n = len(self.layers)
        last = len(context) - 2
        assert last >= n - 1
        seq = torch.tensor(context)
        h = self.hf.model(input_ids=seq[None, : last + 1]).last_hidden_state[0]
        xs: list[torch.Tensor | None] = [None] * n  # each layer's rows so far
        out: list[int] = []
        for s in range(k):
            lw, block = self.layers[s % n]
            if s < n:
                t = torch.arange(last + 1)  # every target position
                xs[s] = self._x(lw, seq[t + s + 1], h, 0)
                h = self._block(block, xs[s])
            else:
                t = torch.arange(last - n + 1, last + 1)
                xs[s % n] = torch.cat([xs[s % n], self._x(lw, seq[t + s + 1], h[-n:], 1)])
                h = self._block(block, xs[s % n])[-n:]
            logits = _rms(h[-1], lw["shared_head.norm.weight"]) @ lw["shared_head.head.weight"].T
            out.append(int(logits.argmax()))
            seq = torch.cat([seq, torch.tensor(out[-1:])])
        return out


def test_mtp_drafts_match_reference(deepseek_v3_mtp1_dir):
    prompts = make_prompts(512, [13, 5, 22], seed=11)
    k = 3
    # An 8-token budget: prompts arrive in chunks (the draft's KV of a chunk's last position
    # pairs with the next prompt token) while other requests verify drafts.
    records = _drafted(
        deepseek_v3_mtp1_dir,
        prompts,
        {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": k},
        max_num_batched_tokens=8,
    )
    ref = _MTPReference(deepseek_v3_mtp1_dir)
    checked = _sample(records)
    assert len(checked) >= 4
    for context, drafts in checked:
        assert drafts == ref.drafts(context, k), f"context of {len(context)} tokens"


@pytest.fixture(scope="module")
def mtp2_near_dir(deepseek_v3_mtp2_dir, tmp_path_factory) -> str:
    """Two MTP layers that often agree with the target (steps accept 0..K drafts) and keep
    their own attention, so their drafts depend on each layer's KV cache."""
    return make_mtp_self_draft(
        tmp_path_factory.mktemp("mtp2_near"),
        deepseek_v3_mtp2_dir,
        target_scale=0.3,
        draft_block_scale=0.5,
    )


@pytest.mark.parametrize(
    "ckpt, k",
    [("deepseek_v3_mtp2_dir", 2), ("deepseek_v3_mtp2_dir", 3), ("mtp2_near_dir", 2)],
    ids=["random_k2", "random_k3", "near_k2"],
)
def test_chained_mtp_drafts_match_reference(request, ckpt, k):
    """Two chained MTP layers: the second layer's drafts (and, K = 3, the first layer's reuse)
    equal the full-sequence chain the layers are trained as, through chunked prefill,
    rejections and several requests (so its KV holds every position it attends to)."""
    model = request.getfixturevalue(ckpt)
    prompts = make_prompts(512, [13, 5, 22], seed=11)
    records = _drafted(
        model,
        prompts,
        {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": k},
        max_num_batched_tokens=8,
    )
    ref = _MTPReference(model)
    checked = _sample(records, 8)
    assert len(checked) >= 6
    for context, drafts in checked:
        assert drafts == ref.drafts(context, k), f"context of {len(context)} tokens"


def test_chained_mtp_drafts_do_not_depend_on_old_kv(mtp2_near_dir):
    """The same requests again after every KV cache was filled with garbage propose the same
    drafts: no MTP layer reads a position of its cache it has not written for this request."""
    prompts = make_prompts(512, [13, 5, 22, 9], seed=12)
    llm = LLM(
        model=mtp2_near_dir,
        **COMMON,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
        speculative_config={
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": 2,
        },
    )
    try:
        records = _record_drafts(llm)
        batch = [{"prompt_token_ids": p} for p in prompts]
        first = llm.generate(batch, GREEDY, use_tqdm=False)
        n = len(records)
        gen = torch.Generator().manual_seed(0)
        for cache in _runner(llm).kv_caches.values():
            cache.copy_(torch.randn(cache.shape, generator=gen) * 30)
        again = llm.generate(batch, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert records[n:] == records[:n]
    assert n >= 10


def _without_mtp_embed(src: str, dst: Path) -> str:
    """Copy of an MTP checkpoint whose MTP layers ship no embed_tokens."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        w = _weights_file(dst / shard)
        drop = [k for k in w if k.endswith("embed_tokens.weight") and ".layers." in k]
        for k in drop:
            del w[k]
            del index["weight_map"][k]
        save_file(w, dst / shard, {"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(dst)


def _weights_file(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def test_mtp_loading_shares_identical_tables(deepseek_v3_mtp2_dir, tmp_path):
    no_embed = _without_mtp_embed(deepseek_v3_mtp2_dir, tmp_path / "noembed")
    for model in (deepseek_v3_mtp2_dir, no_embed):
        llm = LLM(
            model=model,
            **COMMON,
            speculative_config={
                "method": "mtp",
                "adaptive_num_speculative_tokens": False,
                "num_speculative_tokens": 2,
            },
        )
        try:
            runner = _runner(llm)
            target, draft = runner.model, runner.speculator.model
            assert sorted(draft.model.layers) == ["3", "4"]
            for layer in draft.model.layers.values():
                # The checkpoint's MTP embedding / head are copies of the target's: one copy kept.
                assert layer.embed_tokens is target.model.embed_tokens
                assert layer.shared_head.head is target.lm_head
            # Each MTP layer has its own KV cache, allocated like the target's.
            names = [n for n in runner.kv_caches if n.startswith("drafter.")]
            assert len(names) == 2
        finally:
            llm.shutdown()


def _last_stage_draft(model: str, spec: dict):
    """(target, draft) as the last of two pipeline stages builds them, in this process."""
    from vllm.distributed.parallel_state import PPGroup, get_pp_group, set_pp_group
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.spec_decode.speculator import load_draft_model

    config = EngineArgs(
        model=model,
        dtype="float32",
        max_model_len=128,
        pipeline_parallel_size=2,
        speculative_config=spec,
    ).create_engine_config()
    old = get_pp_group()
    set_pp_group(PPGroup(rank=1, world_size=2))
    try:
        target = get_model(config)
        draft = load_draft_model(config, torch.device("cpu"))
        draft.bind_target(target.draft_shares())
        return target, draft
    finally:
        set_pp_group(old)


@pytest.mark.parametrize("own_tables", [False, True], ids=["top_level_only", "identical_copies"])
def test_mtp_layers_keep_one_embedding_table_on_the_last_stage(
    deepseek_v3_mtp2_dir, tmp_path, own_tables
):
    """Under P = 2 the target has no table on the last stage to alias; the two MTP layers,
    whose tables are the checkpoint's one top-level table (or identical copies of it), keep a
    single copy between them, holding the checkpoint's values."""
    from vllm.model_executor.models.utils import PPMissingLayer

    model = (
        deepseek_v3_mtp2_dir
        if own_tables
        else _without_mtp_embed(deepseek_v3_mtp2_dir, tmp_path / "noembed")
    )
    target, draft = _last_stage_draft(
        model,
        {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": 2},
    )
    assert isinstance(target.model.embed_tokens, PPMissingLayer)
    tables = [layer.embed_tokens for layer in draft.model.layers.values()]
    assert len(tables) == 2 and tables[0] is tables[1]
    top = _weights(deepseek_v3_mtp2_dir)["model.embed_tokens.weight"]
    assert torch.equal(tables[0].weight, top)
    vocab_tables = [p for p in draft.parameters() if tuple(p.shape) == tuple(top.shape)]
    heads = {id(layer.shared_head.head.weight) for layer in draft.model.layers.values()}
    # One embedding table, plus the shared_head.head matrices of the same shape.
    assert len({p.data_ptr() for p in vocab_tables}) == 1 + len(heads)


# MTP draft classes: (module, class name) and a builder of a target checkpoint that has one.
_MTP_DRAFTS = {
    "deepseek_v3": ("vllm.model_executor.models.deepseek_mtp", "DeepSeekMTP"),
    "deepseek_v32": ("vllm.models.deepseek_v32.mtp", "DeepseekV32MTP"),
    "qwen3_5": ("vllm.model_executor.models.qwen3_5_mtp", "Qwen3_5MTP"),
}


@pytest.fixture(scope="module")
def mtp_targets(deepseek_v3_mtp1_dir, tmp_path_factory) -> dict[str, str]:
    from vllm.testing import qwen3_5_checkpoints as q35
    from vllm.testing.dsa_checkpoints import make_deepseek_v32

    return {
        "deepseek_v3": deepseek_v3_mtp1_dir,
        "deepseek_v32": make_deepseek_v32(
            tmp_path_factory.mktemp("v32_pp_draft"), num_nextn_predict_layers=1
        ),
        "qwen3_5": q35.make_qwen3_5(
            tmp_path_factory.mktemp("q35_pp_draft"), mtp_num_hidden_layers=1
        ),
    }


@pytest.mark.parametrize("family", list(_MTP_DRAFTS))
def test_last_stage_builds_the_mtp_draft_only_if_it_supports_pp(mtp_targets, family, monkeypatch):
    import importlib

    module, name = _MTP_DRAFTS[family]
    cls = getattr(importlib.import_module(module), name)
    spec = {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": 1}
    _, draft = _last_stage_draft(mtp_targets[family], spec)
    assert type(draft) is cls
    monkeypatch.setattr(cls, "supports_pp", False)
    with pytest.raises(ValueError, match=f"{name} does not support pipeline parallelism"):
        _last_stage_draft(mtp_targets[family], spec)


@pytest.mark.parametrize("broken", ["stub", "no_hidden_states"])
def test_last_stage_refuses_a_draft_without_a_working_factory(
    deepseek_v3_mtp1_dir, monkeypatch, broken
):
    """A class inheriting SupportsPP gets the Protocol's empty make_empty_intermediate_tensors:
    flag and forward signature alone would pass it, and the draft would fail on first use."""
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP
    from vllm.model_executor.models.interfaces import SupportsPP
    from vllm.sequence import IntermediateTensors

    if broken == "stub":
        factory = SupportsPP.make_empty_intermediate_tensors
    else:

        def factory(self, batch_size, dtype, device):
            return IntermediateTensors({})

    monkeypatch.setattr(DeepSeekMTP, "make_empty_intermediate_tensors", factory)
    spec = {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="DeepSeekMTP does not support pipeline parallelism"):
        _last_stage_draft(deepseek_v3_mtp1_dir, spec)


def test_pp_refuses_a_target_class_with_the_stub_factory(monkeypatch):
    from vllm.model_executor.models.interfaces import SupportsPP, check_supports_pp
    from vllm.model_executor.models.llama import LlamaForCausalLM

    check_supports_pp(LlamaForCausalLM)
    monkeypatch.setattr(
        LlamaForCausalLM,
        "make_empty_intermediate_tensors",
        SupportsPP.make_empty_intermediate_tensors,
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM does not support pipeline"):
        check_supports_pp(LlamaForCausalLM)


# ---- EAGLE3 ----------------------------------------------------------------------------------


class _Eagle3Reference:
    """EAGLE3 draft (fc over the target taps, one decoder layer) in plain torch over HF's target
    hidden states."""

    def __init__(self, target_dir: str, draft_dir: str) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.rope = apply_rotary_pos_emb
        self.hf = hf_model(target_dir)
        self.cfg = json.loads((Path(draft_dir) / "config.json").read_text())
        self.w = _weights(draft_dir)
        self.embed = self.w.get("embed_tokens.weight", self.hf.model.embed_tokens.weight)
        self.taps = sorted(set(self.cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
        v, dv = self.cfg["vocab_size"], self.cfg["draft_vocab_size"]
        d2t = self.w.get("d2t", torch.zeros(dv, dtype=torch.long))
        self.target_ids = torch.arange(dv) + d2t
        assert v >= dv

    def _layer(self, x_embed: torch.Tensor, x_hidden: torch.Tensor):
        w, c = self.w, self.cfg
        p = "midlayer."
        if c["norm_before_residual"]:
            hn = _rms(x_hidden, w[p + "hidden_norm.weight"])
            residual = hn
        else:
            residual = x_hidden
            hn = _rms(x_hidden, w[p + "hidden_norm.weight"])
        x = torch.cat([_rms(x_embed, w[p + "input_layernorm.weight"]), hn], -1)
        n, hd = x.shape[0], c["head_dim"]
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, nh, hd).transpose(0, 1)[None]
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)[None]
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)[None]
        cos, sin = self.hf.model.rotary_emb(x[None], torch.arange(n)[None])
        q, k = self.rope(q, k, cos, sin)
        k = k.repeat_interleave(nh // nkv, 1)
        v = v.repeat_interleave(nh // nkv, 1)
        att = ((q @ k.transpose(-1, -2)) * hd**-0.5 + _causal(n)).softmax(-1) @ v
        att = att[0].transpose(0, 1).reshape(n, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        residual = att + residual
        y = _rms(residual, w[p + "post_attention_layernorm.weight"])
        mlp = (
            torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T)
            * (y @ w[p + "mlp.up_proj.weight"].T)
        ) @ w[p + "mlp.down_proj.weight"].T
        prenorm = mlp + residual
        return _rms(prenorm, w["norm.weight"]), prenorm

    @torch.no_grad()
    def drafts(self, context: list[int], k: int) -> list[int]:
        ids = torch.tensor(context)
        last = len(context) - 2
        hs = self.hf.model(input_ids=ids[None, : last + 1], output_hidden_states=True)
        aux = torch.cat([hs.hidden_states[t][0] for t in self.taps], -1)
        hidden = aux @ self.w["fc.weight"].T
        embeds = self.embed[ids[1:]]
        out = []
        for _ in range(k):
            normed, prenorm = self._layer(embeds, hidden)
            logits = normed[-1] @ self.w["lm_head.weight"].T
            tok = int(self.target_ids[int(logits.argmax())])
            out.append(tok)
            embeds = torch.cat([embeds, self.embed[tok][None]])
            hidden = torch.cat([hidden, prenorm[-1][None]])
        return out


@pytest.mark.parametrize("target", ["llama_dir", "qwen2_dir"])
def test_eagle3_drafts_match_reference(request, target, tmp_path):
    target_dir = request.getfixturevalue(target)
    if target == "llama_dir":
        draft = make_eagle3_draft(
            tmp_path / "d", target_dir, aux_layers=(1, 2, 3), norm_before_residual=True, seed=3
        )
    else:
        # No own embedding, reduced vocabulary, unsorted taps.
        draft = make_eagle3_draft(
            tmp_path / "d",
            target_dir,
            aux_layers=(3, 1, 2),
            own_embed=False,
            draft_vocab_size=256,
            seed=4,
        )
    k = 2
    prompts = make_prompts(512, [11, 4, 19], seed=12)
    budget = 8 if target == "llama_dir" else 2048  # chunked prefill in one of the two
    records = _drafted(
        target_dir,
        prompts,
        {
            "method": "eagle3",
            "model": draft,
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        },
        max_num_batched_tokens=budget,
    )
    ref = _Eagle3Reference(target_dir, draft)
    checked = _sample(records)
    assert len(checked) >= 4
    for context, drafts in checked:
        assert drafts == ref.drafts(context, k), f"context of {len(context)} tokens"


def test_eagle3_loading_shares_target_embedding(llama_dir, tmp_path):
    for own in (True, False):
        draft = make_eagle3_draft(tmp_path / f"d{own}", llama_dir, own_embed=own)
        llm = LLM(
            model=llama_dir,
            **COMMON,
            speculative_config={
                "method": "eagle3",
                "model": draft,
                "adaptive_num_speculative_tokens": False,
                "num_speculative_tokens": 1,
            },
        )
        try:
            runner = _runner(llm)
            target, d = runner.model, runner.speculator.model
            shared = d.model.embed_tokens is target.model.embed_tokens
            assert shared is (not own)
            assert d.lm_head is not target.lm_head  # the draft's own (random) head is kept
            assert target.model.aux_hidden_state_layers == (1, 2, 3)
        finally:
            llm.shutdown()


# ---- EAGLE-1 ---------------------------------------------------------------------------------


class _EagleReference:
    """EAGLE-1 draft chain from HF's target (its last hidden state, after the final norm) and
    HF's LlamaDecoderLayer (the first with an identity input_layernorm)."""

    def __init__(self, target_dir: str, draft_dir: str) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        self.hf = hf_model(target_dir)
        self.cfg = json.loads((Path(draft_dir) / "config.json").read_text())
        w = {k.removeprefix("model."): v for k, v in _weights(draft_dir).items()}
        self.w = w
        self.embed = w.get("embed_tokens.weight", self.hf.model.embed_tokens.weight)
        self.head = w.get("lm_head.weight", self.hf.lm_head.weight)
        cfg = LlamaConfig(**{k: v for k, v in self.cfg.items() if k != "architectures"})
        cfg._attn_implementation = "eager"
        self.layers = []
        for i in range(self.cfg["num_hidden_layers"]):
            layer = LlamaDecoderLayer(cfg, layer_idx=i).eval()
            if i == 0:
                layer.input_layernorm = torch.nn.Identity()
            prefix = f"layers.{i}."
            layer.load_state_dict(
                {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}, strict=True
            )
            self.layers.append(layer)

    def _stream(self, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        w = self.w
        if self.cfg.get("add_para_norm"):
            embeds = _rms(embeds, w["embedding_layernorm.weight"])
            feats = _rms(feats, w["hidden_states_layernorm.weight"])
        x = torch.cat([embeds, feats], -1) @ w["fc.weight"].T
        if "fc.bias" in w:
            x = x + w["fc.bias"]
        n = x.shape[0]
        pos = torch.arange(n)[None]
        cos_sin = self.hf.model.rotary_emb(x[None], pos)
        h = x[None]
        for layer in self.layers:
            h = layer(h, attention_mask=_causal(n), position_ids=pos, position_embeddings=cos_sin)
        return h[0]

    @torch.no_grad()
    def drafts(self, context: list[int], k: int) -> list[int]:
        ids = torch.tensor(context)
        last = len(context) - 2
        feats = self.hf.model(input_ids=ids[None, : last + 1]).last_hidden_state[0]
        embeds = self.embed[ids[1:]]
        out = []
        for _ in range(k):
            stream = self._stream(embeds, feats)
            tok = int((stream[-1] @ self.head.T).argmax())
            out.append(tok)
            embeds = torch.cat([embeds, self.embed[tok][None]])
            feats = torch.cat([feats, stream[-1][None]])
        return out


@pytest.mark.parametrize(
    "layout",
    [
        dict(num_layers=2, fc_bias=True),
        dict(own_embed=True, own_lm_head=True, add_para_norm=True, model_prefix=True),
    ],
    ids=["2layers_fcbias_shared_embed_head", "own_embed_head_hass_prefixed"],
)
def test_eagle_drafts_match_reference(llama_dir, tmp_path, layout):
    draft = make_eagle_draft(tmp_path / "d", llama_dir, seed=5, **layout)
    k = 3
    prompts = make_prompts(512, [11, 4, 19], seed=14)
    records = _drafted(
        llama_dir,
        prompts,
        {
            "method": "eagle",
            "model": draft,
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        },
        max_num_batched_tokens=8,  # chunked prefill
    )
    ref = _EagleReference(llama_dir, draft)
    checked = _sample(records)
    assert len(checked) >= 4
    for context, drafts in checked:
        assert drafts == ref.drafts(context, k), f"context of {len(context)} tokens"


def test_eagle_loading_shares_what_the_draft_lacks(llama_dir, tmp_path):
    for own in (False, True):
        draft = make_eagle_draft(
            tmp_path / f"d{own}", llama_dir, own_embed=own, own_lm_head=own, fc_bias=own
        )
        llm = LLM(
            model=llama_dir,
            **COMMON,
            speculative_config={
                "method": "eagle",
                "model": draft,
                "adaptive_num_speculative_tokens": False,
                "num_speculative_tokens": 1,
            },
        )
        try:
            runner = _runner(llm)
            target, d = runner.model, runner.speculator.model
            assert type(d).__name__ == "EagleLlamaForCausalLM"
            assert (d.model.embed_tokens is target.model.embed_tokens) is (not own)
            assert (d.lm_head is target.lm_head) is (not own)
            assert (d.model.fc.bias is not None) is own
            assert not hasattr(d.model.layers[0].input_layernorm, "weight")
        finally:
            llm.shutdown()
