# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft checkpoints for the speculative-decoding tests.

- make_eagle3_draft: a random EAGLE3 head (`LlamaForCausalLMEagle3` folder: fc, midlayer.*, norm,
  lm_head over a reduced draft vocabulary with d2t/t2d, optionally embed_tokens) for a Llama or
  Qwen2 target folder.
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

__all__ = ["make_eagle3_draft", "make_mtp_self_draft"]


def _read_config(folder: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


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
    t = _read_config(target_dir)
    h = int(t["hidden_size"])
    vocab = int(t["vocab_size"])
    heads = int(t["num_attention_heads"])
    kv_heads = int(t.get("num_key_value_heads") or heads)
    head_dim = int(t.get("head_dim") or h // heads)
    inter = int(intermediate_size or t["intermediate_size"])
    dv = int(draft_vocab_size or vocab)
    gen = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (gain / cols**0.5)

    def norm() -> torch.Tensor:
        return torch.rand(h, generator=gen) + 0.5

    w: dict[str, torch.Tensor] = {
        "fc.weight": mat(h, len(aux_layers) * h),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": mat(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": mat(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": mat(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": mat(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": mat(inter, h),
        "midlayer.mlp.up_proj.weight": mat(inter, h),
        "midlayer.mlp.down_proj.weight": mat(h, inter),
        "norm.weight": norm(),
        "lm_head.weight": mat(dv, h, gain=4.0),
    }
    if dv < vocab:
        ids = torch.randperm(vocab, generator=gen)[:dv].sort().values
        w["d2t"] = ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
    if own_embed:
        w["embed_tokens.weight"] = torch.randn(vocab, h, generator=gen)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in w.items()}, out / "model.safetensors", {"format": "pt"}
    )
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "draft_vocab_size": dv,
        "target_hidden_size": h,
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(t["max_position_embeddings"]),
        "rope_parameters": t.get("rope_parameters", {"rope_type": "default", "rope_theta": 1e4}),
        "tie_word_embeddings": False,
        "norm_before_residual": norm_before_residual,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layers),
            "use_aux_hidden_state": True,
        },
        "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
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
