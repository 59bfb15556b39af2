# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The pieces every tiny-checkpoint builder shares: the offline BPE tokenizer (trained once per
process on stdlib sources), the "peaky" weight re-initialisation, saving an HF model, and
reading / rewriting a checkpoint folder's config.json and safetensors shards.

Weights are re-initialised "peaky" (see :func:`_peaky_reinit_`): HF's default std=0.02
makes tiny random models emit nearly uniform logits, so greedy argmax would hinge on
float noise.  With the re-init the top-1/top-2 logit gap is typically ~0.5.
"""

from __future__ import annotations

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

from vllm.model_zoo.smollm2 import CHATML_TEMPLATE

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

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


# --------------------------------------------------------------------------- folders


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
