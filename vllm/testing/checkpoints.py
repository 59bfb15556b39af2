# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tiny, deterministic Hugging Face checkpoints for the test suite.

Every builder writes a complete HF folder (``config.json``, safetensors weights,
``generation_config.json`` and the tokenizer files) that loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and returns the folder path.

Weights are re-initialised "peaky" (see :func:`_peaky_reinit_`): HF's default std=0.02
makes tiny random models emit nearly uniform logits, so greedy argmax would hinge on
float noise.  With the re-init the top-1/top-2 logit gap is typically ~0.5.

Facts about transformers 5.23 that the engine's loader relies on
-----------------------------------------------------------------

Rope config (llama, qwen2, deepseek_v3 alike): ``config.json`` holds a single
``"rope_parameters"`` dict that *contains* ``"rope_theta"`` and ``"rope_type"``
(``"default"`` when unscaled) plus the scaling keys (``factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_max_position_embeddings`` for llama3; ``factor``,
``beta_fast``, ``mscale`` ... for yarn).  There is no top-level ``rope_theta`` or
``rope_scaling`` any more.  Legacy files with top-level ``rope_theta`` / ``rope_scaling``
still load (transformers folds them into ``rope_parameters``).  Note that the config
constructors mutate a passed rope dict in place (they insert ``rope_theta``), so the
builders always pass a copy.  Weights dtype is written as ``"dtype"`` (not ``torch_dtype``).

DeepSeek-V3 safetensors names (``model.layers.{k}.`` prefix, shapes for H=hidden,
nh=heads, dn=qk_nope_head_dim, dr=qk_rope_head_dim, dv=v_head_dim, r=kv_lora_rank,
rq=q_lora_rank, E=n_routed_experts, I=moe_intermediate_size, Id=intermediate_size)::

    input_layernorm.weight                        [H]
    post_attention_layernorm.weight               [H]
    self_attn.q_proj.weight                       [nh*(dn+dr), H]    (q_lora_rank is None)
    self_attn.q_a_proj.weight                     [rq, H]            (q_lora_rank set)
    self_attn.q_a_layernorm.weight                [rq]               (q_lora_rank set)
    self_attn.q_b_proj.weight                     [nh*(dn+dr), rq]   (q_lora_rank set)
    self_attn.kv_a_proj_with_mqa.weight           [r+dr, H]
    self_attn.kv_a_layernorm.weight               [r]
    self_attn.kv_b_proj.weight                    [nh*(dn+dv), r]
    self_attn.o_proj.weight                       [H, nh*dv]
    # dense layers (k < first_k_dense_replace)
    mlp.{gate,up}_proj.weight                     [Id, H]
    mlp.down_proj.weight                          [H, Id]
    # MoE layers
    mlp.gate.weight                               [E, H]   (router, sigmoid scoring)
    mlp.gate.e_score_correction_bias              [E]      (kept float32)
    mlp.experts.{e}.{gate,up}_proj.weight         [I, H]
    mlp.experts.{e}.down_proj.weight              [H, I]
    mlp.shared_experts.{gate,up}_proj.weight      [I*n_shared_experts, H]
    mlp.shared_experts.down_proj.weight           [H, I*n_shared_experts]

In memory transformers 5.23 keeps the experts fused (``mlp.experts.gate_up_proj``
``[E, 2I, H]`` = gate rows then up rows, and ``mlp.experts.down_proj`` ``[E, H, I]``), but
``save_pretrained`` reverts its weight conversion and writes the per-expert names above,
which is also the real DeepSeek-V3 layout.  ``from_pretrained`` loads both forms
(``per_expert_names=False`` writes the fused form).  HF applies the rope to the *interleaved*
rope dims (``rope_interleave: true`` is written to config.json by default).

MTP (``num_nextn_predict_layers = n > 0``): layers ``model.layers.{N+i}.`` (N =
num_hidden_layers) hold, besides a full MoE decoder block with the names above::

    enorm.weight [H]   hnorm.weight [H]   eh_proj.weight [H, 2H]
    shared_head.norm.weight [H]   shared_head.head.weight [V, H]   embed_tokens.weight [V, H]

