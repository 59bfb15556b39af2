# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft checkpoints for the speculative-decoding tests.

- make_eagle3_draft: a random EAGLE3 head (`LlamaForCausalLMEagle3` folder: fc, midlayer.*, norm,
  lm_head over a reduced draft vocabulary with d2t/t2d, optionally embed_tokens) for a Llama or
  Qwen2 target folder.
- make_eagle_draft: an EAGLE-1 head in the public layout (config `architectures:
  ["LlamaForCausalLM"]`; fc [H, 2H] over concat[embed, target hidden], optional fc.bias;
  layers.{i}.* Llama decoder layers, layer 0 without input_layernorm; optionally embed_tokens /
  lm_head), random or "self" (fc = [I | 0], attention and MLP outputs 0: the draft's output is
  the embedding of its input token).
- make_eagle3_bigram_head: an EAGLE3 head built to accept (no training): from its input token v
  alone it drafts what a "bigram" target predicts after v (see make_llama_bigram_target), so
  its drafts are known without running it (eagle3_head_drafts) and acceptance is partial on a
  near-bigram target.
- make_llama_bigram_target: a copy of a Llama checkpoint whose attention/MLP outputs are scaled
  by target_scale, embedding rows rescaled to RMS 1 and final norm weight 1; with
  target_scale = 0 its last hidden state at a token is that token's embedding, so the "self"
  EAGLE-1 head predicts it exactly (every greedy draft accepted).
- make_mtp_self_draft: a copy of a DeepSeek-V3 MTP checkpoint whose MTP layers reproduce the
  target's next-token choice, built analytically (no training):
  the target's attention and MLP outputs are scaled by `target_scale` (0: the target becomes a
  "bigram" model, logits = lm_head(norm(embed(token)))), and every MTP layer is set to
  enorm = 1, hnorm = 0, eh_proj = [I | 0], block outputs 0, shared_head.norm = the target's final
  norm, shared_head.head = lm_head, embed_tokens = the target's. The MTP layer then computes
  head(norm(rmsnorm(embed(next token)))), the bigram target's logits for the next token, so with
  target_scale = 0 every draft is accepted; a small target_scale keeps real attention in the
  target and gives partial acceptance.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "eagle3_head_drafts",
    "make_eagle3_bigram_head",
    "make_eagle3_draft",
    "make_eagle_draft",
    "make_llama_bigram_target",
    "make_mtp_self_draft",
]


