# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Train the bundled tiny DeepSeek-V3 model with two MTP layers, on CPU, from scratch.

Everything the script needs is on any machine with CPython: the training text is the
Python standard library's own ``.py`` sources (PSF License; only the trained weights are
shipped).  The script

1. collects the stdlib sources (sorted, test directories and site-packages skipped) and
   splits them into train / held-out *by file* (every ``--heldout-every``-th file);
2. trains a byte-level BPE tokenizer (``tokenizers``) with the special tokens
   ``<|endoftext|>`` (eos, pad), ``<|im_start|>``, ``<|im_end|>`` and a ChatML template;
3. trains HF transformers' ``DeepseekV3ForCausalLM`` (MLA with q_lora_rank, MoE with
   sigmoid routing + ``e_score_correction_bias`` (updated aux-loss-free, as in DeepSeek-V3),
   group-limited top-k, a shared expert, ``first_k_dense_replace = 1``) jointly with
   ``--mtp-layers`` MTP layers using DeepSeek-V3's MTP objective, with this MTP forward:

   * depth ``k`` (1-based) at position ``t`` gets ``h_prev`` (depth 1: the main model's last
     hidden state *after* its final norm; depth ``k > 1``: depth ``k-1``'s output ``h``) and
     ``e = embed(x[t+k])``, zeroed at (absolute) position 0;
   * ``x = eh_proj(cat[enorm(e), hnorm(h_prev)])`` (embedding first), ``h = block(x)`` (a full
     DeepSeek-V3 MoE decoder layer including its residual, causal attention over the same
     sequence, RoPE at the same positions), ``logits = shared_head.head(shared_head.norm(h))``
     predicts ``x[t+k+1]``;
   * the embedding and the output head are shared with the main model during training (as
     in DeepSeek-V3) and saved as copies (``embed_tokens`` / ``shared_head.head``) in every
     MTP layer;
   * ``loss = CE_main + lambda * mean_k CE_k``;

4. prints the loss curve and held-out metrics, writes a PNG of the curves;
5. saves an HF folder: ``config.json`` (``num_nextn_predict_layers``), ``model.safetensors``
   holding the main weights exactly as ``save_pretrained`` names them plus the MTP layers as
   ``model.layers.{N+i}.*`` (per-expert MoE names for both), the tokenizer files and a model
   card, then verifies that ``AutoModelForCausalLM`` loads it and that the MTP weights
   round-trip.

Deterministic for a given seed, thread count and Python version (the stdlib differs between
Python versions).  ``--smoke`` trains a tiny configuration for a few steps into a temporary
folder in well under a minute.

Usage::

    python tools/train_tiny_mtp.py                    # full run (~25 min on 2 cores)
    python tools/train_tiny_mtp.py --smoke            # self-check
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# On a shared machine, busy-waiting OpenMP threads slow training down many-fold; this must be
# set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch import nn

# The engine's own converters between HF's fused in-memory experts and per-expert checkpoint
# names (the layout the engine's loader reads).
from vllm.model_executor.layers.fused_moe import fuse_experts, split_fused_experts
from vllm.model_zoo.smollm2 import CHATML_TEMPLATE
from vllm.testing.checkpoints import train_bpe

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "vllm" / "model_zoo" / "tiny-deepseek-mtp"
DEFAULT_PLOT = REPO_ROOT / "benchmarks" / "training_curves.png"

EOS_TOKEN = "<|endoftext|>"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--plot", type=Path, default=None, help=f"PNG path (default {DEFAULT_PLOT})")
    p.add_argument("--smoke", action="store_true", help="tiny config, ~20 steps, temp folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default 2; --smoke: 1)"
    )
    # data
    p.add_argument("--heldout-every", type=int, default=10, help="file i is held out if i%%n==n//2")
    p.add_argument("--max-files", type=int, default=0, help="use only the first N files (0: all)")
    p.add_argument("--vocab-size", type=int, default=2048)
    # model
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--q-lora-rank", type=int, default=128, help="0: null (plain q_proj)")
    p.add_argument("--kv-lora-rank", type=int, default=64)
    p.add_argument("--qk-nope-head-dim", type=int, default=32)
    p.add_argument("--qk-rope-head-dim", type=int, default=16)
    p.add_argument("--v-head-dim", type=int, default=32)
    p.add_argument("--intermediate-size", type=int, default=512, help="dense layer MLP")
    p.add_argument("--moe-intermediate-size", type=int, default=128)
    p.add_argument("--n-routed-experts", type=int, default=8)
    p.add_argument("--experts-per-tok", type=int, default=2)
    p.add_argument("--n-group", type=int, default=4)
    p.add_argument("--topk-group", type=int, default=2)
    p.add_argument("--routed-scaling-factor", type=float, default=2.5)
    p.add_argument("--mtp-layers", type=int, default=2)
    p.add_argument("--experts-impl", default="eager", help="transformers experts implementation")
    # training
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mtp-lambda", type=float, default=0.3, help="weight of the mean MTP CE")
    p.add_argument(
        "--mtp-distill",
        type=float,
        default=0.0,
        help="optional extra MTP term: beta * CE(MTP_k, softmax(main logits at t+k)) (0: off)",
    )
    p.add_argument(
        "--bias-update-speed", type=float, default=1e-2, help="aux-loss-free balancing step"
    )
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument(
        "--eval-windows", type=int, default=16, help="held-out windows per periodic eval"
    )
    p.add_argument("--final-eval-windows", type=int, default=96)
    p.add_argument("--rollout-prompts", type=int, default=16)
    p.add_argument("--rollout-prompt-len", type=int, default=48)
    p.add_argument("--rollout-new-tokens", type=int, default=64)
    p.add_argument("--no-verify", action="store_true", help="skip the HF reload checks")
    args = p.parse_args(argv)
    if args.smoke:
        smoke = dict(
            vocab_size=512,
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_group=2,
            topk_group=1,
            steps=20,
            batch_size=4,
            seq_len=64,
            warmup=4,
            log_every=5,
            eval_every=10,
            eval_windows=4,
            final_eval_windows=4,
            rollout_prompts=2,
            rollout_prompt_len=16,
            rollout_new_tokens=8,
            max_files=40,
            heldout_every=5,
        )
        for k, v in smoke.items():
            setattr(args, k, v)
    if args.threads is None:
        args.threads = 1 if args.smoke else 2
    return args


# --------------------------------------------------------------------------- corpus


def stdlib_files(max_files: int = 0) -> tuple[Path, list[Path]]:
    """Sorted stdlib ``.py`` files, without tests, site-packages and the codec tables."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in _SKIP_DIRS for part in parts[:-1]):
            continue
        if parts[0] == "encodings" and parts[-1] != "__init__.py":
            continue  # generated charmap tables: megabytes of hex literals
        if parts[-1].startswith("test_"):
            continue
        files.append(path)
    if max_files:
        files = files[:max_files]
    return root, files


def split_files(files: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    """Deterministic split by file: file i is held out iff i % every == every // 2."""
    train = [f for i, f in enumerate(files) if i % every != every // 2]
    heldout = [f for i, f in enumerate(files) if i % every == every // 2]
    return train, heldout


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (``tokenizers``) wrapped as a ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(texts, vocab_size),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def encode_stream(tokenizer, texts: list[str]) -> tuple[torch.Tensor, list[int]]:
    """Concatenate the files' token ids, each followed by ``<|endoftext|>``.

    Returns the stream and the offset at which each file starts.
    """
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    starts = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        starts.append(len(ids))
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long), starts


# --------------------------------------------------------------------------- model


def build_config(args: argparse.Namespace, tokenizer):
    from transformers import DeepseekV3Config

    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        n_shared_experts=1,
        n_routed_experts=args.n_routed_experts,
        num_experts_per_tok=args.experts_per_tok,
        n_group=args.n_group,
        topk_group=args.topk_group,
        routed_scaling_factor=args.routed_scaling_factor,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        q_lora_rank=args.q_lora_rank or None,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        max_position_embeddings=max(2048, 2 * args.seq_len),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_nextn_predict_layers=args.mtp_layers,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
        initializer_range=0.02,
    )
    return config


def _decoder_layer_cls():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    return DeepseekV3DecoderLayer


class SharedHead(nn.Module):
    """``shared_head``: its ``norm`` is trained per layer; ``head`` is the main ``lm_head``
    during training and saved as a copy (``shared_head.head.weight``)."""

    def __init__(self, config):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        super().__init__()
        self.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def make_mtp_layer(config, layer_idx: int) -> nn.Module:
    """A DeepSeek-V3 MoE decoder layer (HF's class, so its parameter names are HF's) plus the
    MTP-specific ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    block_config = copy.deepcopy(config)
    block_config.first_k_dense_replace = 0  # MTP blocks are MoE, as in DeepSeek-V3
    layer = _decoder_layer_cls()(block_config, layer_idx)
    hidden = config.hidden_size
    layer.enorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
    layer.hnorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
    layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
    layer.shared_head = SharedHead(config)
    return layer


@torch.no_grad()
def init_mtp_layer_(layer: nn.Module, std: float) -> None:
    """HF-style init: matrices N(0, std^2), norms 1, router bias 0."""
    for name, param in layer.named_parameters():
        if param.ndim >= 2:
            param.normal_(0.0, std)
        elif "norm" in name:
            param.fill_(1.0)
        else:
            raise AssertionError(f"no init rule for {name}")
    for name, buf in layer.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.zero_()


class TinyDeepseekMTP(nn.Module):
    """HF ``DeepseekV3ForCausalLM`` (``.model``) + ``mtp`` layers, trained jointly."""

    def __init__(self, config, experts_impl: str = "eager"):
        super().__init__()
        from transformers import DeepseekV3ForCausalLM

        config._attn_implementation = "sdpa"
        config._experts_implementation = experts_impl
        self.config = config
        self.lm = DeepseekV3ForCausalLM(config)
        n = config.num_hidden_layers
        self.mtp = nn.ModuleList(
            [make_mtp_layer(config, n + i) for i in range(config.num_nextn_predict_layers)]
        )
        for layer in self.mtp:
            init_mtp_layer_(layer, config.initializer_range)

    def forward(self, input_ids: torch.Tensor) -> dict[str, Any]:
        """Main logits [B, T, V] and per-depth (hidden [B, T-k, H], logits [B, T-k, V])."""
        bsz, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
        base = self.lm.model
        # last_hidden_state is AFTER the final norm: what the MTP forward feeds to depth 1.
        h_main = base(input_ids=input_ids, position_ids=positions, use_cache=False)
        h_main = h_main.last_hidden_state
        logits = self.lm.lm_head(h_main)
        cos, sin = base.rotary_emb(h_main, positions)
        depths = []
        h_prev = h_main
        for k, layer in enumerate(self.mtp, start=1):
            length = seq - k
            if length < 2:
                break
            emb = base.embed_tokens(input_ids[:, k:])  # position t holds x[t+k]
            keep = torch.ones(1, length, 1, dtype=emb.dtype, device=emb.device)
            keep[:, 0] = 0.0  # zeroed at absolute position 0
            emb = emb * keep
            x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h_prev[:, :length])], -1))
            h = layer(
                x,
                attention_mask=None,  # sdpa: causal
                position_ids=positions[:, :length],
                position_embeddings=(cos[:, :length], sin[:, :length]),
            )
            depth_logits = self.lm.lm_head(layer.shared_head.norm(h))
            depths.append((h, depth_logits))
            h_prev = h
        return {"logits": logits, "depths": depths}


def mtp_losses(
    out: dict[str, Any], input_ids: torch.Tensor, distill: float = 0.0
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Main CE and per-depth MTP CE (depth k at t predicts x[t+k+1]); optional distill terms."""
    logits = out["logits"]
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1))
    ces, kls = [], []
    for k, (_, dl) in enumerate(out["depths"], start=1):
        n = dl.shape[1] - 1  # positions 0 .. T-k-2 have a target
        pred = dl[:, :n].reshape(-1, vocab)
        ces.append(F.cross_entropy(pred, input_ids[:, k + 1 :].reshape(-1)))
        if distill > 0:
            teacher = logits[:, k : k + n].detach().reshape(-1, vocab).softmax(-1)
            kls.append(-(teacher * pred.log_softmax(-1)).sum(-1).mean())
    return main, ces, kls