``eh_proj`` acts on ``cat([enorm(embed(next_token)), hnorm(hidden)], -1)``.  By default
``embed_tokens``/``shared_head.head`` are exact copies of the main model's tensors, as in the
real checkpoint (HF's ``MtpModel`` ignores them and uses the main model's anyway).  These
weights live in a second shard listed by ``model.safetensors.index.json``.  The plain
``DeepseekV3ForCausalLM`` ignores (warns about) them; ``transformers.modeling_layers.MtpModel``
can load them once the model's ``_keys_to_ignore_on_load_unexpected`` lists the MTP layer
indices (see :func:`load_hf_mtp_model`).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import shutil
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from vllm.model_executor.layers.fused_moe import fuse_experts, split_fused_experts
from vllm.model_zoo.smollm2 import CHATML_TEMPLATE, convert_smollm2, find_smollm2_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "CHATML_TEMPLATE",
    "build_tokenizer",
    "convert_smollm2",
    "find_smollm2_gguf",
    "load_hf_mtp_model",
    "logit_gaps",
    "make_deepseek_v2",
    "make_deepseek_v3",
    "make_llama",
    "make_qwen2",
]


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Peaky re-init knobs: std = _WEIGHT_GAIN / sqrt(fan_in) for projections, std = 1 for the
# input embedding, std = _LOGIT_GAIN / sqrt(H) for the output head, norms ~ U[0.5, 1.5].
_WEIGHT_GAIN = 1.0
_LOGIT_GAIN = 2.0
_BIAS_STD = 0.2
_ROUTER_BIAS_STD = 0.1

# Deterministic training corpus: stdlib files (present on any CPython install), in this order.
_CORPUS_FILES = (
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "pydoc_data/topics.py",
)
_MAX_CHARS_PER_FILE = 300_000

_TOKENIZER_JSON_CACHE: dict[int, str] = {}


# --------------------------------------------------------------------------- tokenizer


def _training_corpus() -> list[str]:
    """Read the fixed list of stdlib source files used to train the BPE tokenizer."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for rel in _CORPUS_FILES:
        path = root / rel
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace")[:_MAX_CHARS_PER_FILE])
    if not texts:  # exotic installs: fall back to sources reachable through inspect
        import heapq
        import textwrap

        texts = [inspect.getsource(textwrap), inspect.getsource(heapq)]
    return texts


def train_bpe(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``, with SPECIAL_TOKENS
    first (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _train_tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer (uncached) and return its JSON serialisation."""
    return train_bpe(_training_corpus(), vocab_size).to_str()


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train (memoised per process) a byte-level BPE tokenizer, save it to ``out_dir``.

    Special tokens: ``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (1), ``<|im_end|>``
    (2, eos); no bos.  A ChatML chat template is attached.  Returns the
    ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if vocab_size not in _TOKENIZER_JSON_CACHE:
        _TOKENIZER_JSON_CACHE[vocab_size] = _train_tokenizer_json(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_TOKENIZER_JSON_CACHE[vocab_size]),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def _token_ids(tokenizer) -> dict[str, Any]:
    """bos/eos/pad ids for the model config, matching ``tokenizer``."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


# --------------------------------------------------------------------------- weights


@torch.no_grad()
def _peaky_reinit_(module: nn.Module, seed: int, output_head: torch.Tensor | None = None) -> None:
    """Re-initialise every parameter (and router bias buffer) of ``module`` in place.

    Matrices (incl. fused 3-D expert tensors, whose last dim is fan-in) get
    ``N(0, (gain / sqrt(fan_in))^2)``; the input embedding ``N(0, 1)``; the output head
    (``output_head``, which may be tied to the embedding) ``N(0, (2 / sqrt(H))^2)``;
    norm weights ``U[0.5, 1.5]``; biases ``N(0, 0.2^2)``; ``e_score_correction_bias``
    ``N(0, 0.1^2)``.  Uses a private generator seeded with ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, param in module.named_parameters():  # tied parameters are yielded once
        shape = param.shape
        if output_head is not None and param is output_head:
            value = randn(shape) * (_LOGIT_GAIN / shape[-1] ** 0.5)
        elif "embed_tokens" in name:
            value = randn(shape)
        elif param.ndim >= 2:
            value = randn(shape) * (_WEIGHT_GAIN / shape[-1] ** 0.5)
        elif "norm" in name:
            value = torch.rand(shape, generator=gen) + 0.5
        elif name.endswith("bias"):
            value = randn(shape) * _BIAS_STD
        else:
            raise AssertionError(f"no re-init rule for parameter {name} {tuple(shape)}")
        param.copy_(value.to(param.dtype))
    for name, buf in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_((randn(buf.shape) * _ROUTER_BIAS_STD).to(buf.dtype))