def _read_config(folder: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


class _DraftInit:
    """A random draft head's dimensions (from its target's config) and weight initialisers."""

    def __init__(
        self, target_dir: str | os.PathLike, seed: int, intermediate_size: int | None = None
    ) -> None:
        t = _read_config(target_dir)
        self.target = t
        self.h = int(t["hidden_size"])
        self.vocab = int(t["vocab_size"])
        self.heads = int(t["num_attention_heads"])
        self.kv_heads = int(t.get("num_key_value_heads") or self.heads)
        self.head_dim = int(t.get("head_dim") or self.h // self.heads)
        self.inter = int(intermediate_size or t["intermediate_size"])
        self.gen = torch.Generator().manual_seed(seed)

    def mat(self, rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=self.gen) * (gain / cols**0.5)

    def norm(self) -> torch.Tensor:
        return torch.rand(self.h, generator=self.gen) + 0.5

    def write(
        self,
        out_dir: str | os.PathLike,
        weights: dict[str, torch.Tensor],
        architecture: str,
        num_layers: int,
        **config: Any,
    ) -> str:
        """Save the weights and a Llama-style config.json (plus `config`); returns out_dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            out / "model.safetensors",
            {"format": "pt"},
        )
        t = self.target
        cfg = {
            "architectures": [architecture],
            "model_type": "llama",
            "hidden_size": self.h,
            "intermediate_size": self.inter,
            "num_hidden_layers": num_layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
            "max_position_embeddings": int(t["max_position_embeddings"]),
            "rope_parameters": t.get(
                "rope_parameters", {"rope_type": "default", "rope_theta": 1e4}
            ),
            "tie_word_embeddings": False,
            "dtype": "float32",
            **config,
        }
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return str(out)


def make_eagle3_draft(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    aux_layers: tuple[int, ...] = (1, 2, 3),
    own_embed: bool = True,
    draft_vocab_size: int | None = None,
    norm_before_residual: bool = False,
    intermediate_size: int | None = None,
    seed: int = 0,
) -> str:
    """Write a random EAGLE3 draft for the target in target_dir; returns out_dir.

    draft_vocab_size < the target's vocabulary picks a random sorted subset of target ids
    (d2t[i] = target_id[i] - i). own_embed=False omits embed_tokens (the target's is shared).
    """
    d = _DraftInit(target_dir, seed, intermediate_size)
    h, vocab, mat, norm = d.h, d.vocab, d.mat, d.norm
    q_rows, kv_rows = d.heads * d.head_dim, d.kv_heads * d.head_dim
    dv = int(draft_vocab_size or vocab)
    w: dict[str, torch.Tensor] = {
        "fc.weight": mat(h, len(aux_layers) * h),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": mat(q_rows, 2 * h),
        "midlayer.self_attn.k_proj.weight": mat(kv_rows, 2 * h),
        "midlayer.self_attn.v_proj.weight": mat(kv_rows, 2 * h),
        "midlayer.self_attn.o_proj.weight": mat(h, q_rows),
        "midlayer.mlp.gate_proj.weight": mat(d.inter, h),
        "midlayer.mlp.up_proj.weight": mat(d.inter, h),
        "midlayer.mlp.down_proj.weight": mat(h, d.inter),
        "norm.weight": norm(),
        "lm_head.weight": mat(dv, h, gain=4.0),
    }
    if dv < vocab:
        ids = torch.randperm(vocab, generator=d.gen)[:dv].sort().values
        w["d2t"] = ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
    if own_embed:
        w["embed_tokens.weight"] = torch.randn(vocab, h, generator=d.gen)
    return d.write(
        out_dir,
        w,
        "LlamaForCausalLMEagle3",
        1,
        draft_vocab_size=dv,
        target_hidden_size=h,
        norm_before_residual=norm_before_residual,
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": list(aux_layers),
            "use_aux_hidden_state": True,
        },
    )


# The bigram EAGLE3 head: its width is the target's plus a constant block, and the attention
# logit of a position with itself exceeds that with any other position by at least this much.
_BIGRAM_HEAD_EXTRA = 16
_BIGRAM_SELF_MARGIN = 40.0


def _rope_self_query(head_dim: int, theta: float, max_pos: int) -> torch.Tensor:
    """A query q (= key) whose RoPE attention logit q . R(d) q / sqrt(head_dim) is highest at
    distance d = 0, by _BIGRAM_SELF_MARGIN over every 0 < d < max_pos: its energy sits on the
    8 highest-frequency rotary pairs (neox layout), whose cosines never all come close to 1."""
    half = head_dim // 2
    freqs = theta ** (-2 * torch.arange(half, dtype=torch.float64) / head_dim)
    pairs = 8
    d = torch.arange(1, max_pos, dtype=torch.float64)
    worst = float(torch.cos(d[:, None] * freqs[None, :pairs]).mean(1).max())
    # logit(0) = pairs * a / sqrt(head_dim); logit(d) <= worst * logit(0).
    a = _BIGRAM_SELF_MARGIN * head_dim**0.5 / (pairs * (1.0 - worst))
    q = torch.zeros(head_dim, dtype=torch.float64)
    q[:pairs] = q[half : half + pairs] = (a / 2) ** 0.5
    return q.float()


@torch.no_grad()
def make_eagle3_bigram_head(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    aux_layers: tuple[int, ...] = (1, 2, 3),
    draft_vocab_size: int | None = None,
    seed: int = 0,
) -> str:
    """Write an EAGLE3 head (legacy layout, own embedding and LM head) whose draft from input
    token v is argmax over its vocabulary of lm_head_target(e_v), e_v the target's embedding row
    scaled to RMS 1: for a bigram target (make_llama_bigram_target) the target's next token.

    Width H + 16: embed_tokens[v] = [e_v ; 1 ... 1] (RMS 1 for every v). One head of that
    width: q and k read only the constant block (the same vector at every position, rotated by
    RoPE; _rope_self_query makes each position attend to itself alone), v the e_v block, o_proj
    the identity; fc, hidden_norm (norm_before_residual: no residual) and the MLP output are
    zero, so nothing but the token reaches the output h = [e_v ; 0], and the LM head is
    [lm_head_target ; 0] over the draft vocabulary (a random subset of target ids with
    draft_vocab_size, mapped by d2t)."""
    d = _DraftInit(target_dir, seed)
    h, vocab, extra = d.h, d.vocab, _BIGRAM_HEAD_EXTRA
    width = h + extra
    target = {}
    for path in _shards(Path(target_dir)):
        with safe_open(str(path), framework="pt") as f:
            target.update({k: f.get_tensor(k).float() for k in f.keys()})
    embed = target["model.embed_tokens.weight"]
    head = target.get("lm_head.weight", embed)
    e = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    dv = int(draft_vocab_size or vocab)
    ids = torch.arange(vocab)
    if dv < vocab:
        ids = torch.randperm(vocab, generator=d.gen)[:dv].sort().values
    rope = d.target.get("rope_parameters") or {}
    q = _rope_self_query(
        width, float(rope.get("rope_theta", 1e4)), d.target["max_position_embeddings"]
    )
    qk = torch.zeros(width, 2 * width)
    qk[:, h] = q  # reads the first constant entry (1 for every token)
    v_proj = torch.zeros(width, 2 * width)
    v_proj[:h, :h] = torch.eye(h)
    inter = 16
    w: dict[str, torch.Tensor] = {
        "fc.weight": torch.zeros(width, len(aux_layers) * h),
        "midlayer.input_layernorm.weight": torch.ones(width),
        "midlayer.hidden_norm.weight": torch.zeros(width),
        "midlayer.post_attention_layernorm.weight": torch.ones(width),
        "midlayer.self_attn.q_proj.weight": qk,
        "midlayer.self_attn.k_proj.weight": qk.clone(),
        "midlayer.self_attn.v_proj.weight": v_proj,
        "midlayer.self_attn.o_proj.weight": torch.eye(width),
        "midlayer.mlp.gate_proj.weight": d.mat(inter, width),
        "midlayer.mlp.up_proj.weight": d.mat(inter, width),
        "midlayer.mlp.down_proj.weight": torch.zeros(width, inter),
        "norm.weight": torch.ones(width),
        "lm_head.weight": torch.cat([head[ids], torch.zeros(dv, extra)], dim=1),
        "embed_tokens.weight": torch.cat([e, torch.ones(vocab, extra)], dim=1),
    }
    if dv < vocab:
        w["d2t"] = ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
    return d.write(
        out_dir,
        w,
        "LlamaForCausalLMEagle3",
        1,
        hidden_size=width,
        intermediate_size=inter,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=width,
        draft_vocab_size=dv,
        target_hidden_size=h,
        norm_before_residual=True,
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": list(aux_layers),
            "use_aux_hidden_state": True,
        },
    )


def eagle3_head_drafts(head_dir: str | os.PathLike) -> torch.Tensor:
    """[vocab] the token make_eagle3_bigram_head's head drafts after each input token, from
    its own weights: the target id of argmax_j lm_head[j] . embed_tokens[v] over the token
    block."""
    with safe_open(str(Path(head_dir) / "model.safetensors"), framework="pt") as f:
        w = {k: f.get_tensor(k).double() for k in f.keys()}
    h = int(_read_config(head_dir)["target_hidden_size"])
    best = (w["embed_tokens.weight"][:, :h] @ w["lm_head.weight"][:, :h].T).argmax(-1)
    dv = w["lm_head.weight"].shape[0]
    d2t = w["d2t"].long() if "d2t" in w else torch.zeros(dv, dtype=torch.long)
    return (torch.arange(dv) + d2t)[best]


def make_eagle_draft(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    num_layers: int = 1,
    own_embed: bool = False,
    own_lm_head: bool = False,
    fc_bias: bool = False,
    add_para_norm: bool = False,
    self_draft: bool = False,
    model_prefix: bool = False,
    seed: int = 0,
) -> str:
    """Write an EAGLE-1 draft for the Llama target in target_dir; returns out_dir.

    model_prefix writes the names as `model.fc.weight`, `model.layers.0...` (both spellings
    occur in published heads)."""
    d = _DraftInit(target_dir, seed)
    h, mat, norm = d.h, d.mat, d.norm
    q_rows, kv_rows = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out_scale = 0.0 if self_draft else 1.0  # a self draft's layers add nothing to the stream
    w: dict[str, torch.Tensor] = {}
    if self_draft:
        w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    else:
        w["fc.weight"] = mat(h, 2 * h)
    if fc_bias:
        w["fc.bias"] = torch.randn(h, generator=d.gen) * 0.1 * out_scale
    if add_para_norm:
        w["embedding_layernorm.weight"] = norm()
        w["hidden_states_layernorm.weight"] = norm()
    for i in range(num_layers):
        p = f"layers.{i}."
        if i > 0:
            w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = mat(q_rows, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv_rows, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv_rows, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, q_rows) * out_scale
        w[p + "mlp.gate_proj.weight"] = mat(d.inter, h)
        w[p + "mlp.up_proj.weight"] = mat(d.inter, h)
        w[p + "mlp.down_proj.weight"] = mat(h, d.inter) * out_scale
    if own_embed:
        w["embed_tokens.weight"] = torch.randn(d.vocab, h, generator=d.gen)
    if model_prefix:
        w = {f"model.{k}": v for k, v in w.items()}
    if own_lm_head:
        w["lm_head.weight"] = mat(d.vocab, h, gain=4.0)
    extra = {"add_para_norm": True} if add_para_norm else {}
    return d.write(out_dir, w, "LlamaForCausalLM", num_layers, **extra)


@torch.no_grad()
def make_llama_bigram_target(
    out_dir: str | os.PathLike, src_dir: str | os.PathLike, *, target_scale: float = 0.0
) -> str:
    """Copy the Llama checkpoint src_dir with attention/MLP outputs scaled by target_scale,
    embedding rows of RMS 1 and a final norm weight of 1 (see the module docstring)."""
    src, out = Path(src_dir), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    for path in _shards(out):
        with safe_open(str(path), framework="pt") as f:
            w = {k: f.get_tensor(k) for k in f.keys()}
        for k, v in w.items():
            if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
                w[k] = v * target_scale
            elif k == "model.embed_tokens.weight":
                w[k] = v / v.pow(2).mean(-1, keepdim=True).sqrt()
            elif k == "model.norm.weight":
                w[k] = torch.ones_like(v)
        save_file({k: v.contiguous() for k, v in w.items()}, path, {"format": "pt"})
    return str(out)


@torch.no_grad()
def make_mtp_self_draft(
    out_dir: str | os.PathLike,
    src_dir: str | os.PathLike,
    *,
    target_scale: float = 0.0,
    draft_block_scale: float = 0.0,
) -> str:
    """Copy the DeepSeek-V3 MTP checkpoint src_dir to out_dir with MTP layers that reproduce
    the (scaled) target's next token (see the module docstring); returns out_dir.

    draft_block_scale > 0 keeps the MTP decoder block's random attention and MLP outputs,
    scaled by it: the drafts then also depend on the draft's own KV cache."""
    src, out = Path(src_dir), Path(out_dir)
    cfg = _read_config(src)
    n_layers = int(cfg["num_hidden_layers"])
    h = int(cfg["hidden_size"])
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    shards = {p.name: p for p in _shards(out)}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, path in shards.items():
        with safe_open(str(path), framework="pt") as f:
            tensors[name] = {k: f.get_tensor(k) for k in f.keys()}
    flat = {k: v for shard in tensors.values() for k, v in shard.items()}
    embed = flat["model.embed_tokens.weight"]
    head = flat["lm_head.weight"]
    final_norm = flat["model.norm.weight"]
    for shard in tensors.values():
        for k, v in shard.items():
            if not k.startswith("model.layers."):
                continue
            layer = int(k.split(".")[2])
            out_proj = k.endswith("o_proj.weight") or k.endswith("down_proj.weight")
            if layer < n_layers:
                if out_proj:
                    shard[k] = v * target_scale
                continue
            rest = k.split(".", 3)[3]
            if out_proj:
                shard[k] = v * draft_block_scale
            elif rest == "enorm.weight":
                shard[k] = torch.ones_like(v)
            elif rest == "hnorm.weight":
                shard[k] = torch.zeros_like(v)
            elif rest == "eh_proj.weight":
                eh = torch.zeros_like(v)
                eh[:, :h] = torch.eye(h, dtype=v.dtype)
                shard[k] = eh
            elif rest == "shared_head.norm.weight":
                shard[k] = final_norm.clone()
            elif rest == "shared_head.head.weight":
                shard[k] = head.clone()
            elif rest == "embed_tokens.weight":
                shard[k] = embed.clone()
    for name, shard in tensors.items():
        save_file({k: v.contiguous() for k, v in shard.items()}, shards[name], {"format": "pt"})
    return str(out)