# --------------------------------------------------------------------------- MoE balancing


class RouterLoadTracker:
    """DeepSeek-V3's auxiliary-loss-free balancing: count each router's expert picks and move
    ``e_score_correction_bias`` by ``speed * sign(mean_load - load)`` after every step."""

    def __init__(self, model: nn.Module, speed: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.speed = speed
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = [torch.zeros(r.num_experts) for r in self.routers]
        self.enabled = True
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, inputs, output):
            if self.enabled and module.training:
                idx = output[2].reshape(-1)
                self.counts[i] += torch.bincount(idx, minlength=module.num_experts).float()

        return hook

    @torch.no_grad()
    def step(self) -> float:
        """Apply the bias update; returns the mean max/mean load ratio (1.0 = balanced)."""
        ratios = []
        for router, counts in zip(self.routers, self.counts):
            if counts.sum() == 0:
                continue
            mean = counts.mean()
            router.e_score_correction_bias += self.speed * torch.sign(mean - counts)
            ratios.append(float(counts.max() / mean))
            counts.zero_()
        return sum(ratios) / max(len(ratios), 1)


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: TinyDeepseekMTP, windows: torch.Tensor, batch_size: int) -> dict[str, float]:
    """Held-out teacher-forced metrics.

    ``mtp{k}_acc``: argmax of depth k at t == x[t+k+1] (ground truth);
    ``mtp{k}_agree``: argmax of depth k at t == the main model's argmax at t+k (its own greedy
    prediction of x[t+k+1] given the true prefix), what greedy acceptance measures.
    """
    was_training = model.training
    model.eval()
    n_depth = len(model.mtp)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(key: str, value: float, count: int) -> None:
        sums[key] = sums.get(key, 0.0) + value
        counts[key] = counts.get(key, 0) + count

    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i : i + batch_size]
        out = model(ids)
        logits = out["logits"]
        vocab = logits.shape[-1]
        greedy = logits.argmax(-1)  # greedy[t] predicts x[t+1]
        tgt = ids[:, 1:]
        n = tgt.numel()
        add(
            "main_loss",
            F.cross_entropy(
                logits[:, :-1].reshape(-1, vocab), tgt.reshape(-1), reduction="sum"
            ).item(),
            n,
        )
        add("main_acc", (greedy[:, :-1] == tgt).sum().item(), n)
        for k, (_, dl) in enumerate(out["depths"], start=1):
            m = dl.shape[1] - 1
            pred = dl[:, :m]
            tgt_k = ids[:, k + 1 :]
            ce = F.cross_entropy(pred.reshape(-1, vocab), tgt_k.reshape(-1), reduction="sum")
            add(f"mtp{k}_loss", ce.item(), tgt_k.numel())
            arg = pred.argmax(-1)
            add(f"mtp{k}_acc", (arg == tgt_k).sum().item(), tgt_k.numel())
            add(f"mtp{k}_agree", (arg == greedy[:, k : k + m]).sum().item(), tgt_k.numel())
    model.train(was_training)
    res = {k: sums[k] / counts[k] for k in sums}
    for k in range(1, n_depth + 1):
        res.setdefault(f"mtp{k}_acc", float("nan"))
    return res