def _keep_router_bias_fp32_(module: nn.Module) -> None:
    """Cast ``e_score_correction_bias`` buffers back to float32 (as in real checkpoints)."""
    for sub in module.modules():
        bias = getattr(sub, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            sub.e_score_correction_bias = bias.float()


def _rope_parameters(rope_scaling: dict[str, Any] | None, rope_theta: float) -> dict[str, Any]:
    """transformers 5 ``rope_parameters``: the scaling dict plus ``rope_theta``.

    Accepts legacy dicts that use ``"type"`` instead of ``"rope_type"``.
    """
    params: dict[str, Any] = {"rope_type": "default"}
    if rope_scaling:
        params = dict(rope_scaling)  # copy: transformers mutates it in place
        if "rope_type" not in params and "type" in params:
            params["rope_type"] = params.pop("type")
    params.setdefault("rope_theta", rope_theta)
    return params


def _save_model(model: PreTrainedModel, out_dir: str | os.PathLike, dtype: torch.dtype) -> None:
    """Cast to ``dtype`` (router biases stay fp32) and ``save_pretrained`` as safetensors."""
    model.to(dtype)
    _keep_router_bias_fp32_(model)
    model.config.dtype = dtype
    model.save_pretrained(str(out_dir), safe_serialization=True)


def _make_dense(
    arch: str,
    out_dir: str | os.PathLike,
    *,
    tie_word_embeddings: bool = False,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Shared body of :func:`make_llama` / :func:`make_qwen2`."""
    import transformers

    tokenizer = build_tokenizer(out_dir)
    config_cls = getattr(transformers, f"{arch}Config")
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    extra: dict[str, Any] = {}
    if arch == "Qwen2":
        extra = {"use_sliding_window": False, "max_window_layers": num_hidden_layers}
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=_rope_parameters(rope_scaling, rope_theta),
        rms_norm_eps=1e-6,
        **_token_ids(tokenizer),
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _peaky_reinit_(model, seed, output_head=model.get_output_embeddings().weight)
    _save_model(model, out_dir, dtype)
    return str(out_dir)


def make_llama(out_dir: str | os.PathLike, **kwargs: Any) -> str:
    """Write a tiny random ``LlamaForCausalLM`` checkpoint (+ tokenizer) to ``out_dir``.

    Keyword arguments (sizes, ``tie_word_embeddings``, ``seed``, ``dtype``, ...) are those of
    :func:`_make_dense`; ``rope_scaling`` (e.g. a llama3 dict) is stored in
    ``config.rope_parameters``.
    """
    return _make_dense("Llama", out_dir, **kwargs)


def make_qwen2(out_dir: str | os.PathLike, **kwargs: Any) -> str:
    """Write a tiny random ``Qwen2ForCausalLM`` checkpoint (random non-zero q/k/v biases).

    Keyword arguments are those of :func:`make_llama`.
    """
    return _make_dense("Qwen2", out_dir, **kwargs)


# --------------------------------------------------------------------------- DeepSeek


def update_config_json(
    folder: str | os.PathLike, updates: dict[str, Any], drop: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Set ``updates`` and delete ``drop`` in ``folder/config.json`` (keys sorted); returns the
    config as it was before."""
    path = Path(folder) / "config.json"
    before = json.loads(path.read_text())
    cfg = {k: v for k, v in before.items() if k not in drop}
    cfg.update(updates)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return before


def copy_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    updates: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
) -> str:
    """A copy of checkpoint folder src at dst (same weights), with config.json fields set
    (``updates``) or deleted (``drop``). Returns dst."""
    shutil.copytree(src, dst)
    if updates or drop:
        update_config_json(dst, updates or {}, drop)
    return str(dst)


def _read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file."""
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _write_shards(out_dir: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    """Replace the folder's weights by ``shards`` (one file, or N files plus an index)."""
    for old in list(out_dir.glob("model*.safetensors")) + list(
        out_dir.glob("model.safetensors.index.json")
    ):
        old.unlink()
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(
            {k: v.contiguous() for k, v in shards[0].items()}, out_dir / "model.safetensors", meta
        )
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, out_dir / fname, meta)
        for k, v in shard.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


@torch.no_grad()
def _mtp_state(
    model: PreTrainedModel,
    config: Any,
    n: int,
    seed: int,
    own_embed: bool,
    copy_main_head: bool,
    dtype: torch.dtype,
    block_fn: Any = None,
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 MTP tensors ``model.layers.{N+i}.*`` (per-expert / fused like HF's).

    ``block_fn(config, layer_idx)`` builds the HF decoder block (default DeepSeek-V3's)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    num_layers = config.num_hidden_layers
    hidden = config.hidden_size
    # MTP blocks are always MoE (as in DeepSeek-V3 and HF's MtpModel), whatever
    # first_k_dense_replace says.
    block_config = copy.deepcopy(config)
    block_config.first_k_dense_replace = 0
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    state: dict[str, torch.Tensor] = {}
    for i in range(n):
        idx = num_layers + i
        layer_seed = seed + 1000 * (i + 1)
        torch.manual_seed(layer_seed)
        block = (block_fn or DeepseekV3DecoderLayer)(block_config, layer_idx=idx)
        _peaky_reinit_(block, layer_seed)
        block.to(dtype)
        _keep_router_bias_fp32_(block)
        prefix = f"model.layers.{idx}."
        for k, v in split_fused_experts(block.state_dict()).items():
            state[prefix + k] = v.detach().clone()
        gen = torch.Generator().manual_seed(layer_seed + 1)

        def norm() -> torch.Tensor:
            return (torch.rand(hidden, generator=gen) + 0.5).to(dtype)  # noqa: B023

        state[prefix + "enorm.weight"] = norm()
        state[prefix + "hnorm.weight"] = norm()
        eh = torch.randn(hidden, 2 * hidden, generator=gen) * (_WEIGHT_GAIN / (2 * hidden) ** 0.5)
        state[prefix + "eh_proj.weight"] = eh.to(dtype)
        state[prefix + "shared_head.norm.weight"] = norm()
        if copy_main_head:
            state[prefix + "shared_head.head.weight"] = head.detach().clone().to(dtype)
        else:
            rand_head = torch.randn(head.shape, generator=gen) * (_LOGIT_GAIN / hidden**0.5)
            state[prefix + "shared_head.head.weight"] = rand_head.to(dtype)
        if own_embed:
            if copy_main_head:
                state[prefix + "embed_tokens.weight"] = embed.detach().clone().to(dtype)
            else:
                state[prefix + "embed_tokens.weight"] = torch.randn(embed.shape, generator=gen).to(
                    dtype
                )
    return state


def build_mla_model(
    config_cls: Any,
    model_cls: Any,
    out: Path,
    config_kwargs: dict[str, Any],
    seed: int,
    dtype: torch.dtype,
    reinit: Any,
) -> tuple[PreTrainedModel, Any]:
    """Tokenizer + a DeepSeek-family HF model (one KV head per head, as MLA has) from
    config_kwargs, re-initialised by reinit(model, seed, output_head=...) and saved to out."""
    tokenizer = build_tokenizer(out)
    config = config_cls(
        vocab_size=len(tokenizer),
        num_key_value_heads=config_kwargs["num_attention_heads"],
        rms_norm_eps=1e-6,
        **_token_ids(tokenizer),
        **config_kwargs,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    reinit(model, seed, output_head=model.get_output_embeddings().weight)
    _save_model(model, out, dtype)
    return model, config


def _make_deepseek(
    version: int,
    out_dir: str | os.PathLike,
    *,
    config_kwargs: dict[str, Any],
    num_nextn_predict_layers: int,
    mtp_own_embed: bool,
    mtp_copy_main_head: bool,
    per_expert_names: bool,
    architecture: str | None,
    seed: int,
    dtype: torch.dtype,
) -> str:
    """Shared body of :func:`make_deepseek_v3` / :func:`make_deepseek_v2`."""
    import transformers

    out = Path(out_dir)
    if version == 3:
        # DeepseekV3Config defaults num_mtp_layers (alias of num_nextn_predict_layers) to 1.
        config_kwargs = dict(config_kwargs, num_nextn_predict_layers=num_nextn_predict_layers)
    # HF writes per-expert names (reverse weight conversion).
    model, config = build_mla_model(
        getattr(transformers, f"DeepseekV{version}Config"),
        getattr(transformers, f"DeepseekV{version}ForCausalLM"),
        out,
        config_kwargs,
        seed,
        dtype,
        _peaky_reinit_,
    )

    if num_nextn_predict_layers > 0 or not per_expert_names:
        shards = [_read_safetensors(out / "model.safetensors")]
        if num_nextn_predict_layers > 0:
            shards.append(
                _mtp_state(
                    model,
                    config,
                    num_nextn_predict_layers,
                    seed,
                    mtp_own_embed,
                    mtp_copy_main_head,
                    dtype,
                )
            )
        if not per_expert_names:
            shards = [fuse_experts(s) for s in shards]
        _write_shards(out, shards)

    updates: dict[str, Any] = {}
    if architecture is not None:
        updates["architectures"] = [architecture]
    if version == 3:
        updates["num_nextn_predict_layers"] = num_nextn_predict_layers
    update_config_json(out, updates)
    return str(out)


# HF config fields of the tiny DeepSeek models (plus rope_scaling / rope_theta, folded into
# rope_parameters); each maker's ``**config`` overrides them.
V3_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 3,
    "hidden_size": 64,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_attention_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}
# DeepSeek-V2: softmax routing, greedy top-k, no expert groups.
V2_DEFAULTS: dict[str, Any] = {
    **V3_DEFAULTS,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": None,
    "topk_group": None,
}


def _config_kwargs(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` updated by ``overrides`` (unknown fields refused), rope folded."""
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise ValueError(f"unknown tiny-model config field(s) {sorted(unknown)}")
    kw = {**defaults, **overrides}
    rope = _rope_parameters(kw.pop("rope_scaling"), kw.pop("rope_theta"))
    return {**kw, "rope_parameters": rope}


def make_deepseek_v3(
    out_dir: str | os.PathLike,
    *,
    num_nextn_predict_layers: int = 0,
    mtp_own_embed: bool = True,
    mtp_copy_main_head: bool = True,
    per_expert_names: bool = True,
    architecture: str = "DeepseekV3ForCausalLM",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config: Any,
) -> str:
    """Write a tiny random DeepSeek-V3 (MLA + sigmoid/group-limited MoE) checkpoint.

    ``config`` overrides V3_DEFAULTS. With ``num_nextn_predict_layers = n > 0`` the folder is
    sharded and the second shard holds the MTP layers ``model.layers.{N+i}.*`` (see the module
    docstring). ``mtp_own_embed`` controls whether the MTP layers carry ``embed_tokens.weight``;
    ``mtp_copy_main_head=False`` makes their ``embed_tokens``/``shared_head.head`` random
    instead of copies of the main model's.  ``per_expert_names=False`` stores fused experts.
    """
    return _make_deepseek(
        3,
        out_dir,
        config_kwargs=_config_kwargs(V3_DEFAULTS, config),
        num_nextn_predict_layers=num_nextn_predict_layers,
        mtp_own_embed=mtp_own_embed,
        mtp_copy_main_head=mtp_copy_main_head,
        per_expert_names=per_expert_names,
        architecture=architecture,
        seed=seed,
        dtype=dtype,
    )


def make_deepseek_v2(
    out_dir: str | os.PathLike,
    *,
    per_expert_names: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config: Any,
) -> str:
    """Write a tiny random DeepSeek-V2 (MLA + softmax-routed MoE) checkpoint.

    ``config`` overrides V2_DEFAULTS. Same tensor names as DeepSeek-V3 minus
    ``mlp.gate.e_score_correction_bias``.
    """
    return _make_deepseek(
        2,
        out_dir,
        config_kwargs=_config_kwargs(V2_DEFAULTS, config),
        num_nextn_predict_layers=0,
        mtp_own_embed=False,
        mtp_copy_main_head=True,
        per_expert_names=per_expert_names,
        architecture=None,
        seed=seed,
        dtype=dtype,
    )


def load_hf_mtp_model(main_model: PreTrainedModel) -> nn.Module:
    """Load the MTP layers of ``main_model``'s checkpoint with transformers' ``MtpModel``.

    transformers 5.23 only recognises MTP keys listed in the model's
    ``_keys_to_ignore_on_load_unexpected`` (hard-coded to layer 61 for DeepSeek-V3), so the
    instance attribute is pointed at layers ``N .. N+n-1`` first.  Raises if any MTP
    weight is missing.  Useful as a reference implementation of MTP drafting.
    """
    from transformers.modeling_layers import MtpModel

    cfg = main_model.config.get_text_config()
    first = cfg.num_hidden_layers
    main_model._keys_to_ignore_on_load_unexpected = [
        rf"model\.layers\.{k}\..*" for k in range(first, first + cfg.num_mtp_layers)
    ]
    return MtpModel.from_pretrained(main_model).eval()


# --------------------------------------------------------------------------- SmolLM2
# The converter lives in the package (users need it too); re-exported for the tests.


# --------------------------------------------------------------------------- helpers


@torch.no_grad()
def logit_gaps(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit at every position of ``input_ids`` ([B, T] -> [B*T])."""
    logits = model(input_ids=input_ids).logits.float()
    top2 = logits.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).flatten()