@torch.no_grad()
def greedy_generate(lm: nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding with a KV cache (no stopping): [B, P] -> [B, P + new_tokens]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.config)
    ids = prompt
    out = lm(input_ids=ids, past_key_values=cache, use_cache=True)
    for _ in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        out = lm(input_ids=nxt, past_key_values=cache, use_cache=True)
    return ids


@torch.no_grad()
def rollout_acceptance(model: TinyDeepseekMTP, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Greedy-decode each prompt with the main model, then score the MTP drafts a greedy
    speculative decoder would propose along that trajectory.

    The draft for x[t+2] at position t sees the embedding of x[t+1] (the token the target just
    emitted) and h_t, exactly as in the engine; on the generated part the main model's greedy
    token *is* the sequence, so ``accept_1 = P(depth-1 draft == x[t+2])``.  ``accept_2`` is
    ``P(depth-1 and depth-2 drafts both right)`` (the depth-2 input token equals the depth-1
    draft whenever that was right; this assumes the depth-2 layer attends over the full
    sequence, as trained).  Expected accepted length per step ~ 1 + accept_1 + accept_2.
    """
    was_training = model.training
    model.eval()
    seqs = greedy_generate(model.lm, prompts, new_tokens)
    out = model(seqs)
    plen = prompts.shape[1]
    total = seqs.shape[1]
    res: dict[str, float] = {}
    ok_prev = None
    n_depth = len(out["depths"])
    # positions t whose inputs x[t+1..t+k] and targets x[t+k+1] are all generated tokens, for
    # every depth k (the same positions for all depths)
    lo, hi = plen - 1, total - n_depth - 1  # t in [lo, hi)
    for k, (_, dl) in enumerate(out["depths"], start=1):
        arg = dl[:, lo:hi].argmax(-1)
        ok = arg == seqs[:, lo + k + 1 : hi + k + 1]
        if ok_prev is not None:
            ok = ok & ok_prev
        res[f"accept_{k}"] = ok.float().mean().item()
        ok_prev = ok
    res["mean_acceptance_length_est"] = 1.0 + sum(
        v for key, v in res.items() if key.startswith("accept_")
    )
    model.train(was_training)
    res["_sequences"] = seqs  # type: ignore[assignment]
    return res


# --------------------------------------------------------------------------- saving


@torch.no_grad()
def round_to_bf16_(model: nn.Module) -> None:
    """Round every parameter to bf16 (kept in fp32), so final metrics describe the shipped
    bf16 weights.  Router biases stay fp32 (as saved)."""
    for param in model.parameters():
        param.copy_(param.bfloat16().float())


def mtp_state_dict(model: TinyDeepseekMTP) -> dict[str, torch.Tensor]:
    """``model.layers.{N+i}.*`` tensors (bf16; router bias fp32), per-expert names."""
    n = model.config.num_hidden_layers
    embed = model.lm.model.embed_tokens.weight.detach()
    head = model.lm.lm_head.weight.detach()
    state: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.mtp):
        prefix = f"model.layers.{n + i}."
        for name, tensor in split_fused_experts(layer.state_dict()).items():
            keep_fp32 = name.endswith("e_score_correction_bias")
            state[prefix + name] = (
                tensor.detach().to(torch.float32 if keep_fp32 else torch.bfloat16).contiguous()
            )
        state[prefix + "embed_tokens.weight"] = embed.to(torch.bfloat16).clone()
        state[prefix + "shared_head.head.weight"] = head.to(torch.bfloat16).clone()
    return state


def save_checkpoint(model: TinyDeepseekMTP, tokenizer, out_dir: Path) -> list[str]:
    """Write the HF folder; returns the MTP weight names."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("model*.safetensors*"):
        old.unlink()
    lm = copy.deepcopy(model.lm).to(torch.bfloat16)
    for sub in lm.modules():  # keep router biases fp32 as in real checkpoints
        bias = getattr(sub, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            sub.e_score_correction_bias = bias.float()
    lm.config.dtype = torch.bfloat16
    lm.generation_config.bos_token_id = None
    lm.save_pretrained(str(out_dir), safe_serialization=True)
    shards = sorted(out_dir.glob("model*.safetensors"))
    main_state: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            main_state.update({k: f.get_tensor(k) for k in f.keys()})
        shard.unlink()
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    mtp_state = mtp_state_dict(model)
    overlap = set(main_state) & set(mtp_state)
    assert not overlap, overlap
    save_file({**main_state, **mtp_state}, str(out_dir / "model.safetensors"), {"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)
    tokenizer.save_pretrained(str(out_dir))
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["num_nextn_predict_layers"] = len(model.mtp)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return sorted(mtp_state)


@torch.no_grad()
def verify_checkpoint(
    model: TinyDeepseekMTP, tokenizer, out_dir: Path, probe: torch.Tensor
) -> dict[str, Any]:
    """Reload with HF transformers and compare against the in-memory (bf16-rounded) model.

    Checks: no missing / mismatched main weights and only MTP-layer keys unexpected; main
    logits equal; MTP layers rebuilt from the saved tensors give the same drafts; greedy
    sample text.
    """
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n = model.config.num_hidden_layers
    n_mtp = len(model.mtp)
    hf, info = AutoModelForCausalLM.from_pretrained(
        str(out_dir), dtype=torch.float32, output_loading_info=True
    )
    hf.eval()
    mtp_re = re.compile(rf"^model\.layers\.({'|'.join(str(n + i) for i in range(n_mtp))})\.")
    unexpected = sorted(info.get("unexpected_keys", []))
    bad_unexpected = [k for k in unexpected if not mtp_re.match(k)]
    report: dict[str, Any] = {
        "missing_keys": sorted(info.get("missing_keys", [])),
        "mismatched_keys": [str(x) for x in info.get("mismatched_keys", [])],
        "unexpected_non_mtp_keys": bad_unexpected,
        "unexpected_mtp_keys": len(unexpected) - len(bad_unexpected),
    }
    if report["missing_keys"] or report["mismatched_keys"] or bad_unexpected:
        raise RuntimeError(f"HF load of {out_dir} is not clean: {report}")

    model.eval()
    ref = model(probe)
    got = hf(input_ids=probe).logits
    report["hf_main_logits_max_abs_diff"] = (got - ref["logits"]).abs().max().item()

    # Rebuild the MTP layers from the saved names and compare drafts.
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    rebuilt = copy.deepcopy(model)
    for i, layer in enumerate(rebuilt.mtp):
        prefix = f"model.layers.{n + i}."
        sub = {k[len(prefix) :]: v.float() for k, v in saved.items() if k.startswith(prefix)}
        emb = sub.pop("embed_tokens.weight")
        head = sub.pop("shared_head.head.weight")
        assert torch.equal(emb, model.lm.model.embed_tokens.weight), "MTP embed copy"
        assert torch.equal(head, model.lm.lm_head.weight), "MTP head copy"
        layer.load_state_dict(fuse_experts(sub), strict=True)
    again = rebuilt(probe)
    report["mtp_roundtrip_max_abs_diff"] = max(
        (a[1] - b[1]).abs().max().item() for a, b in zip(again["depths"], ref["depths"])
    )
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    prompt = "def fibonacci(n):\n    "
    ids = tok(prompt, return_tensors="pt").input_ids
    gen = hf.generate(ids, max_new_tokens=48, do_sample=False, min_new_tokens=48)
    report["sample_prompt"] = prompt
    report["sample_completion"] = tok.decode(gen[0, ids.shape[1] :])
    model.train()
    return report


# --------------------------------------------------------------------------- report


@dataclass
class History:
    steps: list[int] = field(default_factory=list)
    main: list[float] = field(default_factory=list)
    mtp: list[list[float]] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)


def write_plot(hist: History, path: Path, n_depth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(hist.steps, hist.main, label="main CE (next token)")
    for k in range(n_depth):
        ax1.plot(
            hist.steps, [m[k] for m in hist.mtp], label=f"MTP depth {k + 1} CE (token +{k + 2})"
        )
    if hist.eval_steps:
        ax1.plot(
            hist.eval_steps,
            [e["main_loss"] for e in hist.evals],
            "k--",
            marker="o",
            markersize=3,
            label="held-out main CE",
        )
    ax1.set_xlabel("step")
    ax1.set_ylabel("cross-entropy (nats)")
    ax1.set_title("training loss (mean over each logging window)")
    ax1.grid(alpha=0.3)
    ax1.legend()
    if hist.eval_steps:
        ax2.plot(
            hist.eval_steps,
            [e["main_acc"] for e in hist.evals],
            "k-",
            marker="o",
            markersize=3,
            label="main top-1 acc",
        )
        for k in range(1, n_depth + 1):
            (line,) = ax2.plot(
                hist.eval_steps,
                [e[f"mtp{k}_acc"] for e in hist.evals],
                marker="o",
                markersize=3,
                label=f"MTP {k} acc vs truth",
            )
            ax2.plot(
                hist.eval_steps,
                [e[f"mtp{k}_agree"] for e in hist.evals],
                "--",
                color=line.get_color(),
                marker="x",
                markersize=4,
                label=f"MTP {k} agreement with main greedy",
            )
    ax2.set_xlabel("step")
    ax2.set_ylabel("fraction")
    ax2.set_ylim(0, 1)
    ax2.set_title("held-out (teacher-forced)")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def count_params(model: TinyDeepseekMTP) -> dict[str, int]:
    main = sum(p.numel() for p in model.lm.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    vh = model.lm.lm_head.weight.numel()
    saved = main + mtp + 2 * vh * len(model.mtp)  # + embed/head copies per MTP layer
    return {"main": main, "mtp_trained": mtp, "saved_tensors_total": saved}


def write_model_card(out_dir: Path, info: dict[str, Any]) -> None:
    cfg = info["config"]
    fin = info["final_eval"]
    ro = info["rollout"]
    depth_rows = "\n".join(
        f"| MTP depth {k} (token +{k + 1}) | {fin[f'mtp{k}_loss']:.3f} | {fin[f'mtp{k}_acc']:.3f} "
        f"| {fin[f'mtp{k}_agree']:.3f} | {ro[f'accept_{k}']:.3f} |"
        for k in range(1, cfg["num_nextn_predict_layers"] + 1)
    )
    a = info["args"]
    distill_txt = (
        f"+ {a['mtp_lambda']} * {a['mtp_distill']} * mean_k CE(MTP_k, softmax(main logits at t+k))"
        if a["mtp_distill"]
        else ""
    )
    text = f"""# tiny-deepseek-mtp

A ~{info["params"]["saved_tensors_total"] / 1e6:.1f}M-parameter DeepSeek-V3-architecture
causal LM with {cfg["num_nextn_predict_layers"]} trained multi-token-prediction (MTP) layers,
trained from scratch on CPU in {info["wall_minutes"]:.1f} minutes by `tools/train_tiny_mtp.py`.
It is the project's default model: small enough to ship, with MTP heads that are actually right
often enough for speculative-decoding acceptance to mean something. It writes Python-looking
text; it is not useful as a language model.

## Architecture (HF `DeepseekV3ForCausalLM`, `model_type: deepseek_v3`)

- hidden {cfg["hidden_size"]}, {cfg["num_hidden_layers"]} decoder layers (layer 0 dense MLP
  {cfg["intermediate_size"]}, layers 1-{cfg["num_hidden_layers"] - 1} MoE), vocab
  {cfg["vocab_size"]}, untied `lm_head`
- MLA: {cfg["num_attention_heads"]} heads, q_lora_rank {cfg["q_lora_rank"]}, kv_lora_rank
  {cfg["kv_lora_rank"]}, qk_nope {cfg["qk_nope_head_dim"]}, qk_rope {cfg["qk_rope_head_dim"]}
  (interleaved rope), v_head {cfg["v_head_dim"]}
- MoE: {cfg["n_routed_experts"]} routed experts (intermediate {cfg["moe_intermediate_size"]}),
  top-{cfg["num_experts_per_tok"]}, sigmoid scoring with `e_score_correction_bias` (trained with
  DeepSeek-V3's auxiliary-loss-free bias updates), n_group {cfg["n_group"]} / topk_group
  {cfg["topk_group"]}, routed_scaling_factor {cfg["routed_scaling_factor"]}, 1 shared expert
- MTP: `num_nextn_predict_layers: {cfg["num_nextn_predict_layers"]}`, stored as
  `model.layers.{cfg["num_hidden_layers"]}.*` ... (`enorm`, `hnorm`, `eh_proj`,
  `shared_head.norm`, `shared_head.head`, `embed_tokens`, and a full MoE decoder block).
  `embed_tokens` and `shared_head.head` were shared with the main model during training and are
  stored as exact copies of `model.embed_tokens.weight` / `lm_head.weight`.
- weights bf16 (router biases fp32), experts stored per expert
  (`mlp.experts.{{e}}.{{gate,up,down}}_proj.weight`), one `model.safetensors`.

MTP forward (DeepSeek-V3 report): depth k at position t combines `h_prev` (depth 1: the main
model's last hidden state after the final norm; later depths: the previous MTP layer's output)
with the embedding of token t+k (zeroed at position 0):
`h = block(eh_proj(cat[enorm(e), hnorm(h_prev)]))`, `logits = shared_head.head(shared_head.norm(h))`
predicting token t+k+1.

HF transformers loads the main model with `AutoModelForCausalLM.from_pretrained` (the MTP layers
are reported as unused weights; nothing is missing).

## Training

- Data: the `.py` sources of the Python {info["python_version"]} standard library (found via
  `sysconfig`; tests, site-packages and `encodings` tables skipped), {info["data"]["files_train"]}
  files / {info["data"]["tokens_train"]:,} tokens for training, {info["data"]["files_heldout"]}
  other files / {info["data"]["tokens_heldout"]:,} tokens held out (file i held out iff
  i % {info["args"]["heldout_every"]} == {info["args"]["heldout_every"] // 2} in sorted order).
  The text is Python Software Foundation-licensed (PSF License Agreement for Python); only
  weights derived from it and a tokenizer are distributed here.
- Tokenizer: byte-level BPE (`tokenizers`), vocab {cfg["vocab_size"]}, special tokens
  `<|endoftext|>` (eos / pad, also the file separator), `<|im_start|>`, `<|im_end|>`, ChatML
  chat template, no bos.
- Objective: `CE_main + {info["args"]["mtp_lambda"]} * mean_k CE_mtp_k`
  {distill_txt}
- {a["steps"]} steps x {a["batch_size"]} random windows x {a["seq_len"]} tokens
  ({info["tokens_seen"]:,} tokens), AdamW (lr {a["lr"]}, betas 0.9/0.95, wd
  {a["weight_decay"]}), {a["warmup"]} warmup steps then cosine to {a["min_lr_ratio"]}x, grad clip
  {a["grad_clip"]}, router bias step {a["bias_update_speed"]}, fp32 on {a["threads"]} CPU
  threads, seed {a["seed"]}; {info["train_seconds"] / 60:.1f} min of training.
- Regenerate: `python tools/train_tiny_mtp.py` (see `--help`).

## Held-out metrics (bf16-rounded weights)

Teacher-forced over {info["args"]["final_eval_windows"]} held-out windows of
{info["args"]["seq_len"]} tokens. "agree" = the draft equals the main model's own greedy
prediction of that token (what greedy speculative decoding accepts).

| head | CE | top-1 acc vs truth | agree with main greedy | greedy-rollout acceptance |
|---|---|---|---|---|
| main (token +1) | {fin["main_loss"]:.3f} | {fin["main_acc"]:.3f} | - | - |
{depth_rows}

Greedy-rollout acceptance: {info["args"]["rollout_prompts"]} held-out prompts of
{info["args"]["rollout_prompt_len"]} tokens, {info["args"]["rollout_new_tokens"]} greedy tokens
each; `accept_k` = P(drafts 1..k all equal the greedy tokens) along the greedy trajectory
(depth 2 assuming its layer attends over the full sequence, as trained). Estimated mean
acceptance length with K = {cfg["num_nextn_predict_layers"]}:
{ro["mean_acceptance_length_est"]:.2f}.
"""
    (out_dir / "README.md").write_text(text)


# --------------------------------------------------------------------------- main


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tmp = None
    if args.smoke:
        tmp = tempfile.mkdtemp(prefix="tiny_mtp_smoke_")
        out_dir = args.out or Path(tmp) / "model"
        plot_path = args.plot or Path(tmp) / "training_curves.png"
    else:
        out_dir = args.out or DEFAULT_OUT
        plot_path = args.plot or DEFAULT_PLOT
    out_dir = Path(out_dir)

    # ---- data
    root, files = stdlib_files(args.max_files)
    train_files, heldout_files = split_files(files, args.heldout_every)
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    t0 = time.time()
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_ids, _ = encode_stream(tokenizer, train_texts)
    heldout_ids, _ = encode_stream(tokenizer, heldout_texts)
    print(
        f"[data] stdlib {root}: {len(train_files)} train files ({train_ids.numel():,} tokens), "
        f"{len(heldout_files)} held-out files ({heldout_ids.numel():,} tokens); tokenizer vocab "
        f"{len(tokenizer)} in {time.time() - t0:.1f}s "
        f"({sum(map(len, train_texts)) / train_ids.numel():.2f} chars/token)",
        flush=True,
    )

    seq = args.seq_len
    gen = torch.Generator().manual_seed(args.seed + 1)

    def windows_at(stream: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        return torch.stack([stream[s : s + seq] for s in starts.tolist()])

    def even_starts(stream: torch.Tensor, count: int) -> torch.Tensor:
        return torch.linspace(0, stream.numel() - seq - 1, count).long()

    eval_windows = windows_at(heldout_ids, even_starts(heldout_ids, args.eval_windows))
    final_windows = windows_at(heldout_ids, even_starts(heldout_ids, args.final_eval_windows))
    probe = eval_windows[:2, : min(64, seq)]
    # rollout prompts: held-out text starting right after a newline
    nl_ids = {i for t, i in tokenizer.get_vocab().items() if "Ċ" in t}  # byte-level "\n"
    prompt_starts = []
    for s in even_starts(heldout_ids, args.rollout_prompts).tolist():
        while heldout_ids[s].item() not in nl_ids:
            s += 1
        prompt_starts.append(s + 1)
    prompts = torch.stack([heldout_ids[s : s + args.rollout_prompt_len] for s in prompt_starts])

    # ---- model
    config = build_config(args, tokenizer)
    torch.manual_seed(args.seed)
    model = TinyDeepseekMTP(config, args.experts_impl)
    model.train()
    params = count_params(model)
    print(
        f"[model] params: main {params['main']:,}, MTP {params['mtp_trained']:,}, saved total "
        f"{params['saved_tensors_total']:,} (~{params['saved_tensors_total'] * 2 / 2**20:.1f} "
        f"MiB bf16)",
        flush=True,
    )
    tracker = RouterLoadTracker(model, args.bias_update_speed)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed_tokens" not in name else no_decay).append(p)
    optim = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    # ---- train
    hist = History()
    n_depth = len(model.mtp)
    acc_main, acc_mtp, acc_n, acc_balance = 0.0, [0.0] * n_depth, 0, 0.0
    t_train = time.time()
    for step in range(args.steps):
        lr = lr_at(step, args)
        for group in optim.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - seq, (args.batch_size,), generator=gen)
        batch = windows_at(train_ids, starts)
        out = model(batch)
        main_loss, ces, kls = mtp_losses(out, batch, args.mtp_distill)
        mtp_loss = torch.stack(ces).mean()
        if kls:
            mtp_loss = mtp_loss + args.mtp_distill * torch.stack(kls).mean()
        loss = main_loss + args.mtp_lambda * mtp_loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optim.step()
        acc_balance += tracker.step()
        acc_main += main_loss.item()
        for k, ce in enumerate(ces):
            acc_mtp[k] += ce.item()
        acc_n += 1
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            hist.steps.append(done)
            hist.main.append(acc_main / acc_n)
            hist.mtp.append([a / acc_n for a in acc_mtp])
            elapsed = time.time() - t_train
            mtp_txt = " ".join(f"mtp{k + 1} {v:.3f}" for k, v in enumerate(hist.mtp[-1]))
            eta = elapsed / done * (args.steps - done)
            print(
                f"step {done:5d}/{args.steps} lr {lr:.2e} main {hist.main[-1]:.3f} {mtp_txt} "
                f"load max/mean {acc_balance / acc_n:.2f} | {elapsed:.0f}s, eta {eta:.0f}s "
                f"({done * args.batch_size * seq / elapsed:.0f} tok/s)",
                flush=True,
            )
            acc_main, acc_mtp, acc_n, acc_balance = 0.0, [0.0] * n_depth, 0, 0.0
        if done % args.eval_every == 0 or done == args.steps:
            ev = evaluate(model, eval_windows, args.batch_size)
            hist.eval_steps.append(done)
            hist.evals.append(ev)
            depth_txt = " ".join(
                f"mtp{k} acc {ev[f'mtp{k}_acc']:.3f} agree {ev[f'mtp{k}_agree']:.3f}"
                for k in range(1, n_depth + 1)
            )
            print(
                f"  [held-out @ {done}] main CE {ev['main_loss']:.3f} acc {ev['main_acc']:.3f} "
                f"| {depth_txt}",
                flush=True,
            )
    train_seconds = time.time() - t_train

    # ---- final metrics on the weights as shipped (bf16)
    round_to_bf16_(model)
    final = evaluate(model, final_windows, args.batch_size)
    rollout = rollout_acceptance(model, prompts, args.rollout_new_tokens)
    sequences = rollout.pop("_sequences")
    print(
        "[final held-out, bf16 weights] main CE {:.3f} acc {:.3f}".format(
            final["main_loss"], final["main_acc"]
        )
    )
    for k in range(1, n_depth + 1):
        print(
            f"  MTP depth {k}: CE {final[f'mtp{k}_loss']:.3f}  acc vs truth "
            f"{final[f'mtp{k}_acc']:.3f}  agreement with main greedy "
            f"{final[f'mtp{k}_agree']:.3f}  greedy-rollout acceptance "
            f"{rollout[f'accept_{k}']:.3f}"
        )
    print(
        f"  estimated mean acceptance length (K={n_depth}): "
        f"{rollout['mean_acceptance_length_est']:.2f}"
    )
    sample = tokenizer.decode(sequences[0])
    print("[rollout sample]\n" + sample + "\n[/rollout sample]")

    # ---- save + verify
    mtp_names = save_checkpoint(model, tokenizer, out_dir)
    write_plot(hist, plot_path, n_depth)
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    report: dict[str, Any] = {}
    if not args.no_verify:
        report = verify_checkpoint(model, tokenizer, out_dir, probe)
        print(
            f"[verify] HF load clean (missing 0, {report['unexpected_mtp_keys']} unused MTP "
            f"keys); main logits max|diff| {report['hf_main_logits_max_abs_diff']:.2e}; MTP "
            f"round-trip max|diff| {report['mtp_roundtrip_max_abs_diff']:.2e}"
        )
        print(f"[verify] HF greedy: {report['sample_prompt']!r} -> {report['sample_completion']!r}")
    wall = time.time() - t_start
    info = {
        "config": json.loads((out_dir / "config.json").read_text()),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "params": params,
        "final_eval": final,
        "rollout": rollout,
        "history": {
            "steps": hist.steps,
            "main": hist.main,
            "mtp": hist.mtp,
            "eval_steps": hist.eval_steps,
            "evals": hist.evals,
        },
        "data": {
            "files_train": len(train_files),
            "files_heldout": len(heldout_files),
            "tokens_train": train_ids.numel(),
            "tokens_heldout": heldout_ids.numel(),
        },
        "tokens_seen": args.steps * args.batch_size * seq,
        "train_seconds": train_seconds,
        "wall_minutes": wall / 60,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "verify": report,
        "mtp_weight_names": mtp_names,
    }
    write_model_card(out_dir, info)
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    first_mtp = f"model.layers.{config.num_hidden_layers}."
    print(f"[saved] {out_dir} ({size / 2**20:.2f} MiB), plot {plot_path}")
    names = [n[len(first_mtp) :] for n in mtp_names if n.startswith(first_mtp)]
    print(f"[saved] MTP layer weight names ({first_mtp}*): " + ", ".join(names))
    print(f"[done] wall {wall / 60:.1f} min (training {train_seconds / 60:.1f} min)")
    info["out_dir"] = str(out_dir)
    info["plot"] = str(plot_path)
    info["size_bytes"] = size
    return info


if __name__ == "__main__":
    main(sys.argv[1:])
